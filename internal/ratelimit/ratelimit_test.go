package ratelimit

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicehq/sluice/rules"
)

var t0 = time.Unix(1_800_000_000, 0)

func mustNew(t *testing.T, cfg Config) *Limits {
	t.Helper()
	l, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestBurstExactUnderParallelLoad(t *testing.T) {
	const burst = 10
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{
		"acme": {Requests: Rate{PerSecond: 2, Burst: burst}},
	}})
	var allowed atomic.Int64
	var wg sync.WaitGroup
	bad := make(chan string, 32*8) // room for every request: a failing run must not deadlock
	for g := 0; g < 32; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 8; i++ {
				ok, retry := l.AllowAt(TenantKey("acme"), t0)
				if ok {
					allowed.Add(1)
					if retry != 0 {
						bad <- "allowed with a retryAfter"
					}
				} else if retry <= 0 || retry > 500*time.Millisecond {
					// Rate 2/s: the next token is at most half a second away.
					bad <- "refused with retryAfter " + retry.String()
				}
			}
		}()
	}
	wg.Wait()
	close(bad)
	for b := range bad {
		t.Fatal(b)
	}
	if got := allowed.Load(); got != burst {
		t.Fatalf("allowed %d of 256 parallel requests, want exactly %d", got, burst)
	}
	// Refusals gave their tokens back: exactly one more after half a second.
	if ok, _ := l.AllowAt(TenantKey("acme"), t0.Add(499*time.Millisecond)); ok {
		t.Fatal("allowed before a token refilled")
	}
	if ok, _ := l.AllowAt(TenantKey("acme"), t0.Add(500*time.Millisecond)); !ok {
		t.Fatal("refused after a token refilled (refused reservations were not cancelled?)")
	}
	if ok, retry := l.AllowAt(TenantKey("acme"), t0.Add(500*time.Millisecond)); ok || retry != 500*time.Millisecond {
		t.Fatalf("got %v %v, want refused with 500ms", ok, retry)
	}
}

func TestAllowKeys(t *testing.T) {
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{
		"acme": {
			Rules:   map[string]Rate{"acme/allow/0": {PerSecond: 1, Burst: 2}},
			Secrets: map[string]Rate{"github": {PerSecond: 1}}, // burst defaults to 1
		},
		"beta": {Secrets: map[string]Rate{"github": {PerSecond: 1, Burst: 1}}},
	}})
	// Tenant without a request rate: unlimited.
	for i := 0; i < 100; i++ {
		if ok, _ := l.AllowAt(TenantKey("acme"), t0); !ok {
			t.Fatal("unlimited tenant refused")
		}
	}
	// Unconfigured rule of a known tenant: unlimited.
	if ok, _ := l.AllowAt(RuleKey("acme", "acme/allow/9"), t0); !ok {
		t.Fatal("unlimited rule refused")
	}
	// Unknown tenant and bad scope: fail closed.
	if ok, retry := l.AllowAt(TenantKey("nobody"), t0); ok || retry != 0 {
		t.Fatal("unknown tenant allowed")
	}
	if ok, _ := l.AllowAt(Key{Scope: 99, Tenant: "acme"}, t0); ok {
		t.Fatal("invalid scope allowed")
	}
	n := 0
	for i := 0; i < 5; i++ {
		if ok, _ := l.AllowAt(RuleKey("acme", "acme/allow/0"), t0); ok {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("rule bucket allowed %d, want 2", n)
	}
	// A secret's budget is per tenant: beta's is untouched by acme's use.
	if ok, _ := l.AllowAt(SecretKey("acme", "github"), t0); !ok {
		t.Fatal("first secret use refused")
	}
	if ok, retry := l.AllowAt(SecretKey("acme", "github"), t0); ok || retry != time.Second {
		t.Fatalf("second secret use: %v %v", ok, retry)
	}
	if ok, _ := l.AllowAt(SecretKey("beta", "github"), t0); !ok {
		t.Fatal("beta's secret budget was spent by acme")
	}
	// Allow uses the wall clock.
	if ok, _ := l.Allow(TenantKey("beta")); !ok {
		t.Fatal("Allow refused an unlimited tenant")
	}
}

func TestAllowAllIsAtomic(t *testing.T) {
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{
		"acme": {
			Requests: Rate{PerSecond: 0.001, Burst: 5},
			Rules:    map[string]Rate{"r": {PerSecond: 0.001, Burst: 4}},
			Secrets:  map[string]Rate{"gh": {PerSecond: 0.001, Burst: 2}},
		},
	}})
	keys := []Key{TenantKey("acme"), RuleKey("acme", "r"), SecretKey("acme", "gh")}
	for i := 0; i < 2; i++ {
		if ok, _, _ := l.AllowAll(t0, keys...); !ok {
			t.Fatalf("request %d refused", i)
		}
	}
	ok, retry, refused := l.AllowAll(t0, keys...)
	if ok || refused != SecretKey("acme", "gh") || retry <= 0 {
		t.Fatalf("third request: ok=%v retry=%v refused=%+v", ok, retry, refused)
	}
	// The refused request took nothing from the tenant or rule buckets: the rule
	// (burst 4, 2 used) still has exactly 2.
	n := 0
	for i := 0; i < 5; i++ {
		if ok, _, _ := l.AllowAll(t0, TenantKey("acme"), RuleKey("acme", "r")); ok {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("after a refused AllowAll, %d requests passed, want 2", n)
	}
	if ok, _, refused := l.AllowAll(t0, TenantKey("ghost")); ok || refused.Tenant != "ghost" {
		t.Fatal("AllowAll allowed an unknown tenant")
	}
}

func TestTunnelCap(t *testing.T) {
	l := mustNew(t, Config{MaxTunnels: 5, Tenants: map[string]TenantConfig{
		"acme": {MaxTunnels: 3},
		"beta": {},
	}})
	var rel []func()
	for i := 0; i < 3; i++ {
		r, ok := l.Acquire(Tunnels, "acme")
		if !ok {
			t.Fatalf("tunnel %d refused", i)
		}
		rel = append(rel, r)
	}
	if _, ok := l.Acquire(Tunnels, "acme"); ok {
		t.Fatal("4th tunnel allowed over a tenant cap of 3")
	}
	// Connections are counted separately from tunnels.
	if r, ok := l.Acquire(Connections, "acme"); !ok {
		t.Fatal("connection refused")
	} else {
		r()
	}
	// Release is idempotent.
	rel[0]()
	rel[0]()
	rel[0]()
	if got := l.InUse(Tunnels, "acme"); got != 2 {
		t.Fatalf("acme holds %d tunnels after one release, want 2", got)
	}
	// Global cap 5: acme 2 + beta 3, then beta is refused although uncapped.
	for i := 0; i < 3; i++ {
		if _, ok := l.Acquire(Tunnels, "beta"); !ok {
			t.Fatalf("beta tunnel %d refused", i)
		}
	}
	if _, ok := l.Acquire(Tunnels, "beta"); ok {
		t.Fatal("tunnel allowed over the global cap")
	}
	if l.InUse(Tunnels, "") != 5 || l.InUse(Tunnels, "beta") != 3 {
		t.Fatalf("in use: global %d beta %d", l.InUse(Tunnels, ""), l.InUse(Tunnels, "beta"))
	}
	if _, ok := l.Acquire(Tunnels, "nobody"); ok {
		t.Fatal("unknown tenant got a tunnel")
	}
	if _, ok := l.Acquire(Resource(7), "acme"); ok {
		t.Fatal("invalid resource allowed")
	}
}

func TestTunnelCapParallel(t *testing.T) {
	const cap = 7
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{"acme": {MaxTunnels: cap}}})
	var got atomic.Int64
	var mu sync.Mutex
	var rels []func()
	var wg sync.WaitGroup
	for g := 0; g < 40; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r, ok := l.Acquire(Tunnels, "acme"); ok {
				got.Add(1)
				mu.Lock()
				rels = append(rels, r)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if got.Load() != cap {
		t.Fatalf("%d tunnels acquired in parallel, want %d", got.Load(), cap)
	}
	for _, r := range rels {
		wg.Add(2)
		go func() { defer wg.Done(); r() }()
		go func() { defer wg.Done(); r() }()
	}
	wg.Wait()
	if l.InUse(Tunnels, "acme") != 0 || l.InUse(Tunnels, "") != 0 {
		t.Fatalf("after concurrent double releases: %d / %d", l.InUse(Tunnels, "acme"), l.InUse(Tunnels, ""))
	}
}

func TestUpdateKeepsBuckets(t *testing.T) {
	cfg := Config{Tenants: map[string]TenantConfig{
		"acme": {
			Requests:   Rate{PerSecond: 0.001, Burst: 3},
			Rules:      map[string]Rate{"r1": {PerSecond: 0.001, Burst: 1}, "r2": {PerSecond: 0.001, Burst: 1}},
			MaxTunnels: 2,
		},
		"beta": {Requests: Rate{PerSecond: 0.001, Burst: 1}},
	}}
	l := mustNew(t, cfg)
	for i := 0; i < 3; i++ {
		l.AllowAt(TenantKey("acme"), t0)
	}
	l.AllowAt(RuleKey("acme", "r1"), t0)
	l.AllowAt(RuleKey("acme", "r2"), t0)
	l.AllowAt(TenantKey("beta"), t0)
	rel, _ := l.Acquire(Tunnels, "acme")
	l.Acquire(Tunnels, "acme")

	// Same settings for acme's request bucket and r1, new settings for r2,
	// beta removed, gamma added.
	cfg2 := Config{Tenants: map[string]TenantConfig{
		"acme": {
			Requests:   Rate{PerSecond: 0.001, Burst: 3},
			Rules:      map[string]Rate{"r1": {PerSecond: 0.001, Burst: 1}, "r2": {PerSecond: 0.001, Burst: 2}},
			MaxTunnels: 2,
		},
		"gamma": {Requests: Rate{PerSecond: 0.001, Burst: 1}},
	}}
	if err := l.Update(cfg2); err != nil {
		t.Fatal(err)
	}
	if ok, _ := l.AllowAt(TenantKey("acme"), t0); ok {
		t.Fatal("reload refilled an unchanged tenant bucket")
	}
	if ok, _ := l.AllowAt(RuleKey("acme", "r1"), t0); ok {
		t.Fatal("reload refilled an unchanged rule bucket")
	}
	if ok, _ := l.AllowAt(RuleKey("acme", "r2"), t0); !ok {
		t.Fatal("changed rule did not get a new bucket")
	}
	if ok, _ := l.AllowAt(TenantKey("beta"), t0); ok {
		t.Fatal("removed tenant still allowed")
	}
	if ok, _ := l.AllowAt(TenantKey("gamma"), t0); !ok {
		t.Fatal("new tenant refused")
	}
	// Live tunnels survived the reload and still count against the cap.
	if _, ok := l.Acquire(Tunnels, "acme"); ok {
		t.Fatal("reload reset the tunnel count")
	}
	rel()
	if _, ok := l.Acquire(Tunnels, "acme"); !ok {
		t.Fatal("released slot not reusable after reload")
	}
	// Reloading twice with the same config changes nothing either.
	if err := l.Update(cfg2); err != nil {
		t.Fatal(err)
	}
	if ok, _ := l.AllowAt(TenantKey("gamma"), t0); ok {
		t.Fatal("second reload refilled gamma")
	}
}

func TestUpdateRemovedTenantKeepsLiveCounters(t *testing.T) {
	one := Config{Tenants: map[string]TenantConfig{"acme": {MaxTunnels: 1}}}
	l := mustNew(t, one)
	rel, ok := l.Acquire(Tunnels, "acme")
	if !ok {
		t.Fatal("refused")
	}
	if err := l.Update(Config{Tenants: map[string]TenantConfig{}}); err != nil {
		t.Fatal(err)
	}
	if err := l.Update(one); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Acquire(Tunnels, "acme"); ok {
		t.Fatal("removing and re-adding a tenant reset its live tunnel count")
	}
	rel()
	if _, ok := l.Acquire(Tunnels, "acme"); !ok {
		t.Fatal("slot not freed")
	}
}

func TestConfigErrors(t *testing.T) {
	for name, cfg := range map[string]Config{
		"negative global": {MaxTunnels: -1},
		"negative cap":    {Tenants: map[string]TenantConfig{"a": {MaxConnections: -1}}},
		"negative rate":   {Tenants: map[string]TenantConfig{"a": {Requests: Rate{PerSecond: -1}}}},
		"negative burst":  {Tenants: map[string]TenantConfig{"a": {Rules: map[string]Rate{"r": {PerSecond: 1, Burst: -2}}}}},
		"empty rule id":   {Tenants: map[string]TenantConfig{"a": {Rules: map[string]Rate{"": {PerSecond: 1}}}}},
		"negative bytes":  {Tenants: map[string]TenantConfig{"a": {EgressBytesPerSecond: -5}}},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// A failed Update leaves the previous configuration in place.
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{"a": {Requests: Rate{PerSecond: 0.001, Burst: 1}}}})
	l.AllowAt(TenantKey("a"), t0)
	if err := l.Update(Config{Tenants: map[string]TenantConfig{"b": {MaxTunnels: -1}}}); err == nil {
		t.Fatal("bad update accepted")
	}
	if ok, _ := l.AllowAt(TenantKey("a"), t0); ok {
		t.Fatal("failed update reset the bucket")
	}
}

// tcpPair returns both ends of a real TCP connection on 127.0.0.1.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(acc)
			return
		}
		acc <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-acc
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

func TestByteRateReaderOverTCP(t *testing.T) {
	const bps = 64 << 10
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{"acme": {IngressBytesPerSecond: bps}}})
	burst, _, _ := byteRate(bps)
	total := burst.Burst + bps // the initial burst is free, then one second's worth
	client, server := tcpPair(t)
	go func() {
		buf := make([]byte, total)
		_, _ = server.Write(buf)
		server.(*net.TCPConn).CloseWrite()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	n, err := io.Copy(io.Discard, l.Reader(ctx, "acme", Ingress, client))
	elapsed := time.Since(start)
	if err != nil || n != int64(total) {
		t.Fatalf("copied %d of %d: %v", n, total, err)
	}
	want := time.Duration(float64(total-burst.Burst) / bps * float64(time.Second))
	if elapsed < want*8/10 || elapsed > want*12/10 {
		t.Fatalf("%d bytes at %d B/s took %v, want %v ±20%%", total, bps, elapsed, want)
	}
	t.Logf("%d bytes in %v (expected %v): %.0f B/s after the initial burst", total, elapsed, want, float64(total-burst.Burst)/elapsed.Seconds())
}

func TestByteRateWriterOverTCP(t *testing.T) {
	const bps = 128 << 10
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{"acme": {EgressBytesPerSecond: bps}}})
	burst, _, _ := byteRate(bps)
	total := burst.Burst + bps/2 // half a second after the burst
	client, server := tcpPair(t)
	got := make(chan int64, 1)
	go func() {
		n, _ := io.Copy(io.Discard, server)
		got <- n
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	w := l.Writer(ctx, "acme", Egress, client)
	n, err := w.Write(make([]byte, total)) // one large write is split into bursts
	elapsed := time.Since(start)
	client.(*net.TCPConn).CloseWrite()
	if err != nil || n != total {
		t.Fatalf("wrote %d of %d: %v", n, total, err)
	}
	if r := <-got; r != int64(total) {
		t.Fatalf("peer received %d of %d", r, total)
	}
	want := time.Duration(float64(total-burst.Burst) / bps * float64(time.Second))
	if elapsed < want*8/10 || elapsed > want*12/10 {
		t.Fatalf("%d bytes at %d B/s took %v, want %v ±20%%", total, bps, elapsed, want)
	}
}

func TestByteRateCancelAndUnknown(t *testing.T) {
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{
		"acme": {IngressBytesPerSecond: 1, EgressBytesPerSecond: 1},
		"free": {},
	}})
	client, server := tcpPair(t)
	go func() { _, _ = server.Write(make([]byte, 64)) }()
	ctx, cancel := context.WithCancel(context.Background())
	r := l.Reader(ctx, "acme", Ingress, client)
	buf := make([]byte, 64)
	// Burst at 1 B/s is 1 byte: the first read is free, the second must wait ~1s.
	if n, err := r.Read(buf); n != 1 || err != nil {
		t.Fatalf("first read: %d %v", n, err)
	}
	time.AfterFunc(50*time.Millisecond, cancel)
	start := time.Now()
	_, err := r.Read(buf)
	if !errors.Is(err, context.Canceled) && (err == nil || !strings.Contains(err.Error(), "context")) {
		t.Fatalf("read after cancel: %v", err)
	}
	if time.Since(start) > 900*time.Millisecond {
		t.Fatal("cancellation did not interrupt the wait")
	}
	if _, err := l.Writer(ctx, "acme", Egress, io.Discard).Write([]byte("x")); err == nil {
		t.Fatal("write on a cancelled context succeeded")
	}
	// Unlimited tenant: pass-through.
	if n, err := l.Writer(context.Background(), "free", Egress, io.Discard).Write(make([]byte, 1<<20)); n != 1<<20 || err != nil {
		t.Fatalf("unlimited write: %d %v", n, err)
	}
	// A tenant removed by a reload stops its streams.
	w := l.Writer(context.Background(), "free", Egress, io.Discard)
	if err := l.Update(Config{Tenants: map[string]TenantConfig{"acme": {}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("x")); !errors.Is(err, ErrUnknownTenant) {
		t.Fatalf("write after tenant removal: %v", err)
	}
	if _, err := l.Reader(context.Background(), "free", Ingress, strings.NewReader("x")).Read(buf); !errors.Is(err, ErrUnknownTenant) {
		t.Fatalf("read for unknown tenant: %v", err)
	}
}

func TestFailureThrottleLimits(t *testing.T) {
	ft, err := NewFailureThrottle(3, 100)
	if err != nil {
		t.Fatal(err)
	}
	a := netip.MustParseAddr("127.0.0.2")
	for i := 0; i < 3; i++ {
		if !ft.AllowedAt(a, t0) {
			t.Fatalf("refused after %d failures", i)
		}
		ft.FailedAt(a, t0)
	}
	if ft.AllowedAt(a, t0) {
		t.Fatal("allowed after 3 failures at 3/minute")
	}
	// Mapped form of the same address shares the bucket.
	if ft.AllowedAt(netip.MustParseAddr("::ffff:127.0.0.2"), t0) {
		t.Fatal("IPv4-mapped address escaped the throttle")
	}
	if !ft.AllowedAt(netip.MustParseAddr("127.0.0.3"), t0) {
		t.Fatal("another source was throttled")
	}
	// One failure's worth refills in 20s; failing again when empty adds no debt.
	ft.FailedAt(a, t0.Add(time.Second))
	if ft.AllowedAt(a, t0.Add(19*time.Second)) || !ft.AllowedAt(a, t0.Add(20*time.Second)) {
		t.Fatal("refill timing wrong")
	}
	// IPv6 sources are keyed by /64.
	v6 := netip.MustParseAddr("2001:db8:1:2::1")
	for i := 0; i < 3; i++ {
		ft.FailedAt(v6, t0)
	}
	if ft.AllowedAt(netip.MustParseAddr("2001:db8:1:2:ffff::99"), t0) {
		t.Fatal("same /64 not throttled")
	}
	if !ft.AllowedAt(netip.MustParseAddr("2001:db8:1:3::1"), t0) {
		t.Fatal("other /64 throttled")
	}
	if ft.AllowedAt(netip.Addr{}, t0) {
		t.Fatal("invalid address allowed")
	}
	if _, err := NewFailureThrottle(-1, 1); err == nil {
		t.Fatal("negative rate accepted")
	}
	if _, err := NewFailureThrottle(1, -1); err == nil {
		t.Fatal("negative table size accepted")
	}
	if d, err := NewFailureThrottle(0, 0); err != nil || d.perMinute != DefaultAuthFailuresPerMinute || d.max != DefaultFailureTableSize {
		t.Fatalf("defaults: %v", err)
	}
}

func TestFailureThrottleTableFull(t *testing.T) {
	ft, err := NewFailureThrottle(3, 4)
	if err != nil {
		t.Fatal(err)
	}
	attacker := netip.MustParseAddr("127.0.1.1")
	for i := 0; i < 3; i++ {
		ft.FailedAt(attacker, t0)
	}
	for i := 2; i <= 4; i++ {
		ft.FailedAt(netip.AddrFrom4([4]byte{127, 0, 1, byte(i)}), t0)
	}
	if ft.Len() != 4 {
		t.Fatalf("table has %d entries", ft.Len())
	}
	newcomer := netip.MustParseAddr("127.0.2.1")
	// Full, and every bucket is still below full: refuse the newcomer rather
	// than evict (fail closed), and do not record it.
	if ft.AllowedAt(newcomer, t0.Add(time.Second)) {
		t.Fatal("new source allowed while the table is full of limiting buckets")
	}
	ft.FailedAt(newcomer, t0.Add(time.Second))
	if ft.Len() != 4 {
		t.Fatal("table grew past its bound")
	}
	// A second sweep is not attempted sooner than one token's refill (20s)
	// after a fruitless one, so a flood of newcomers cannot make every call scan.
	if ft.AllowedAt(newcomer, t0.Add(20*time.Second)) {
		t.Fatal("sweep retried before the backoff")
	}
	// 21s later the three one-failure sources have refilled to full; the
	// attacker (3 failures) has not. A newcomer evicts only the refilled ones.
	later := t0.Add(21 * time.Second)
	if !ft.AllowedAt(newcomer, later) {
		t.Fatal("newcomer refused although refilled buckets could be evicted")
	}
	if ft.Len() != 1 {
		t.Fatalf("after sweep the table has %d entries, want only the attacker", ft.Len())
	}
	if !ft.AllowedAt(attacker, later) || ft.AllowedAt(attacker, t0.Add(time.Second)) {
		t.Fatal("attacker's bucket was reset by eviction")
	}
	// Filling the table with a flood of sources never resets the attacker.
	for i := 0; i < 50; i++ {
		ft.FailedAt(netip.AddrFrom4([4]byte{127, 0, 3, byte(i)}), later)
	}
	if ft.Len() != 4 {
		t.Fatalf("table size %d, bound 4", ft.Len())
	}
	tokens := func() float64 {
		ft.mu.Lock()
		defer ft.mu.Unlock()
		l := ft.table[sourceKey(attacker)]
		if l == nil {
			return -1
		}
		return l.TokensAt(later)
	}()
	if tokens < 0 || tokens >= 3 {
		t.Fatalf("attacker's bucket lost or reset (tokens %v)", tokens)
	}
}

func TestFailureThrottleConcurrent(t *testing.T) {
	ft, _ := NewFailureThrottle(30, 64)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 500; i++ {
				a := netip.AddrFrom4([4]byte{127, 0, byte(g), byte(i % 200)})
				if ft.Allowed(a) {
					ft.Failed(a)
				}
			}
		}(g)
	}
	wg.Wait()
	if ft.Len() > 64 {
		t.Fatalf("table exceeded its bound: %d", ft.Len())
	}
}

func TestFromPolicy(t *testing.T) {
	yaml := `version: 1
limits:
  max_connections: 100
  max_tunnels: 50
secrets:
  - name: gh
    source: file
    hosts: [api.github.com]
    limits: {requests_per_second: 2, burst: 3}
  - name: other
    source: file
    hosts: [api.github.com]
tenants:
  - id: acme
    limits:
      requests_per_second: 20
      burst: 40
      max_tunnels: 8
      max_connections: 16
      egress_bytes_per_second: 1MiB
      ingress_bytes_per_second: 2048
    allow:
      - host: api.github.com
        id: gh-api
        limits: {requests_per_second: 5}
        inject:
          - header: Authorization
            value: "Bearer ${secret:gh} ${secret:other}"
      - host: pypi.org
  - id: beta
    allow:
      - host: pypi.org
`
	cfg, err := rules.Parse([]byte(yaml), "test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	p, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c := FromPolicy(p)
	if c.MaxConnections != 100 || c.MaxTunnels != 50 {
		t.Fatalf("globals: %+v", c)
	}
	a := c.Tenants["acme"]
	if a.Requests != (Rate{20, 40}) || a.MaxTunnels != 8 || a.MaxConnections != 16 || a.EgressBytesPerSecond != 1<<20 || a.IngressBytesPerSecond != 2048 {
		t.Fatalf("acme: %+v", a)
	}
	if len(a.Rules) != 1 || a.Rules["gh-api"] != (Rate{5, 0}) {
		t.Fatalf("acme rules: %+v", a.Rules)
	}
	if len(a.Secrets) != 1 || a.Secrets["gh"] != (Rate{2, 3}) {
		t.Fatalf("acme secrets: %+v", a.Secrets)
	}
	if b, ok := c.Tenants["beta"]; !ok || b.Requests != (Rate{}) || len(b.Secrets) != 0 {
		t.Fatalf("beta: %+v %v", b, ok)
	}
	l := mustNew(t, c)
	if ok, _ := l.AllowAt(RuleKey("acme", "gh-api"), t0); !ok {
		t.Fatal("rule refused")
	}
}

func BenchmarkAllow(b *testing.B) {
	l, _ := New(Config{Tenants: map[string]TenantConfig{"acme": {Requests: Rate{PerSecond: 1e9, Burst: 1 << 30}}}})
	k := TenantKey("acme")
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			l.Allow(k)
		}
	})
}

func TestAllowAllParallel(t *testing.T) {
	l := mustNew(t, Config{Tenants: map[string]TenantConfig{
		"acme": {
			Requests: Rate{PerSecond: 1, Burst: 20},
			Secrets:  map[string]Rate{"gh": {PerSecond: 1, Burst: 5}},
		},
	}})
	var passed atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 4; i++ {
				if ok, retry, _ := l.AllowAll(t0, TenantKey("acme"), SecretKey("acme", "gh")); ok {
					passed.Add(1)
				} else if retry <= 0 || retry > time.Second {
					t.Errorf("retryAfter %v", retry)
				}
			}
		}()
	}
	wg.Wait()
	if passed.Load() != 5 {
		t.Fatalf("%d requests passed a secret budget of 5", passed.Load())
	}
	// The 59 refused requests gave back every tenant token they took.
	n := 0
	for i := 0; i < 30; i++ {
		if ok, _ := l.AllowAt(TenantKey("acme"), t0); ok {
			n++
		}
	}
	if n != 15 {
		t.Fatalf("tenant bucket has %d tokens left, want 15", n)
	}
}
