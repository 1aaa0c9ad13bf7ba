// Package audit answers one question: what happened, provably? It defines the
// audit record, writes records as hash-chained JSON lines with group commit
// (so a request that got a response has a durable record), reads rotated and
// compressed record sets back in order, verifies the chain, and turns records
// into the reviewer's views: filtered listings, summaries and draft allowlists.
package audit
