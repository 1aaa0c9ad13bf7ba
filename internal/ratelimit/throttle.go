package ratelimit

import (
	"errors"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Defaults for FailureThrottle.
const (
	DefaultAuthFailuresPerMinute = 30
	DefaultFailureTableSize      = 65536
)

// FailureThrottle limits failed proxy authentications per source address, so a
// sandbox (or anything else that reaches the listener) cannot brute-force
// credentials. Each source gets a bucket of perMinute failures that refills at
// perMinute per minute; a source whose bucket is empty is refused before its
// credentials are even checked.
//
// IPv4 sources are keyed by address, IPv6 sources by their /64, since one host
// usually controls a whole /64. The table is bounded: when it is full, only
// buckets that have refilled completely (and so limit nothing) are evicted.
// If none has, new sources are refused as if throttled rather than evicting a
// bucket that is still limiting someone: evicting would let an attacker with
// many addresses reset the throttle on the one it is brute-forcing from. This
// fails closed; a flood of sources can delay new legitimate sources until
// buckets refill, which the proxy's audit log and metrics make visible.
type FailureThrottle struct {
	perMinute int
	max       int
	every     rate.Limit
	backoff   time.Duration // minimum time between fruitless sweeps of a full table

	mu            sync.Mutex
	table         map[netip.Addr]*rate.Limiter
	lastFruitless time.Time
}

// NewFailureThrottle returns a throttle allowing perMinute failures per source
// per minute and tracking at most maxSources sources. Zero selects
// DefaultAuthFailuresPerMinute and DefaultFailureTableSize respectively; the
// throttle cannot be switched off.
func NewFailureThrottle(perMinute, maxSources int) (*FailureThrottle, error) {
	if perMinute < 0 {
		return nil, errors.New("ratelimit: auth failures per minute must not be negative")
	}
	if maxSources < 0 {
		return nil, errors.New("ratelimit: failure table size must not be negative")
	}
	if perMinute == 0 {
		perMinute = DefaultAuthFailuresPerMinute
	}
	if maxSources == 0 {
		maxSources = DefaultFailureTableSize
	}
	// A sweep only helps once some bucket may have refilled; retrying sooner
	// than one token's worth of refill would just burn CPU under a flood.
	backoff := time.Minute / time.Duration(perMinute)
	return &FailureThrottle{
		perMinute: perMinute,
		max:       maxSources,
		every:     rate.Limit(float64(perMinute) / 60),
		backoff:   backoff,
		table:     make(map[netip.Addr]*rate.Limiter),
	}, nil
}

// sourceKey maps an address to its table key: IPv4 (also when mapped into
// IPv6) as itself, IPv6 as its /64, zones dropped.
func sourceKey(a netip.Addr) netip.Addr {
	a = a.Unmap().WithZone("")
	if a.Is6() {
		return netip.PrefixFrom(a, 64).Masked().Addr()
	}
	return a
}

// Allowed reports whether addr may attempt to authenticate now.
func (t *FailureThrottle) Allowed(addr netip.Addr) bool { return t.AllowedAt(addr, time.Now()) }

// AllowedAt reports whether addr may attempt to authenticate at now. An invalid
// address is refused.
func (t *FailureThrottle) AllowedAt(addr netip.Addr, now time.Time) bool {
	if !addr.IsValid() {
		return false
	}
	k := sourceKey(addr)
	t.mu.Lock()
	defer t.mu.Unlock()
	if l := t.table[k]; l != nil {
		return l.TokensAt(now) >= 1
	}
	return len(t.table) < t.max || t.makeRoom(now)
}

// Failed records a failed authentication from addr.
func (t *FailureThrottle) Failed(addr netip.Addr) { t.FailedAt(addr, time.Now()) }

// FailedAt records a failed authentication from addr at now.
func (t *FailureThrottle) FailedAt(addr netip.Addr, now time.Time) {
	if !addr.IsValid() {
		return
	}
	k := sourceKey(addr)
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.table[k]
	if l == nil {
		if len(t.table) >= t.max && !t.makeRoom(now) {
			// No room: this source is refused by AllowedAt anyway.
			return
		}
		l = rate.NewLimiter(t.every, t.perMinute)
		l.SetLimitAt(now, t.every) // anchor the bucket's clock at now, not at creation
		t.table[k] = l
	}
	// AllowN rather than ReserveN: an empty bucket stays empty (no debt), so a
	// source is unblocked as soon as one failure's worth has refilled.
	l.AllowN(now, 1)
}

// makeRoom evicts every bucket that has refilled to full and reports whether
// any was evicted. Called with t.mu held.
func (t *FailureThrottle) makeRoom(now time.Time) bool {
	if !t.lastFruitless.IsZero() && now.Sub(t.lastFruitless) < t.backoff {
		return false
	}
	freed := false
	full := float64(t.perMinute)
	for k, l := range t.table {
		if l.TokensAt(now) >= full {
			delete(t.table, k)
			freed = true
		}
	}
	if !freed {
		t.lastFruitless = now
	}
	return freed
}

// Len is the number of sources currently tracked.
func (t *FailureThrottle) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.table)
}
