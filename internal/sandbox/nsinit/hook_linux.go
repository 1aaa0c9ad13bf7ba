package nsinit

import "os"

// The sandbox's init is the sluice binary itself, and a Go program
// initialises every package it links before main runs: for sluice that is
// the proxy, Vault, Prometheus and protobuf packages, which cost more CPU
// than everything the init does afterwards and sit on every launch's
// critical path. Package initialisation runs in dependency order, so this
// package, which depends on little, is initialised early; when the process
// is a sandbox's init it runs the init here and exits, and the packages it
// does not need are never initialised. (runc starts its container init
// from an init function for a similar reason.)
//
// The process must be PID 1 of a new pid namespace and named exactly as the
// launcher names it; anything else (a person typing the hidden command)
// falls through to the normal command line, which refuses it.
func init() {
	if len(os.Args) == 2 && os.Args[0] == Argv0 && os.Args[1] == Command && os.Getpid() == 1 {
		os.Exit(Main())
	}
}
