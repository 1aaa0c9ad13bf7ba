// Package proxy answers one question: what happens to a request that a sandbox
// sends out? It wires goproxy into sluice's per-request pipeline (identify,
// normalise, decide, limit, inject, forward, scrub, record — DESIGN.md steps
// 1–8), which reads top to bottom in pipeline.go. CONNECT tunnels are decided
// like requests and are either spliced after an SNI check or intercepted, in
// which case every request inside is re-bound to the tunnel's host and decided
// again against the current policy.
package proxy
