package netguard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// DefaultDialTimeout bounds one DialContext call (resolution and every attempt)
// when Options.DialTimeout is zero.
const DefaultDialTimeout = 10 * time.Second

// minAttemptTimeout is the least time one address gets when the dial budget is
// shared between several resolved addresses (the net package uses the same).
const minAttemptTimeout = 2 * time.Second

var (
	// ErrResolve marks a failure to turn a host name into addresses.
	ErrResolve = errors.New("netguard: cannot resolve host")
	// ErrDenied matches every *DeniedError with errors.Is.
	ErrDenied = errors.New("netguard: destination refused")
	// ErrInvalidAddr marks an addr, network or option that is not acceptable
	// as written (a zone, a numeric spelling that is not dotted-decimal, a
	// service name for a port, ...).
	ErrInvalidAddr = errors.New("netguard: invalid address")
)

// DeniedError says that a destination was refused and why.
type DeniedError struct {
	Host  string     // the host as asked for (name or literal); empty from Check
	IP    netip.Addr // the address refused, as resolved
	Port  uint16     // zero from Check
	Class string     // one of the Class* constants
}

func (e *DeniedError) Error() string {
	var b strings.Builder
	b.WriteString("netguard: refused ")
	if e.Host != "" && e.Host != e.IP.String() {
		b.WriteString(strconv.Quote(e.Host))
		b.WriteString(" resolving to ")
	}
	b.WriteString(e.IP.String())
	if e.Port != 0 {
		b.WriteString(" port ")
		b.WriteString(strconv.Itoa(int(e.Port)))
	}
	b.WriteString(": ")
	b.WriteString(e.Class)
	b.WriteString(" address")
	switch e.Class {
	case ClassNAT64, Class6to4, ClassTeredo:
		b.WriteString(" embedding a forbidden IPv4 address")
	}
	return b.String()
}

// Is makes errors.Is(err, ErrDenied) true for every refusal.
func (e *DeniedError) Is(target error) bool { return target == ErrDenied }

// Options configure a Guard.
type Options struct {
	// Resolver is the DNS server as ip:port; "" uses the system resolver
	// configuration (/etc/resolv.conf, /etc/hosts) through Go's own resolver.
	Resolver string
	// DialTimeout bounds one DialContext call; zero means DefaultDialTimeout.
	DialTimeout time.Duration
	// DenyAddrs are the proxy's own listen addresses (proxy and admin). They
	// are refused even when an exception covers them. An unspecified address
	// (0.0.0.0:3128, [::]:3128) refuses that port on every loopback address
	// and on every address of this host's interfaces as seen at New.
	DenyAddrs []netip.AddrPort
	// Logger receives one record per refusal; nil discards.
	Logger *slog.Logger
}

// Guard is the guarded dialer. It is safe for concurrent use and holds no
// mutable state after New.
type Guard struct {
	resolver    *net.Resolver
	dialer      net.Dialer
	dialTimeout time.Duration
	self        []netip.AddrPort // exact listen addresses, unmapped
	selfPorts   []uint16         // ports listened on at an unspecified address
	localAddrs  []netip.Addr     // this host's interface addresses, for selfPorts
	log         *slog.Logger
}

// New builds a Guard. It fails on a resolver that is not an ip:port, an
// invalid or port-zero deny address, or a negative timeout.
func New(opts Options) (*Guard, error) {
	g := &Guard{dialTimeout: opts.DialTimeout, log: opts.Logger}
	if g.dialTimeout < 0 {
		return nil, fmt.Errorf("netguard: dial timeout %v is negative: %w", opts.DialTimeout, ErrInvalidAddr)
	}
	if g.dialTimeout == 0 {
		g.dialTimeout = DefaultDialTimeout
	}
	if g.log == nil {
		g.log = slog.New(slog.DiscardHandler)
	}

	g.resolver = &net.Resolver{PreferGo: true}
	if opts.Resolver != "" {
		// The resolver must be an address: resolving its name would need a
		// resolver, and a name could be pointed anywhere.
		server, err := netip.ParseAddrPort(opts.Resolver)
		if err != nil || server.Port() == 0 || server.Addr().Zone() != "" {
			return nil, fmt.Errorf("netguard: resolver %q: want ip:port with a non-zero port: %w", opts.Resolver, ErrInvalidAddr)
		}
		target := server.String()
		g.resolver.Dial = func(ctx context.Context, network, _ string) (net.Conn, error) {
			// Always the configured server, whatever resolv.conf says.
			var d net.Dialer
			return d.DialContext(ctx, network, target)
		}
	}

	for _, ap := range opts.DenyAddrs {
		if !ap.IsValid() || ap.Port() == 0 {
			return nil, fmt.Errorf("netguard: deny address %q: want ip:port with a non-zero port: %w", ap.String(), ErrInvalidAddr)
		}
		a := ap.Addr().Unmap().WithZone("")
		if a.IsUnspecified() {
			if !slices.Contains(g.selfPorts, ap.Port()) {
				g.selfPorts = append(g.selfPorts, ap.Port())
			}
			continue
		}
		g.self = append(g.self, netip.AddrPortFrom(a, ap.Port()))
	}
	if len(g.selfPorts) > 0 {
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return nil, fmt.Errorf("netguard: listing interface addresses for wildcard deny addresses: %w", err)
		}
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				g.localAddrs = append(g.localAddrs, p.Addr().Unmap().WithZone(""))
			}
		}
	}

	g.dialer = net.Dialer{ControlContext: g.control}
	return g, nil
}

type exceptionsKey struct{}

// WithExceptions returns a context carrying one tenant's exception prefixes:
// an address inside one of them may be dialled even if it is private. The
// prefixes replace any carried by ctx. The proxy's own listen addresses and the
// unspecified address are refused regardless; see Check for metadata.
func WithExceptions(ctx context.Context, prefixes []netip.Prefix) context.Context {
	norm := make([]netip.Prefix, 0, len(prefixes))
	for _, p := range prefixes {
		if p.IsValid() {
			norm = append(norm, unmapPrefix(p).Masked())
		}
	}
	return context.WithValue(ctx, exceptionsKey{}, norm)
}

func exceptionsFrom(ctx context.Context) []netip.Prefix {
	p, _ := ctx.Value(exceptionsKey{}).([]netip.Prefix)
	return p
}

// ParseExceptions turns configuration CIDR strings (a tenant's
// allow_private_cidrs) into exception prefixes. It refuses a prefix with host
// bits set (probably a typo for a single address or a different range) and a
// /0, which would be the global "allow private" this package does not offer.
func ParseExceptions(cidrs []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(cidrs))
	for i, s := range cidrs {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("netguard: exception [%d] %q: not a CIDR prefix: %w", i, s, ErrInvalidAddr)
		}
		if p.Addr().Zone() != "" {
			return nil, fmt.Errorf("netguard: exception [%d] %q: zones are not allowed: %w", i, s, ErrInvalidAddr)
		}
		if p != p.Masked() {
			return nil, fmt.Errorf("netguard: exception [%d] %q: host bits set, did you mean %s?: %w", i, s, p.Masked(), ErrInvalidAddr)
		}
		p = unmapPrefix(p)
		if p.Bits() == 0 {
			return nil, fmt.Errorf("netguard: exception [%d] %q: a /0 would allow every private address: %w", i, s, ErrInvalidAddr)
		}
		out = append(out, p)
	}
	return out, nil
}

// CheckAddrPort applies the guard's whole policy to one destination: the
// proxy's own addresses, then Check with the exceptions carried by ctx. The
// proxy can use it to refuse an IP-literal CONNECT target before dialling.
func (g *Guard) CheckAddrPort(ctx context.Context, ap netip.AddrPort) error {
	if class, ok := g.check(ap.Addr(), ap.Port(), exceptionsFrom(ctx)); !ok {
		return &DeniedError{IP: ap.Addr(), Port: ap.Port(), Class: class}
	}
	return nil
}

func (g *Guard) check(ip netip.Addr, port uint16, exceptions []netip.Prefix) (class string, ok bool) {
	if g.isSelf(ip.Unmap().WithZone(""), port) {
		return ClassProxySelf, false
	}
	return checkClass(ip, exceptions)
}

func (g *Guard) isSelf(a netip.Addr, port uint16) bool {
	if slices.Contains(g.self, netip.AddrPortFrom(a, port)) {
		return true
	}
	if !slices.Contains(g.selfPorts, port) {
		return false
	}
	return a.IsLoopback() || a.IsUnspecified() || slices.Contains(g.localAddrs, a)
}

// DialContext connects to addr ("host:port", host a name or an IP literal,
// port numeric) over network "tcp", "tcp4" or "tcp6". It resolves a name with
// the configured resolver, refuses the whole dial if any resolved address is
// forbidden (an answer mixing a public and a private address is a rebinding
// trick, not a reason to try the public one), then dials the checked addresses
// in order without resolving again. The socket's ControlContext checks the
// final ip:port a second time. A refusal is a *DeniedError; a failed lookup
// wraps ErrResolve.
func (g *Guard) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	resolveNet, err := lookupNetwork(network)
	if err != nil {
		return nil, err
	}
	host, port, err := splitHostPort(addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, g.dialTimeout)
	defer cancel() // an established connection outlives its dial context

	ips, err := g.resolve(ctx, resolveNet, host)
	if err != nil {
		return nil, err
	}
	exceptions := exceptionsFrom(ctx)
	targets := make([]netip.AddrPort, 0, len(ips))
	for _, ip := range ips {
		if class, ok := g.check(ip, port, exceptions); !ok {
			g.log.Warn("netguard: refused destination", "host", host, "ip", ip.String(), "port", port, "class", class)
			return nil, &DeniedError{Host: host, IP: ip, Port: port, Class: class}
		}
		a := ip.Unmap()
		if (network == "tcp4" && !a.Is4()) || (network == "tcp6" && !a.Is6()) {
			continue
		}
		targets = append(targets, netip.AddrPortFrom(a, port))
	}
	if len(targets) == 0 {
		return nil, fmt.Errorf("netguard: %q has no %s address: %w", host, network, ErrResolve)
	}
	return g.dialAddrs(ctx, network, host, targets)
}

// dialAddrs connects to the first of targets that answers. The targets are
// trusted to have been checked; the ControlContext checks them again anyway.
func (g *Guard) dialAddrs(ctx context.Context, network, host string, targets []netip.AddrPort) (net.Conn, error) {
	var firstErr error
	for i, t := range targets {
		actx, cancel := attemptContext(ctx, len(targets)-i)
		conn, err := g.dialer.DialContext(actx, network, t.String())
		cancel()
		if err == nil {
			return conn, nil
		}
		if firstErr == nil {
			firstErr = err
		}
		if errors.Is(err, ErrDenied) || ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("netguard: dial %q: %w", host, firstErr)
}

// attemptContext gives one of the remaining addresses its share of the time
// left, so one black-holed address does not eat the whole budget.
func attemptContext(ctx context.Context, remaining int) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok || remaining <= 1 {
		return context.WithCancel(ctx)
	}
	share := time.Until(deadline) / time.Duration(remaining)
	if share < minAttemptTimeout {
		share = minAttemptTimeout
	}
	return context.WithTimeout(ctx, share)
}

// control is the second line: it sees the address the socket is about to
// connect to, after every layer above has had its say.
func (g *Guard) control(ctx context.Context, network, address string, _ syscall.RawConn) error {
	if network != "tcp4" && network != "tcp6" {
		return fmt.Errorf("netguard: control: network %q is not TCP: %w", network, ErrInvalidAddr)
	}
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("netguard: control: address %q: %w", address, ErrInvalidAddr)
	}
	if class, ok := g.check(ap.Addr(), ap.Port(), exceptionsFrom(ctx)); !ok {
		g.log.Error("netguard: refused at connect time", "ip", ap.Addr().String(), "port", ap.Port(), "class", class)
		return &DeniedError{IP: ap.Addr(), Port: ap.Port(), Class: class}
	}
	return nil
}

func (g *Guard) resolve(ctx context.Context, network, host string) ([]netip.Addr, error) {
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Zone() != "" {
			return nil, fmt.Errorf("netguard: %q: zoned addresses are not allowed: %w", host, ErrInvalidAddr)
		}
		return []netip.Addr{ip}, nil
	}
	if err := validName(host); err != nil {
		return nil, err
	}
	ips, err := g.resolver.LookupNetIP(ctx, network, host)
	if err != nil {
		return nil, fmt.Errorf("%w %q: %w", ErrResolve, host, err)
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("%w %q: no addresses", ErrResolve, host)
	}
	return ips, nil
}

// validName refuses what is not a plausible DNS host name before it reaches a
// resolver: in particular numeric spellings such as "2130706433", "127.1" or
// "0x7f.0.0.1", which inet_aton-style parsers read as 127.0.0.1. A real host
// name never ends in an all-numeric label.
func validName(host string) error {
	h := strings.TrimSuffix(host, ".")
	if h == "" || len(h) > 253 {
		return fmt.Errorf("netguard: host %q: empty or too long: %w", host, ErrInvalidAddr)
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_') {
			return fmt.Errorf("netguard: host %q: character %q not allowed in a host name: %w", host, c, ErrInvalidAddr)
		}
	}
	last := h[strings.LastIndexByte(h, '.')+1:]
	if isNumericLabel(last) {
		return fmt.Errorf("netguard: host %q: numeric form that is not a dotted-decimal IPv4 address: %w", host, ErrInvalidAddr)
	}
	return nil
}

func isNumericLabel(s string) bool {
	if len(s) > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') {
		s = s[2:]
		for i := 0; i < len(s); i++ {
			c := s[i]
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
				return false
			}
		}
		return true
	}
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

func lookupNetwork(network string) (string, error) {
	switch network {
	case "tcp":
		return "ip", nil
	case "tcp4":
		return "ip4", nil
	case "tcp6":
		return "ip6", nil
	}
	return "", fmt.Errorf("netguard: network %q: only tcp, tcp4 and tcp6 are dialled: %w", network, ErrInvalidAddr)
}

func splitHostPort(addr string) (string, uint16, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("netguard: address %q: %w: %w", addr, ErrInvalidAddr, err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return "", 0, fmt.Errorf("netguard: address %q: port must be a number from 1 to 65535: %w", addr, ErrInvalidAddr)
	}
	return host, uint16(port), nil
}
