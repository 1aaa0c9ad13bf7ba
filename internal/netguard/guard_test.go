package netguard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// testDNS is a real DNS server on 127.0.0.1 (UDP and TCP on one port) that
// answers A and AAAA queries from a fixed table and counts what it is asked.
type testDNS struct {
	addr string

	mu      sync.Mutex
	records map[string][]netip.Addr // fully qualified, lower case
	rebind  map[string][]netip.Addr // answers after the first A query
	queries map[string]int          // "name/TYPE" -> count
	tcp     int                     // queries that arrived over TCP
}

func (s *testDNS) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	if len(req.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		_ = w.WriteMsg(m)
		return
	}
	q := req.Question[0]
	name := strings.ToLower(q.Name)

	s.mu.Lock()
	key := name + "/" + dns.TypeToString[q.Qtype]
	s.queries[key]++
	_, overTCP := w.RemoteAddr().(*net.TCPAddr)
	if overTCP {
		s.tcp++
	}
	answers, ok := s.records[name]
	if later, rebinds := s.rebind[name]; rebinds && q.Qtype == dns.TypeA && s.queries[key] > 1 {
		answers = later
	}
	s.mu.Unlock()

	if !ok {
		m.Rcode = dns.RcodeNameError
		_ = w.WriteMsg(m)
		return
	}
	for _, a := range answers {
		hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 0}
		switch {
		case q.Qtype == dns.TypeA && a.Is4():
			hdr.Rrtype = dns.TypeA
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IP(a.AsSlice())})
		case q.Qtype == dns.TypeAAAA && a.Is6():
			hdr.Rrtype = dns.TypeAAAA
			m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: net.IP(a.AsSlice())})
		}
	}
	if !overTCP {
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		m.Truncate(size) // sets TC, so the client retries over TCP
	}
	_ = w.WriteMsg(m)
}

func (s *testDNS) count(name, qtype string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queries[name+"/"+qtype]
}

func (s *testDNS) total() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.queries {
		n += c
	}
	return n
}

func (s *testDNS) tcpQueries() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tcp
}

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, 0, len(ss))
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func startDNS(t testing.TB) *testDNS {
	t.Helper()
	s := &testDNS{
		records: map[string][]netip.Addr{
			"loop4.test.":     addrs("127.0.0.1"),
			"ten.test.":       addrs("10.0.0.1"),
			"p192.test.":      addrs("192.168.1.1"),
			"p172.test.":      addrs("172.16.0.1"),
			"cgnat.test.":     addrs("100.64.0.1"),
			"meta.test.":      addrs("169.254.169.254"),
			"loop6.test.":     addrs("::1"),
			"mapped.test.":    addrs("::ffff:127.0.0.1"),
			"meta6.test.":     addrs("fd00:ec2::254"),
			"ula.test.":       addrs("fc00::1"),
			"nat64.test.":     addrs("64:ff9b::7f00:1"),
			"sixtofour.test.": addrs("2002:7f00:1::1"),
			"teredo.test.":    {teredo("65.54.227.120", "127.0.0.1")},
			"mixed.test.":     addrs("127.0.0.1", "203.0.113.5"),
			"dual.test.":      addrs("127.0.0.1", "::1"),
			"rebind.test.":    addrs("127.0.0.1"),
		},
		rebind:  map[string][]netip.Addr{"rebind.test.": addrs("10.0.0.1")},
		queries: map[string]int{},
	}
	// Answers too large for one UDP datagram, so they arrive over TCP.
	var many, manyMixed []netip.Addr
	many = append(many, netip.MustParseAddr("127.0.0.1"))
	for i := 1; i < 100; i++ {
		a := netip.AddrFrom4([4]byte{127, 0, 1, byte(i)})
		many = append(many, a)
		manyMixed = append(manyMixed, a)
	}
	manyMixed = append(manyMixed, netip.MustParseAddr("10.0.0.1"))
	s.records["many.test."] = many
	s.records["manymixed.test."] = manyMixed

	var lastErr error
	for range 10 {
		pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("dns: listen udp: %v", err)
		}
		ln, err := net.Listen("tcp4", pc.LocalAddr().String())
		if err != nil {
			pc.Close()
			lastErr = err
			continue
		}
		s.addr = pc.LocalAddr().String()
		for _, srv := range []*dns.Server{{PacketConn: pc, Handler: s}, {Listener: ln, Handler: s}} {
			started := make(chan struct{})
			srv.NotifyStartedFunc = func() { close(started) }
			go func() { _ = srv.ActivateAndServe() }()
			<-started
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_ = srv.ShutdownContext(ctx)
			})
		}
		return s
	}
	t.Fatalf("dns: no port free for both udp and tcp: %v", lastErr)
	return nil
}

// countingListener records every connection it accepts.
type countingListener struct {
	net.Listener
	accepted chan string // remote addresses, in accept order
}

func listenCounting(t *testing.T, network, addr string) (*countingListener, error) {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		return nil, err
	}
	l := &countingListener{Listener: ln, accepted: make(chan string, 4096)}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			l.accepted <- c.RemoteAddr().String()
			c.Close()
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return l, nil
}

func (l *countingListener) port() uint16 {
	return uint16(l.Addr().(*net.TCPAddr).Port)
}

// expectAccepts checks that exactly want connections were accepted since the
// last call. It dials a sentinel connection with a plain dialer and drains
// until the sentinel shows up: accepts are FIFO, so anything the guard let
// through earlier has been counted by then, without sleeping on a guess.
func (l *countingListener) expectAccepts(t *testing.T, want int) {
	t.Helper()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatalf("sentinel dial: %v", err)
	}
	sentinel := c.LocalAddr().String()
	defer c.Close()
	got := 0
	timeout := time.After(10 * time.Second)
	for {
		select {
		case a := <-l.accepted:
			if a == sentinel {
				if got != want {
					t.Errorf("listener %s accepted %d connections, want %d", l.Addr(), got, want)
				}
				return
			}
			got++
		case <-timeout:
			t.Fatalf("listener %s: sentinel never accepted", l.Addr())
		}
	}
}

// loopbackPair starts listeners on 127.0.0.1 and, when the host has IPv6
// loopback, on [::1] with the same port, so a name resolving to either family
// would land on a listener we count.
func loopbackPair(t *testing.T) (v4, v6 *countingListener) {
	t.Helper()
	for range 10 {
		l4, err := listenCounting(t, "tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		l6, err := listenCounting(t, "tcp6", net.JoinHostPort("::1", strconv.Itoa(int(l4.port()))))
		if err == nil {
			return l4, l6
		}
		if probe, perr := net.Listen("tcp6", "[::1]:0"); perr != nil {
			return l4, nil // no IPv6 loopback on this host
		} else {
			probe.Close()
		}
	}
	t.Fatal("no port free on both 127.0.0.1 and [::1]")
	return nil, nil
}

// newTestGuard builds a Guard whose sockets additionally pass a tripwire: if
// anything other than a loopback address ever reaches connect, the test fails
// and the connect is stopped, so a broken guard cannot send a packet off host.
func newTestGuard(t *testing.T, opts Options) *Guard {
	t.Helper()
	g, err := New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	inner := g.dialer.ControlContext
	if inner == nil {
		t.Fatal("guard dialer has no ControlContext: the second line is missing")
	}
	g.dialer.ControlContext = func(ctx context.Context, network, address string, c syscall.RawConn) error {
		ap, err := netip.ParseAddrPort(address)
		if err != nil || !ap.Addr().Unmap().IsLoopback() {
			t.Errorf("tripwire: guard tried to connect to %s", address)
			return errors.New("tripwire")
		}
		return inner(ctx, network, address, c)
	}
	return g
}

func hostPort(host string, port uint16) string {
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}

func wantDenied(t *testing.T, err error, class string) *DeniedError {
	t.Helper()
	var de *DeniedError
	if !errors.As(err, &de) {
		t.Fatalf("err = %v, want *DeniedError class %q", err, class)
	}
	if class != "" && de.Class != class {
		t.Fatalf("class = %q (%v), want %q", de.Class, err, class)
	}
	if !errors.Is(err, ErrDenied) {
		t.Fatalf("errors.Is(%v, ErrDenied) = false", err)
	}
	return de
}

func TestDialRefusesForbiddenAnswers(t *testing.T) {
	d := startDNS(t)
	l4, l6 := loopbackPair(t)
	var logBuf bytes.Buffer
	var logMu sync.Mutex
	logger := slog.New(slog.NewJSONHandler(&lockedWriter{w: &logBuf, mu: &logMu}, nil))
	g := newTestGuard(t, Options{Resolver: d.addr, Logger: logger})

	cases := []struct{ name, class, ip string }{
		{"loop4.test", ClassLoopback, "127.0.0.1"},
		{"ten.test", ClassPrivate, "10.0.0.1"},
		{"p192.test", ClassPrivate, "192.168.1.1"},
		{"p172.test", ClassPrivate, "172.16.0.1"},
		{"cgnat.test", ClassCGNAT, "100.64.0.1"},
		{"meta.test", ClassMetadata, "169.254.169.254"},
		{"loop6.test", ClassLoopback, "::1"},
		{"mapped.test", ClassLoopback, ""},
		{"meta6.test", ClassMetadata, "fd00:ec2::254"},
		{"ula.test", ClassULA, "fc00::1"},
		{"nat64.test", ClassNAT64, "64:ff9b::7f00:1"},
		{"sixtofour.test", Class6to4, "2002:7f00:1::1"},
		{"teredo.test", ClassTeredo, teredo("65.54.227.120", "127.0.0.1").String()},
		{"dual.test", ClassLoopback, ""},
		{"LOOP4.test.", ClassLoopback, "127.0.0.1"}, // case and trailing dot change nothing
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			for _, network := range []string{"tcp", "tcp4", "tcp6"} {
				conn, err := g.DialContext(ctx, network, hostPort(c.name, l4.port()))
				if conn != nil {
					conn.Close()
				}
				if network != "tcp" && errors.Is(err, ErrResolve) {
					continue // no answer of that family: nothing to check or dial
				}
				de := wantDenied(t, err, c.class)
				if c.ip != "" && de.IP != netip.MustParseAddr(c.ip) {
					t.Errorf("%s: refused IP %s, want %s", network, de.IP, c.ip)
				}
				if de.Host != c.name || de.Port != l4.port() {
					t.Errorf("%s: error names %q port %d", network, de.Host, de.Port)
				}
			}
		})
	}
	// Also with an unrelated exception: it must not open anything else.
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")})
	for _, name := range []string{"loop4.test", "loop6.test", "meta.test", "p192.test", "mapped.test"} {
		_, err := g.DialContext(ctx, "tcp", hostPort(name, l4.port()))
		wantDenied(t, err, "")
	}

	// The mixed answer is refused whichever address comes first...
	_, err := g.DialContext(context.Background(), "tcp", hostPort("mixed.test", l4.port()))
	de := wantDenied(t, err, "")
	if de.Class != ClassLoopback && de.Class != ClassReserved {
		t.Errorf("mixed.test: class %q", de.Class)
	}
	// ...and when loopback is allowed, the other answer still refuses the
	// whole dial rather than being skipped.
	lo := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})
	_, err = g.DialContext(lo, "tcp", hostPort("mixed.test", l4.port()))
	de = wantDenied(t, err, ClassReserved)
	if de.IP != netip.MustParseAddr("203.0.113.5") {
		t.Errorf("mixed.test: refused %s, want 203.0.113.5", de.IP)
	}

	l4.expectAccepts(t, 0)
	if l6 != nil {
		l6.expectAccepts(t, 0)
	}

	logMu.Lock()
	logged := logBuf.String()
	logMu.Unlock()
	if !strings.Contains(logged, `"class":"metadata"`) || !strings.Contains(logged, `"host":"meta.test"`) {
		t.Errorf("refusals not logged with host and class:\n%s", logged)
	}
}

type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (lw *lockedWriter) Write(p []byte) (int, error) {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	return lw.w.Write(p)
}

func TestDialLoopbackException(t *testing.T) {
	d := startDNS(t)
	l4, l6 := loopbackPair(t)
	g := newTestGuard(t, Options{Resolver: d.addr})
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})

	for _, name := range []string{"loop4.test", "mapped.test"} {
		conn, err := g.DialContext(ctx, "tcp", hostPort(name, l4.port()))
		if err != nil {
			t.Fatalf("%s with 127.0.0.0/8 exception: %v", name, err)
		}
		if got := conn.RemoteAddr().String(); got != hostPort("127.0.0.1", l4.port()) {
			t.Errorf("%s connected to %s", name, got)
		}
		conn.Close()
	}
	l4.expectAccepts(t, 2)

	// 127.0.0.0/8 says nothing about ::1.
	_, err := g.DialContext(ctx, "tcp", hostPort("loop6.test", l4.port()))
	wantDenied(t, err, ClassLoopback)
	if l6 != nil {
		l6.expectAccepts(t, 0)
		ctx6 := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("::1/128")})
		conn, err := g.DialContext(ctx6, "tcp", hostPort("loop6.test", l4.port()))
		if err != nil {
			t.Fatalf("loop6.test with ::1/128 exception: %v", err)
		}
		conn.Close()
		l6.expectAccepts(t, 1)
		// dual.test answers 127.0.0.1 and ::1: allowing one family is not enough.
		_, err = g.DialContext(ctx6, "tcp", hostPort("dual.test", l4.port()))
		wantDenied(t, err, ClassLoopback)
		l6.expectAccepts(t, 0)
	}
	l4.expectAccepts(t, 0)

	// A nested context's exceptions replace the outer ones.
	_, err = g.DialContext(WithExceptions(ctx, nil), "tcp", hostPort("loop4.test", l4.port()))
	wantDenied(t, err, ClassLoopback)
	l4.expectAccepts(t, 0)
}

func TestDialProxySelf(t *testing.T) {
	d := startDNS(t)
	origin, _ := loopbackPair(t)
	self, err := listenCounting(t, "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	selfAP := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), self.port())
	g := newTestGuard(t, Options{Resolver: d.addr, DenyAddrs: []netip.AddrPort{selfAP}})
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})

	for _, addr := range []string{
		hostPort("loop4.test", self.port()),
		hostPort("127.0.0.1", self.port()),
		hostPort("::ffff:127.0.0.1", self.port()),
		hostPort("mapped.test", self.port()),
	} {
		_, err := g.DialContext(ctx, "tcp", addr)
		wantDenied(t, err, ClassProxySelf)
	}
	self.expectAccepts(t, 0)
	// The same exception still reaches another port.
	conn, err := g.DialContext(ctx, "tcp", hostPort("loop4.test", origin.port()))
	if err != nil {
		t.Fatalf("origin: %v", err)
	}
	conn.Close()
	origin.expectAccepts(t, 1)
	if err := g.CheckAddrPort(ctx, selfAP); !errors.Is(err, ErrDenied) {
		t.Errorf("CheckAddrPort(self) = %v", err)
	}
	if err := g.CheckAddrPort(ctx, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), origin.port())); err != nil {
		t.Errorf("CheckAddrPort(origin) = %v", err)
	}

	// A wildcard listen address covers every loopback address on that port.
	wild := newTestGuard(t, Options{Resolver: d.addr, DenyAddrs: []netip.AddrPort{
		netip.AddrPortFrom(netip.IPv4Unspecified(), self.port()),
	}})
	for _, addr := range []string{hostPort("127.0.0.1", self.port()), hostPort("127.0.0.2", self.port()), hostPort("::1", self.port())} {
		_, err := wild.DialContext(WithExceptions(ctx, []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}), "tcp", addr)
		wantDenied(t, err, ClassProxySelf)
	}
	self.expectAccepts(t, 0)
	conn, err = wild.DialContext(ctx, "tcp", hostPort("127.0.0.1", origin.port()))
	if err != nil {
		t.Fatalf("wildcard guard, other port: %v", err)
	}
	conn.Close()
	origin.expectAccepts(t, 1)
}

func TestDialIPLiterals(t *testing.T) {
	d := startDNS(t)
	l4, l6 := loopbackPair(t)
	g := newTestGuard(t, Options{Resolver: d.addr})
	p := l4.port()

	literals := []string{hostPort("127.0.0.1", p), hostPort("::ffff:127.0.0.1", p), hostPort("127.0.0.2", p)}
	if l6 != nil {
		literals = append(literals, hostPort("::1", p))
	}
	for _, addr := range literals {
		_, err := g.DialContext(context.Background(), "tcp", addr)
		wantDenied(t, err, ClassLoopback)
	}
	for _, addr := range []string{hostPort("0.0.0.0", p), hostPort("::", p)} {
		_, err := g.DialContext(WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("0.0.0.0/8")}), "tcp", addr)
		wantDenied(t, err, ClassUnspecified)
	}
	_, err := g.DialContext(context.Background(), "tcp", hostPort("169.254.169.254", p))
	wantDenied(t, err, ClassMetadata)
	_, err = g.DialContext(context.Background(), "tcp", hostPort("64:ff9b::127.0.0.1", p))
	wantDenied(t, err, ClassNAT64)
	l4.expectAccepts(t, 0)
	if l6 != nil {
		l6.expectAccepts(t, 0)
	}

	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")})
	for _, addr := range []string{hostPort("127.0.0.1", p), hostPort("::ffff:127.0.0.1", p)} {
		conn, err := g.DialContext(ctx, "tcp", addr)
		if err != nil {
			t.Fatalf("%s with exception: %v", addr, err)
		}
		conn.Close()
	}
	l4.expectAccepts(t, 2)
	if l6 != nil {
		conn, err := g.DialContext(ctx, "tcp", hostPort("::1", p))
		if err != nil {
			t.Fatalf("[::1] with exception: %v", err)
		}
		conn.Close()
		l6.expectAccepts(t, 1)
		// A v4 literal over tcp6 has no address of that family.
		if _, err := g.DialContext(ctx, "tcp6", hostPort("127.0.0.1", p)); !errors.Is(err, ErrResolve) {
			t.Errorf("tcp6 to an IPv4 literal: %v", err)
		}
	}

	// Odd spellings never reach a resolver or a socket.
	before := d.total()
	for _, addr := range []string{
		"2130706433:" + strconv.Itoa(int(p)),
		"127.1:" + strconv.Itoa(int(p)),
		"0x7f000001:" + strconv.Itoa(int(p)),
		"0x7f.0.0.1:" + strconv.Itoa(int(p)),
		"0177.0.0.1:" + strconv.Itoa(int(p)),
		"017700000001:" + strconv.Itoa(int(p)),
		"127.0.0.1.:" + strconv.Itoa(int(p)),
		"[fe80::1%lo]:" + strconv.Itoa(int(p)),
		"[::1%lo]:" + strconv.Itoa(int(p)),
		"loop4.test%00:" + strconv.Itoa(int(p)),
		"a b.test:" + strconv.Itoa(int(p)),
		":" + strconv.Itoa(int(p)),
		"127.0.0.1:http",
		"127.0.0.1:0",
		"127.0.0.1:65536",
		"127.0.0.1:-1",
		"127.0.0.1",
		"[::1]",
	} {
		_, err := g.DialContext(ctx, "tcp", addr)
		if !errors.Is(err, ErrInvalidAddr) {
			t.Errorf("DialContext(%q) = %v, want ErrInvalidAddr", addr, err)
		}
	}
	for _, network := range []string{"udp", "unix", "ip", "", "tcp5"} {
		if _, err := g.DialContext(ctx, network, hostPort("127.0.0.1", p)); !errors.Is(err, ErrInvalidAddr) {
			t.Errorf("network %q: %v", network, err)
		}
	}
	if n := d.total() - before; n != 0 {
		t.Errorf("invalid addresses caused %d DNS queries", n)
	}
	l4.expectAccepts(t, 0)
}

func TestDialAnswersOverTCP(t *testing.T) {
	d := startDNS(t)
	l4, _ := loopbackPair(t)
	g := newTestGuard(t, Options{Resolver: d.addr})
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})

	conn, err := g.DialContext(ctx, "tcp4", hostPort("many.test", l4.port()))
	if err != nil {
		t.Fatalf("many.test: %v", err)
	}
	conn.Close()
	l4.expectAccepts(t, 1)
	if d.tcpQueries() == 0 {
		t.Fatal("the large answer never went over TCP; the test does not test what it says")
	}
	// One forbidden record among a hundred allowed ones, delivered over TCP.
	_, err = g.DialContext(ctx, "tcp4", hostPort("manymixed.test", l4.port()))
	de := wantDenied(t, err, ClassPrivate)
	if de.IP != netip.MustParseAddr("10.0.0.1") {
		t.Errorf("refused %s, want 10.0.0.1", de.IP)
	}
	l4.expectAccepts(t, 0)
}

func TestDialRebinding(t *testing.T) {
	d := startDNS(t)
	l4, _ := loopbackPair(t)
	g := newTestGuard(t, Options{Resolver: d.addr})
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")})

	conn, err := g.DialContext(ctx, "tcp4", hostPort("rebind.test", l4.port()))
	if err != nil {
		t.Fatalf("first dial: %v", err)
	}
	conn.Close()
	if n := d.count("rebind.test.", "A"); n != 1 {
		t.Fatalf("one dial sent %d A queries, want 1: the guard must not resolve twice", n)
	}
	l4.expectAccepts(t, 1)
	// The name now points at a private address: the next dial checks the
	// fresh answer (no cache to hide behind) and refuses it.
	_, err = g.DialContext(ctx, "tcp4", hostPort("rebind.test", l4.port()))
	wantDenied(t, err, ClassPrivate)
	if n := d.count("rebind.test.", "A"); n != 2 {
		t.Fatalf("two dials sent %d A queries, want 2", n)
	}
	l4.expectAccepts(t, 0)
}

func TestDialResolveErrors(t *testing.T) {
	d := startDNS(t)
	g := newTestGuard(t, Options{Resolver: d.addr})
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("::1/128"), netip.MustParsePrefix("127.0.0.0/8")})

	_, err := g.DialContext(ctx, "tcp", "nxdomain.test:443")
	if !errors.Is(err, ErrResolve) {
		t.Fatalf("nxdomain: %v, want ErrResolve", err)
	}
	var dnsErr *net.DNSError
	if !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
		t.Errorf("nxdomain: %v does not carry a not-found *net.DNSError", err)
	}
	if errors.Is(err, ErrDenied) {
		t.Error("a resolution failure must not look like a refusal")
	}
	// Only an AAAA record, asked for IPv4.
	if _, err := g.DialContext(ctx, "tcp4", "loop6.test:443"); !errors.Is(err, ErrResolve) {
		t.Errorf("tcp4 to an AAAA-only name: %v, want ErrResolve", err)
	}

	// A server that never answers: the lookup is bounded by the context.
	silent, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	mute := newTestGuard(t, Options{Resolver: silent.LocalAddr().String()})
	tctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := mute.DialContext(tctx, "tcp", "loop4.test:443"); !errors.Is(err, ErrResolve) {
		t.Errorf("silent resolver: %v, want ErrResolve", err)
	}
	// The guard's own dial timeout bounds it too.
	short := newTestGuard(t, Options{Resolver: silent.LocalAddr().String(), DialTimeout: 200 * time.Millisecond})
	if _, err := short.DialContext(ctx, "tcp", "loop4.test:443"); !errors.Is(err, ErrResolve) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("silent resolver, short dial timeout: %v", err)
	}
	cctx, ccancel := context.WithCancel(ctx)
	ccancel()
	if _, err := g.DialContext(cctx, "tcp", "loop4.test:443"); err == nil {
		t.Error("cancelled context dialled anyway")
	}
}

// TestControlSecondLine bypasses resolution and the first check by calling the
// internal dial path with forbidden targets: the socket's ControlContext must
// stop them before connect.
func TestControlSecondLine(t *testing.T) {
	l4, l6 := loopbackPair(t)
	self, err := listenCounting(t, "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	selfAP := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), self.port())
	// No tripwire here: every target is loopback, and the point is to see the
	// guard's own ControlContext, unwrapped, do the refusing.
	g, err := New(Options{DenyAddrs: []netip.AddrPort{selfAP}})
	if err != nil {
		t.Fatal(err)
	}
	target4 := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), l4.port())
	target6 := netip.AddrPortFrom(netip.IPv6Loopback(), l4.port())

	targets := []netip.AddrPort{target4}
	if l6 != nil {
		targets = append(targets, target6)
	}
	for _, tgt := range targets {
		_, err := g.dialAddrs(context.Background(), "tcp", "bypass", []netip.AddrPort{tgt})
		de := wantDenied(t, err, ClassLoopback)
		if de.IP != tgt.Addr() || de.Port != tgt.Port() {
			t.Errorf("control refused %s:%d, want %s", de.IP, de.Port, tgt)
		}
	}
	// Several targets: the refusal stops the loop at the first one.
	_, err = g.dialAddrs(context.Background(), "tcp", "bypass", []netip.AddrPort{target4, target4, target4})
	wantDenied(t, err, ClassLoopback)

	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})
	_, err = g.dialAddrs(ctx, "tcp", "bypass", []netip.AddrPort{selfAP})
	wantDenied(t, err, ClassProxySelf)
	self.expectAccepts(t, 0)
	l4.expectAccepts(t, 0)
	if l6 != nil {
		l6.expectAccepts(t, 0)
	}

	// The same path with the exception in the context connects: the second
	// line reads the same per-tenant exceptions as the first.
	conn, err := g.dialAddrs(ctx, "tcp", "bypass", []netip.AddrPort{target4})
	if err != nil {
		t.Fatalf("control with exception: %v", err)
	}
	conn.Close()
	l4.expectAccepts(t, 1)

	for _, c := range []struct{ network, address string }{{"udp4", "127.0.0.1:53"}, {"tcp4", "not-an-address"}, {"tcp4", "[fe80::1%lo]:80"}} {
		if err := g.control(ctx, c.network, c.address, nil); err == nil {
			t.Errorf("control(%q, %q) allowed", c.network, c.address)
		}
	}
}

func TestDialIgnoresProxyEnvironment(t *testing.T) {
	d := startDNS(t)
	l4, _ := loopbackPair(t)
	decoy, err := listenCounting(t, "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	proxyURL := "http://" + decoy.Addr().String()
	for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"} {
		t.Setenv(k, proxyURL)
	}
	g := newTestGuard(t, Options{Resolver: d.addr})
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})
	conn, err := g.DialContext(ctx, "tcp", hostPort("loop4.test", l4.port()))
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	l4.expectAccepts(t, 1)
	decoy.expectAccepts(t, 0)
}

func TestNewValidation(t *testing.T) {
	bad := []Options{
		{Resolver: "dns.example:53"},
		{Resolver: "127.0.0.1"},
		{Resolver: "127.0.0.1:0"},
		{Resolver: "[fe80::1%lo]:53"},
		{DialTimeout: -time.Second},
		{DenyAddrs: []netip.AddrPort{{}}},
		{DenyAddrs: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")}},
	}
	for _, o := range bad {
		if _, err := New(o); !errors.Is(err, ErrInvalidAddr) {
			t.Errorf("New(%+v) = %v, want ErrInvalidAddr", o, err)
		}
	}
	g, err := New(Options{Resolver: "[::1]:53", DenyAddrs: []netip.AddrPort{netip.MustParseAddrPort("[::]:3128")}})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if g.dialTimeout != DefaultDialTimeout {
		t.Errorf("default dial timeout %v", g.dialTimeout)
	}
	// [::]:3128 refuses port 3128 on every address of this host.
	for _, ap := range []string{"127.0.0.1:3128", "[::1]:3128", "127.9.9.9:3128"} {
		if err := g.CheckAddrPort(WithExceptions(context.Background(), []netip.Prefix{
			netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128"),
		}), netip.MustParseAddrPort(ap)); !errors.Is(err, ErrDenied) {
			t.Errorf("wildcard self %s: %v", ap, err)
		}
	}
	for _, a := range g.localAddrs {
		if err := g.CheckAddrPort(context.Background(), netip.AddrPortFrom(a, 3128)); !errors.Is(err, ErrDenied) {
			t.Errorf("interface address %s:3128 allowed", a)
		}
	}
}

func TestParseExceptions(t *testing.T) {
	got, err := ParseExceptions([]string{"10.0.0.0/8", " 192.168.1.0/24 ", "fd00::/8", "::ffff:172.16.0.0/108", "127.0.0.1/32"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.0/8", "192.168.1.0/24", "fd00::/8", "172.16.0.0/12", "127.0.0.1/32"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for _, s := range []string{"10.0.0.1", "10.0.0.1/8", "0.0.0.0/0", "::/0", "::ffff:0.0.0.0/96", "fe80::%lo/64", "banana", ""} {
		if _, err := ParseExceptions([]string{s}); !errors.Is(err, ErrInvalidAddr) {
			t.Errorf("ParseExceptions(%q) = %v, want ErrInvalidAddr", s, err)
		}
	}
}

// BenchmarkDialContext measures a whole guarded dial to a loopback origin:
// DNS over UDP to the test server, checks, connect. Run it short, e.g.
// -benchtime=2000x.
func BenchmarkDialContext(b *testing.B) {
	d := startDNS(b).addr
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	g, err := New(Options{Resolver: d})
	if err != nil {
		b.Fatal(err)
	}
	ctx := WithExceptions(context.Background(), []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	for _, host := range []string{"127.0.0.1", "loop4.test"} {
		addr := hostPort(host, port)
		b.Run(host, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				conn, err := g.DialContext(ctx, "tcp4", addr)
				if err != nil {
					b.Fatal(err)
				}
				conn.Close()
			}
		})
	}
}
