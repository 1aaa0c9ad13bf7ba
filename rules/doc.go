// Package rules answers one question: what does the policy say about this
// request? It owns the configuration file's schema, decodes it strictly, compiles
// it into an immutable Policy and decides requests against it without
// allocating. It knows nothing of HTTP servers or proxies.
package rules
