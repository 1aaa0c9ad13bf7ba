// Package broker answers one question: what is the current value of secret X,
// and is it fresh?
//
// Secrets come from a Source (HashiCorp Vault KV v2, or a local file) and are
// fetched at start and refreshed in the background, so no request ever waits
// on Vault: Get only reads an atomically swapped snapshot. A value older than
// its maximum staleness is refused (ErrStale), which the proxy turns into a
// 503, so an unreachable Vault degrades into a closed gate rather than into
// requests sent without, or with long-revoked, credentials.
//
// The package also owns the two pure helpers the proxy needs around a secret:
// expanding an injection template (Render) and removing any reflected secret
// from a response (Scrubber, ScrubHeader).
//
// Start does not fail when a secret cannot be fetched: the proxy must still
// serve rules that need no secret. Such a secret is unavailable (Get returns
// ErrUnavailable, every request needing it is refused) and Ready reports it,
// so /readyz stays red until it arrives.
//
// Secret values are held in Value, which redacts itself in every formatting,
// encoding and logging path. Errors and log records carry secret names only.
package broker
