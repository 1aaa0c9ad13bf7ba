// Package certs answers one question: which certificate does sluice present for
// host H when it intercepts a CONNECT tunnel to H?
//
// It owns sluice's interception CA (an ECDSA P-256 key pair created by
// `sluice ca init`, never goproxy's built-in CA, whose private key is public),
// issues short-lived leaf certificates signed by that CA, caches them (bounded
// LRU, one issuance per host at a time, renewed before expiry, flushed when the
// CA rotates), and exports the trust bundle that sandboxes install so that they
// accept those leaves.
package certs
