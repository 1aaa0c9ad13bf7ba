package proxy

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/rules"
)

// Options configures a Server. Dialer and Audit are required; everything else
// has a safe default (no secrets, no interception: tunnels that would need it
// are refused).
type Options struct {
	Logger   *slog.Logger
	Config   rules.ServerConfig
	Dialer   Dialer
	Audit    Auditor
	Secrets  SecretStore
	Certs    CertIssuer
	Limits   Limiter
	Observer Observer
	// UpstreamRoots verifies upstream TLS for intercepted tunnels: the
	// system roots plus server.upstream_ca_file. There is no way to turn
	// verification off.
	UpstreamRoots *x509.CertPool
	// Bound, when set, makes this a listener bound to one principal (a
	// launcher's bridge, a Unix socket only one sandbox can reach): clients
	// are not asked for credentials, and any they send are ignored.
	Bound *identity.Principal
	// MaxConnections caps open client connections process-wide (0 = no cap).
	MaxConnections int
	Now            func() time.Time
}

// Server is sluice's forward proxy.
type Server struct {
	opts   Options
	log    *slog.Logger
	cfg    rules.ServerConfig
	gp     *goproxy.ProxyHttpServer
	state  atomic.Pointer[snapshot]
	idBase string
	idSeq  atomic.Uint64

	transportsMu sync.Mutex
	transports   map[string]*http.Transport

	// srvMu guards httpSrv and listener: Serve sets them on its own
	// goroutine while Shutdown and the metrics scrape read them from others.
	srvMu    sync.Mutex
	httpSrv  *http.Server
	listener *trackedListener
	closing  atomic.Bool

	activeTunnels atomic.Int64
}

// snapshot is everything a request decides with; a reload swaps it whole so a
// request never sees half of an old policy and half of a new one.
type snapshot struct {
	policy       *rules.Policy
	auth         Authenticator
	placeholders []placeholder
}

type placeholder struct {
	secret string
	value  string
	hosts  []string
}

// Defaults fills zero server settings with sluice's defaults.
func Defaults(c rules.ServerConfig) rules.ServerConfig {
	def := func(d *rules.Duration, v time.Duration) {
		if *d == 0 {
			*d = rules.Duration(v)
		}
	}
	def(&c.ReadHeaderTimeout, 10*time.Second)
	def(&c.IdleTimeout, 60*time.Second)
	def(&c.TunnelIdleTimeout, 5*time.Minute)
	def(&c.MaxTunnelLifetime, time.Hour)
	def(&c.DialTimeout, 10*time.Second)
	def(&c.UpstreamTimeout, 60*time.Second)
	def(&c.ShutdownTimeout, 30*time.Second)
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	if c.MaxHeaderCount == 0 {
		c.MaxHeaderCount = 100
	}
	return c
}

// New builds a Server for the given policy and authenticator.
func New(opts Options, policy *rules.Policy, auth Authenticator) (*Server, error) {
	if opts.Dialer == nil || opts.Audit == nil {
		return nil, errors.New("proxy: a dialer and an audit writer are required")
	}
	if policy == nil || auth == nil {
		return nil, errors.New("proxy: a policy and an authenticator are required")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if opts.Limits == nil {
		opts.Limits = nopLimiter{}
	}
	if opts.Observer == nil {
		opts.Observer = nopObserver{}
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.UpstreamRoots == nil {
		roots, err := x509.SystemCertPool()
		if err != nil {
			return nil, fmt.Errorf("proxy: loading system roots: %w", err)
		}
		opts.UpstreamRoots = roots
	}
	var rnd [6]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, fmt.Errorf("proxy: request id seed: %w", err)
	}
	s := &Server{
		opts:       opts,
		log:        opts.Logger,
		cfg:        Defaults(opts.Config),
		idBase:     hex.EncodeToString(rnd[:]),
		transports: make(map[string]*http.Transport),
	}
	s.Update(policy, auth)

	gp := goproxy.NewProxyHttpServer()
	// goproxy's defaults are unsafe for us: its transport skips TLS
	// verification and honours HTTP_PROXY, its CONNECT dialer follows
	// HTTPS_PROXY, and its logger prints raw errors. Every request is
	// answered by the pipeline (OnRequest returns the response), so its
	// transport and dialers must never be used: make them fail closed.
	gp.Logger = log.New(io.Discard, "", 0)
	gp.Tr = &http.Transport{Proxy: nil, DialContext: refuseDial}
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = func(*http.Request, string, string) (net.Conn, error) {
		return nil, errors.New("proxy: goproxy dialer is disabled")
	}
	gp.KeepAcceptEncoding = true
	gp.NonproxyHandler = http.HandlerFunc(s.serveNonProxy)
	gp.OnRequest().DoFunc(func(r *http.Request, _ *goproxy.ProxyCtx) (*http.Request, *http.Response) {
		return r, s.handle(r, nil)
	})
	gp.OnRequest().HandleConnectFunc(s.handleConnect)
	s.gp = gp
	return s, nil
}

func refuseDial(context.Context, string, string) (net.Conn, error) {
	return nil, errors.New("proxy: goproxy transport is disabled")
}

// Update swaps in a new policy and authenticator (a config reload). Requests
// already past their decision finish under the old one; every later request,
// including the next request inside a live intercepted tunnel, uses the new one.
func (s *Server) Update(policy *rules.Policy, auth Authenticator) {
	snap := &snapshot{policy: policy, auth: auth}
	for _, ph := range policy.Placeholders() {
		snap.placeholders = append(snap.placeholders, placeholder{secret: ph.Secret, value: ph.Value, hosts: ph.Hosts})
	}
	s.state.Store(snap)
}

func (s *Server) snapshot() *snapshot { return s.state.Load() }

// Serve accepts proxy connections on ln until Shutdown.
func (s *Server) Serve(ln net.Listener) error {
	tl := newTrackedListener(ln, time.Duration(s.cfg.MaxTunnelLifetime), s.opts.MaxConnections)
	hs := &http.Server{
		Handler:           s.gp,
		ReadHeaderTimeout: time.Duration(s.cfg.ReadHeaderTimeout),
		IdleTimeout:       time.Duration(s.cfg.IdleTimeout),
		MaxHeaderBytes:    int(s.cfg.MaxHeaderBytes),
		ErrorLog:          log.New(io.Discard, "", 0),
		ConnContext:       withConn,
		// HTTP/2 to the proxy itself is not offered: CONNECT over h2 takes
		// a different path in goproxy that bypasses our hijack handling.
		TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){},
	}
	s.srvMu.Lock()
	if s.closing.Load() {
		// Shutdown ran before Serve got here: there is nothing to drain.
		s.srvMu.Unlock()
		return nil
	}
	s.listener, s.httpSrv = tl, hs
	s.srvMu.Unlock()
	err := hs.Serve(&guardedListener{trackedListener: tl, maxHead: int(s.cfg.MaxHeaderBytes), maxCount: s.cfg.MaxHeaderCount})
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Shutdown stops accepting, lets in-flight requests and tunnels finish until
// ctx ends, then closes whatever is left.
func (s *Server) Shutdown(ctx context.Context) error {
	s.closing.Store(true)
	s.srvMu.Lock()
	hs, tl := s.httpSrv, s.listener
	s.srvMu.Unlock()
	if hs == nil {
		return nil
	}
	err := hs.Shutdown(ctx)
	s.waitTunnels(ctx, tl)
	s.transportsMu.Lock()
	for _, t := range s.transports {
		t.CloseIdleConnections()
	}
	s.transportsMu.Unlock()
	return err
}

// waitTunnels waits for open tunnels, which http.Server does not track once
// hijacked, and cuts the ones still open when ctx ends. Each tunnel then
// writes its record; a tunnel whose hijack never happened would never count
// down, so that last wait is bounded too.
func (s *Server) waitTunnels(ctx context.Context, tl *trackedListener) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for s.activeTunnels.Load() > 0 {
		select {
		case <-tick.C:
			continue
		case <-ctx.Done():
		}
		tl.closeAll()
		grace := time.Now().Add(2 * time.Second)
		for s.activeTunnels.Load() > 0 && time.Now().Before(grace) {
			time.Sleep(5 * time.Millisecond)
		}
		if n := s.activeTunnels.Load(); n > 0 {
			s.log.Error("tunnels still open after the shutdown deadline", "count", n)
		}
		return
	}
}

// ActiveConnections is the number of open client connections.
func (s *Server) ActiveConnections() int64 {
	s.srvMu.Lock()
	tl := s.listener
	s.srvMu.Unlock()
	if tl == nil {
		return 0
	}
	return tl.active.Load()
}

// transportFor returns the upstream transport for a set of private-range
// exceptions. Tenants with different exceptions never share pooled
// connections: a connection to a private address that tenant A may reach
// must not be reused for tenant B.
func (s *Server) transportFor(exceptions []netip.Prefix) *http.Transport {
	key := ""
	if len(exceptions) > 0 {
		parts := make([]string, len(exceptions))
		for i, p := range exceptions {
			parts[i] = p.String()
		}
		slices.Sort(parts)
		key = strings.Join(parts, ",")
	}
	s.transportsMu.Lock()
	defer s.transportsMu.Unlock()
	if t, ok := s.transports[key]; ok {
		return t
	}
	t := &http.Transport{
		Proxy:                  nil, // never HTTP_PROXY: sluice is the way out
		DialContext:            s.opts.Dialer.DialContext,
		TLSClientConfig:        &tls.Config{RootCAs: s.opts.UpstreamRoots, MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}},
		TLSHandshakeTimeout:    time.Duration(s.cfg.DialTimeout),
		ResponseHeaderTimeout:  time.Duration(s.cfg.UpstreamTimeout),
		ExpectContinueTimeout:  time.Second,
		IdleConnTimeout:        90 * time.Second,
		MaxIdleConns:           4096,
		MaxIdleConnsPerHost:    256,
		DisableCompression:     true, // bodies pass through as the origin sent them
		ForceAttemptHTTP2:      false,
		MaxResponseHeaderBytes: 1 << 20,
	}
	s.transports[key] = t
	return t
}

func (s *Server) nextID() string {
	var b [16]byte
	n := s.idSeq.Add(1)
	out := append(b[:0], s.idBase...)
	out = append(out, '-')
	out = appendHex(out, n)
	return string(out)
}

func appendHex(dst []byte, n uint64) []byte {
	const digits = "0123456789abcdef"
	var tmp [16]byte
	i := len(tmp)
	for {
		i--
		tmp[i] = digits[n&0xf]
		n >>= 4
		if n == 0 {
			break
		}
	}
	return append(dst, tmp[i:]...)
}

// connKey carries the accepted connection into request contexts so the
// handler can tell a framing violation from a client's own request.
type connKey struct{}

func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// guardedListener puts a framingGuard in front of every accepted connection.
type guardedListener struct {
	*trackedListener
	maxHead, maxCount int
}

func (l *guardedListener) Accept() (net.Conn, error) {
	c, err := l.trackedListener.Accept()
	if err != nil {
		return nil, err
	}
	return &guardedConn{Conn: c, guard: newFramingGuard(c, l.maxHead, l.maxCount)}, nil
}

// guardedConn reads through the framing guard. When the guard refuses a head
// it hands the HTTP server a synthetic request for a reserved path instead, so
// the refusal is answered (and audited) by the normal handler with a proper
// 4xx, rather than by a dropped connection.
type guardedConn struct {
	net.Conn
	guard     *framingGuard
	synthetic []byte
	refused   atomic.Pointer[framingError]
}

const refusedPath = "/.sluice/refused"

var syntheticRefusal = []byte("GET " + refusedPath + " HTTP/1.1\r\nHost: sluice.invalid\r\nConnection: close\r\n\r\n")

func (c *guardedConn) Read(p []byte) (int, error) {
	if c.synthetic != nil {
		n := copy(p, c.synthetic)
		c.synthetic = c.synthetic[n:]
		if len(c.synthetic) == 0 {
			c.synthetic = []byte{}
		}
		if n == 0 {
			return 0, io.EOF
		}
		return n, nil
	}
	n, err := c.guard.Read(p)
	var fe *framingError
	if errors.As(err, &fe) {
		c.refused.Store(fe)
		c.synthetic = syntheticRefusal[:len(syntheticRefusal):len(syntheticRefusal)]
		return c.Read(p)
	}
	return n, err
}

// underlying returns the connection beneath the guard, for hijacked tunnels:
// after a CONNECT the guard is in passthrough and adds nothing but a copy.
func (c *guardedConn) Unwrap() net.Conn { return c.Conn }

func (c *guardedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// serveNonProxy answers requests that are not proxy requests: the synthetic
// request that stands for a refused head, and anything else in origin form.
func (s *Server) serveNonProxy(w http.ResponseWriter, r *http.Request) {
	if gc, ok := r.Context().Value(connKey{}).(*guardedConn); ok && r.URL.Path == refusedPath {
		if fe := gc.refused.Load(); fe != nil {
			rec := s.newRecord(r, nil)
			rec.Message = fe.Detail
			resp := s.deny(r.Context(), rec, r, fe.Status, fe.Reason, "")
			resp.Close = true
			writeResponse(w, resp)
			return
		}
	}
	rec := s.newRecord(r, nil)
	rec.Message = "not a proxy request (origin-form target)"
	writeResponse(w, s.deny(r.Context(), rec, r, http.StatusBadRequest, rules.ReasonBadRequest, ""))
}

func writeResponse(w http.ResponseWriter, resp *http.Response) {
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	if resp.Close {
		w.Header().Set("Connection", "close")
	}
	w.WriteHeader(resp.StatusCode)
	if resp.Body != nil {
		_, _ = io.Copy(w, resp.Body)
		_ = resp.Body.Close()
	}
}
