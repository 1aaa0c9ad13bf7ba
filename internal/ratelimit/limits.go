package ratelimit

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

// Scope says which bucket a Key names.
type Scope uint8

// Scopes of request-rate keys.
const (
	ScopeTenant Scope = iota + 1 // every request of a tenant
	ScopeRule                    // requests matched by one rule of a tenant
	ScopeSecret                  // requests of a tenant that inject one secret
)

func (s Scope) String() string {
	switch s {
	case ScopeTenant:
		return "tenant"
	case ScopeRule:
		return "rule"
	case ScopeSecret:
		return "secret"
	}
	return fmt.Sprintf("Scope(%d)", uint8(s))
}

// Key names one request-rate bucket. Build it with TenantKey, RuleKey or
// SecretKey from values taken from the policy.
type Key struct {
	Scope  Scope
	Tenant string
	Name   string // rule id or secret name; empty for ScopeTenant
}

// TenantKey names a tenant's request bucket.
func TenantKey(tenant string) Key { return Key{Scope: ScopeTenant, Tenant: tenant} }

// RuleKey names the bucket of one rule of a tenant.
func RuleKey(tenant, ruleID string) Key { return Key{Scope: ScopeRule, Tenant: tenant, Name: ruleID} }

// SecretKey names a tenant's budget for one secret.
func SecretKey(tenant, secret string) Key {
	return Key{Scope: ScopeSecret, Tenant: tenant, Name: secret}
}

// Resource is a kind of concurrent slot.
type Resource uint8

// Concurrent resources.
const (
	Connections Resource = iota // client connections to the proxy
	Tunnels                     // CONNECT tunnels
	numResources
)

// Direction of a byte stream, seen from the sandbox.
type Direction uint8

// Byte-stream directions.
const (
	Egress  Direction = iota // sandbox → upstream
	Ingress                  // upstream → sandbox
	numDirections
)

// ErrUnknownTenant is returned by the byte-rate wrappers when the tenant is not
// (or no longer) in the configuration.
var ErrUnknownTenant = errors.New("ratelimit: tenant not in the current policy")

type bucket struct {
	r Rate // normalised settings the limiter was made with
	l *rate.Limiter
	// mu makes "reserve, and cancel if it would have to wait" atomic. A refused
	// reservation briefly puts the bucket in debt; if another goroutine reserved
	// in between, x/time/rate cannot restore the cancelled tokens in full (it
	// assumes later reservations relied on them), so concurrent refusals would
	// leak tokens and inflate each other's retryAfter.
	mu sync.Mutex
}

// counters are a tenant's live slots. They outlive reloads (see Update).
type counters [numResources]atomic.Int64

type tenantState struct {
	requests *bucket
	rules    map[string]*bucket
	secrets  map[string]*bucket
	bytes    [numDirections]*bucket
	caps     [numResources]int
	live     *counters
}

type state struct {
	caps    [numResources]int
	tenants map[string]*tenantState
}

// Limits holds every limiter of one process. It is safe for concurrent use;
// Update swaps in a new configuration atomically.
type Limits struct {
	st     atomic.Pointer[state]
	global counters

	mu   sync.Mutex           // serialises Update
	live map[string]*counters // by tenant, kept while a tenant is configured or has live slots
}

// New builds Limits from cfg.
func New(cfg Config) (*Limits, error) {
	l := &Limits{live: make(map[string]*counters)}
	if err := l.Update(cfg); err != nil {
		return nil, err
	}
	return l, nil
}

// Update replaces the configuration. A key whose settings are unchanged keeps
// its bucket, tokens and all, so a reload cannot be used to reset a limit; keys
// that are new or whose settings changed get a new, full bucket; keys no longer
// configured are dropped. Concurrency counters survive reloads (live
// connections still hold their slots); a tenant removed while it still holds
// slots keeps its counters so that re-adding it does not double its allowance.
// On error nothing changes.
func (l *Limits) Update(cfg Config) error {
	if cfg.MaxConnections < 0 || cfg.MaxTunnels < 0 {
		return errors.New("ratelimit: global connection and tunnel caps must not be negative")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	old := l.st.Load()
	ns := &state{
		caps:    [numResources]int{Connections: cfg.MaxConnections, Tunnels: cfg.MaxTunnels},
		tenants: make(map[string]*tenantState, len(cfg.Tenants)),
	}
	ids := make([]string, 0, len(cfg.Tenants))
	for id := range cfg.Tenants {
		ids = append(ids, id)
	}
	sort.Strings(ids) // deterministic errors
	for _, id := range ids {
		var prev *tenantState
		if old != nil {
			prev = old.tenants[id]
		}
		ts, err := buildTenant(cfg.Tenants[id], prev)
		if err != nil {
			return fmt.Errorf("ratelimit: tenant %q: %w", id, err)
		}
		ns.tenants[id] = ts
	}
	// Only now that nothing can fail, touch the shared counters.
	for id, ts := range ns.tenants {
		c := l.live[id]
		if c == nil {
			c = new(counters)
			l.live[id] = c
		}
		ts.live = c
	}
	for id, c := range l.live {
		if _, ok := ns.tenants[id]; !ok && c[Connections].Load() == 0 && c[Tunnels].Load() == 0 {
			delete(l.live, id)
		}
	}
	l.st.Store(ns)
	return nil
}

func buildTenant(tc TenantConfig, prev *tenantState) (*tenantState, error) {
	if tc.MaxConnections < 0 || tc.MaxTunnels < 0 {
		return nil, errors.New("connection and tunnel caps must not be negative")
	}
	ts := &tenantState{caps: [numResources]int{Connections: tc.MaxConnections, Tunnels: tc.MaxTunnels}}
	var err error
	var pb *bucket
	if prev != nil {
		pb = prev.requests
	}
	if ts.requests, err = reuse(tc.Requests, pb); err != nil {
		return nil, fmt.Errorf("requests: %w", err)
	}
	var prevRules, prevSecrets map[string]*bucket
	if prev != nil {
		prevRules, prevSecrets = prev.rules, prev.secrets
	}
	if ts.rules, err = reuseMap(tc.Rules, prevRules); err != nil {
		return nil, fmt.Errorf("rule %w", err)
	}
	if ts.secrets, err = reuseMap(tc.Secrets, prevSecrets); err != nil {
		return nil, fmt.Errorf("secret %w", err)
	}
	for d, bps := range [numDirections]int64{Egress: tc.EgressBytesPerSecond, Ingress: tc.IngressBytesPerSecond} {
		r, limited, err := byteRate(bps)
		if err != nil {
			return nil, err
		}
		if !limited {
			continue
		}
		if prev != nil && prev.bytes[d] != nil && prev.bytes[d].r == r {
			ts.bytes[d] = prev.bytes[d]
		} else {
			ts.bytes[d] = newBucket(r)
		}
	}
	return ts, nil
}

func newBucket(r Rate) *bucket {
	return &bucket{r: r, l: rate.NewLimiter(rate.Limit(r.PerSecond), r.Burst)}
}

// reuse returns prev if it was made with the same settings as r, a new bucket
// otherwise, and nil when r is unlimited.
func reuse(r Rate, prev *bucket) (*bucket, error) {
	n, limited, err := r.normalize()
	if err != nil || !limited {
		return nil, err
	}
	if prev != nil && prev.r == n {
		return prev, nil
	}
	return newBucket(n), nil
}

func reuseMap(rates map[string]Rate, prev map[string]*bucket) (map[string]*bucket, error) {
	out := make(map[string]*bucket, len(rates))
	for name, r := range rates {
		if name == "" {
			return nil, errors.New("with an empty name")
		}
		b, err := reuse(r, prev[name])
		if err != nil {
			return nil, fmt.Errorf("%q: %w", name, err)
		}
		if b != nil {
			out[name] = b
		}
	}
	return out, nil
}

// lookup returns the bucket for k (nil when unlimited) and whether k's tenant is known.
func (s *state) lookup(k Key) (*bucket, bool) {
	ts := s.tenants[k.Tenant]
	if ts == nil {
		return nil, false
	}
	switch k.Scope {
	case ScopeTenant:
		return ts.requests, true
	case ScopeRule:
		return ts.rules[k.Name], true
	case ScopeSecret:
		return ts.secrets[k.Name], true
	}
	return nil, false
}

// Allow spends one token of k's bucket now. See AllowAt.
func (l *Limits) Allow(k Key) (ok bool, retryAfter time.Duration) {
	return l.AllowAt(k, time.Now())
}

// AllowAt spends one token of k's bucket at now. A key with no configured rate
// is unlimited. A key whose tenant is unknown, or with an invalid scope, is
// refused with retryAfter 0 (fail closed: nothing will change until a reload).
// When refused, retryAfter is how long until a token is available; the proxy
// rounds it up to whole seconds for Retry-After.
func (l *Limits) AllowAt(k Key, now time.Time) (ok bool, retryAfter time.Duration) {
	b, known := l.st.Load().lookup(k)
	if !known {
		return false, 0
	}
	if b == nil {
		return true, 0
	}
	return take(b, now)
}

func take(b *bucket, now time.Time) (bool, time.Duration) {
	// Same as reserve, without handing the reservation out (which would make it
	// escape to the heap on the hot path).
	b.mu.Lock()
	defer b.mu.Unlock()
	res := b.l.ReserveN(now, 1)
	if !res.OK() {
		return false, 0
	}
	if d := res.DelayFrom(now); d > 0 {
		res.CancelAt(now)
		return false, d
	}
	return true, 0
}

// reserve takes one token at now. It returns the reservation when the token was
// available immediately; otherwise nil and how long until it will be.
func (b *bucket) reserve(now time.Time) (*rate.Reservation, time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	res := b.l.ReserveN(now, 1)
	if !res.OK() { // cannot happen with burst >= 1, but never allow by accident
		return nil, 0
	}
	if d := res.DelayFrom(now); d > 0 {
		// Give the token back: a refused request must not eat into the budget of
		// the ones after it.
		res.CancelAt(now)
		return nil, d
	}
	return res, 0
}

// release gives back a token taken by reserve, for an all-or-nothing check that
// failed on a later key. Only immediate reservations are ever released, so the
// bucket is never left in debt.
func (b *bucket) release(res *rate.Reservation, now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	res.CancelAt(now)
}

// AllowAll spends one token from each of keys, all or nothing: if any bucket
// refuses, the tokens already taken from the others are given back, so a
// request refused by, say, its secret's budget does not also use up its
// tenant's. It returns the first refusing key and its retryAfter.
func (l *Limits) AllowAll(now time.Time, keys ...Key) (ok bool, retryAfter time.Duration, refused Key) {
	st := l.st.Load()
	type taken struct {
		b   *bucket
		res *rate.Reservation
	}
	var buf [8]taken
	held := buf[:0]
	defer func() {
		if !ok {
			for _, t := range held {
				t.b.release(t.res, now)
			}
		}
	}()
	for _, k := range keys {
		b, known := st.lookup(k)
		if !known {
			return false, 0, k
		}
		if b == nil {
			continue
		}
		res, d := b.reserve(now)
		if res == nil {
			return false, d, k
		}
		held = append(held, taken{b, res})
	}
	return true, 0, Key{}
}

// Acquire takes one concurrent slot of kind for tenant, checked against the
// tenant's cap and the process-wide cap. release gives it back and may be
// called any number of times; it must be called once the connection or tunnel
// ends. When ok is false, release is a no-op. Unknown tenants are refused.
func (l *Limits) Acquire(kind Resource, tenant string) (release func(), ok bool) {
	if kind >= numResources {
		return func() {}, false
	}
	st := l.st.Load()
	ts := st.tenants[tenant]
	if ts == nil {
		return func() {}, false
	}
	tc, gc := &ts.live[kind], &l.global[kind]
	if n := tc.Add(1); ts.caps[kind] > 0 && n > int64(ts.caps[kind]) {
		tc.Add(-1)
		return func() {}, false
	}
	if n := gc.Add(1); st.caps[kind] > 0 && n > int64(st.caps[kind]) {
		gc.Add(-1)
		tc.Add(-1)
		return func() {}, false
	}
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			tc.Add(-1)
			gc.Add(-1)
		}
	}, true
}

// InUse reports the slots of kind held by tenant, or process-wide when tenant is "".
func (l *Limits) InUse(kind Resource, tenant string) int {
	if kind >= numResources {
		return 0
	}
	if tenant == "" {
		return int(l.global[kind].Load())
	}
	ts := l.st.Load().tenants[tenant]
	if ts == nil {
		return 0
	}
	return int(ts.live[kind].Load())
}
