//go:build race

package main

// raceEnabled builds the binary under test with the race detector when the
// tests themselves run with it, so end-to-end tests check the real server too.
const raceEnabled = true
