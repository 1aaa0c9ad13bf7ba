// Package ratelimit answers one question: may this key spend one more token now?
//
// Keys always come from the compiled policy (a tenant id, a rule id, a secret
// name), never from strings an attacker chooses, so the set of limiters is
// bounded by the configuration. The one exception is FailureThrottle, keyed by
// source address, which keeps a bounded table and fails closed when it is full.
//
// Limits is rebuilt from each policy generation with Update, which keeps the
// buckets of unchanged keys: reloading the configuration must not be a way to
// refill a bucket.
package ratelimit
