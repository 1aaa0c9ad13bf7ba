// Package rules answers one question: what does the policy say about this
// request? It owns the configuration file's schema, decodes it strictly, compiles
// it into an immutable Policy and decides requests against it without
// allocating. It knows nothing of HTTP servers or proxies.
//
// The policy only ever sees canonical spellings: callers pass hosts through
// NormalizeHost (or ParseAuthority) and paths through NormalizePath, and then
// act on what they passed in — dial and check SNI against the normalised host,
// forward the normalised path — so the upstream receives exactly what was
// decided. Inputs with more than one plausible reading are refused rather
// than guessed at.
package rules
