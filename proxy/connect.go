package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/internal/netguard"
	"github.com/sluicehq/sluice/rules"
)

// tunnel is one accepted CONNECT: who opened it, where it is bound, and its
// record (written when it closes, with the bytes each way).
type tunnel struct {
	id        string
	principal identity.Principal
	scheme    string
	host      string
	isIP      bool
	port      int
	rec       *audit.Record
	release   func()
}

// handleConnect decides a CONNECT like any request (identify, normalise,
// decide, limit) and either refuses it or takes the connection over to splice
// or intercept it. goproxy's own tunnel code is never used: it would dial
// whatever it is told with no guard, and it gives the connection no timeouts.
func (s *Server) handleConnect(_ string, pctx *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
	req := pctx.Req
	ctx := req.Context()
	rec := s.newRecord(req, nil)
	snap := s.snapshot()
	rec.Policy = snap.policy.Version()
	reject := func(resp *http.Response) (*goproxy.ConnectAction, string) {
		resp.Close = true
		pctx.Resp = resp
		return &goproxy.ConnectAction{Action: goproxy.ConnectReject}, ""
	}

	if s.closing.Load() {
		return reject(s.deny(ctx, rec, req, http.StatusServiceUnavailable, rules.ReasonShuttingDown, ""))
	}
	if err := s.opts.Audit.Healthy(); err != nil {
		return reject(s.deny(ctx, rec, req, http.StatusServiceUnavailable, rules.ReasonAuditUnavailable, ""))
	}
	if countHeaderFields(req.Header) > s.cfg.MaxHeaderCount {
		return reject(s.deny(ctx, rec, req, http.StatusRequestHeaderFieldsTooLarge, rules.ReasonBadRequest, ""))
	}

	// 1. Identify.
	p, resp := s.identify(ctx, rec, req, snap)
	if resp != nil {
		return reject(resp)
	}
	rec.Tenant, rec.Sandbox = p.Tenant, p.Sandbox

	// 2. Normalise: CONNECT takes host:port, and the port is required.
	nh, isIP, port, err := rules.ParseAuthority(req.URL.Host, 0)
	if err != nil {
		return reject(s.deny(ctx, rec, req, http.StatusForbidden, rules.ReasonInvalidHost, ""))
	}
	rec.Scheme, rec.Host, rec.Port = "https", nh, port

	// 3. Decide on host and port; the decision also says whether the
	// policy needs to see inside the tunnel.
	d := snap.policy.Decide(rules.Query{Tenant: p.Tenant, Host: nh, IsIP: isIP, Port: port, Connect: true})
	applyDecision(rec, d)
	if !d.Allowed {
		return reject(s.deny(ctx, rec, req, http.StatusForbidden, d.Reason, ruleID(d)))
	}
	intercept := d.Intercept && !d.WouldDeny
	if intercept && s.opts.Certs == nil {
		return reject(s.deny(ctx, rec, req, http.StatusForbidden, rules.ReasonInterceptionUnavailable, ruleID(d)))
	}

	// 4. Limit: tunnels are hijacked, so request rates alone do not bound
	// them; each holds one slot of the tenant's tunnel cap until it closes.
	if ok, retry := s.opts.Limits.AllowRequest(p.Tenant, ruleID(d), nil); !ok {
		s.opts.Observer.Refused(p.Tenant, "rate")
		resp := s.deny(ctx, rec, req, http.StatusTooManyRequests, rules.ReasonRateLimited, ruleID(d))
		resp.Header.Set("Retry-After", itoa(retryAfterSeconds(retry)))
		return reject(resp)
	}
	release, ok := s.opts.Limits.AcquireTunnel(p.Tenant)
	if !ok {
		s.opts.Observer.Refused(p.Tenant, "tunnel")
		resp := s.deny(ctx, rec, req, http.StatusTooManyRequests, rules.ReasonTunnelLimit, ruleID(d))
		resp.Header.Set("Retry-After", "1")
		return reject(resp)
	}

	// A spliced tunnel is dialled now, so that a refused address or a dead
	// origin is answered with a status and a reason rather than a 200
	// followed by a closed connection. (Intercepted tunnels dial per inner
	// request.)
	var upstream net.Conn
	if !intercept {
		dctx, cancel := context.WithTimeout(netguard.WithExceptions(ctx, d.Tenant.AllowCIDRs), time.Duration(s.cfg.DialTimeout))
		upstream, err = s.opts.Dialer.DialContext(dctx, "tcp", net.JoinHostPort(nh, itoa(port)))
		cancel()
		if err != nil {
			release()
			st, reason := classifyUpstreamError(err)
			if reason != rules.ReasonDestinationNotPermitted {
				rec.Decision = audit.DecisionError
			}
			return reject(s.deny(ctx, rec, req, st, reason, ruleID(d)))
		}
		if a, ok := upstream.RemoteAddr().(*net.TCPAddr); ok {
			rec.UpstreamIP = a.IP.String()
		}
	}

	// The decision is recorded before the client hears "200": a tunnel
	// that is open is a tunnel on record, even if the proxy dies while it
	// runs. Its bytes are recorded in a second, tunnel record at close.
	rec.Intercepted = intercept
	rec.Status = http.StatusOK
	open := *rec
	open.DurationMS = float64(s.opts.Now().Sub(rec.Time).Microseconds()) / 1000
	s.opts.Observer.Decision(rec.Tenant, string(rec.Decision), rules.Reason(rec.Reason), open.DurationMS/1000)
	if err := s.write(context.WithoutCancel(ctx), &open); err != nil {
		release()
		if upstream != nil {
			_ = upstream.Close()
		}
		return reject(denialResponse(req, http.StatusServiceUnavailable, rules.ReasonAuditUnavailable, nh, ruleID(d), rec.ID))
	}
	tun := &tunnel{
		id: rec.ID, principal: p, scheme: "https", host: nh, isIP: isIP, port: port,
		rec: rec, release: release,
	}
	rec.Kind = audit.KindTunnel
	rec.Status = 0
	// Counted from here, not from the hijack, so that a shutdown starting
	// in between waits for this tunnel's record.
	s.activeTunnels.Add(1)
	return &goproxy.ConnectAction{
		Action: goproxy.ConnectHijack,
		Hijack: func(_ *http.Request, client net.Conn, _ *goproxy.ProxyCtx) {
			// A goroutine of its own, so that net/http's handler goroutine
			// (and its deep stack) ends now rather than living as long as
			// the tunnel: idle tunnels are counted in memory per tunnel.
			go s.serveTunnel(ctx, tun, client, intercept, upstream)
		},
	}, ""
}

// serveTunnel runs an accepted CONNECT to its end and writes its record.
func (s *Server) serveTunnel(ctx context.Context, tun *tunnel, client net.Conn, intercept bool, upstream net.Conn) {
	s.opts.Observer.TunnelOpened()
	defer func() {
		tun.release()
		_ = client.Close()
		s.opts.Observer.TunnelClosed()
		s.activeTunnels.Add(-1)
	}()
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	idle := time.Duration(s.cfg.TunnelIdleTimeout)
	conn := &idleConn{Conn: client, idle: idle}
	var in, out int64
	var status int
	if intercept {
		status, in, out = s.intercept(ctx, tun, conn)
	} else {
		status, in, out = s.splice(ctx, tun, conn, upstream)
	}
	tun.rec.Status = status
	tun.rec.BytesIn, tun.rec.BytesOut = in, out
	tun.rec.DurationMS = float64(s.opts.Now().Sub(tun.rec.Time).Microseconds()) / 1000
	s.opts.Observer.Bytes(tun.rec.Tenant, in, out)
	_ = s.write(ctx, tun.rec)
}

// splice connects the client to the upstream byte for byte, after checking
// that the TLS ClientHello names the CONNECT host.
func (s *Server) splice(ctx context.Context, tun *tunnel, client *idleConn, upstream net.Conn) (status int, in, out int64) {
	defer upstream.Close()
	if _, err := io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return http.StatusOK, 0, 0
	}

	// The SNI must name the CONNECT host; a tunnel to an allowed host must
	// not carry a TLS session for another (domain fronting), and a tunnel
	// with no SNI at all is refused unless its target is an IP literal,
	// which clients send without SNI.
	_ = client.SetReadDeadline(time.Now().Add(time.Duration(s.cfg.ReadHeaderTimeout)))
	sni, hello, err := peekClientHello(ctx, client.Conn)
	_ = client.SetReadDeadline(time.Time{})
	switch {
	case err != nil:
		return s.refuseInside(tun, rules.ReasonSNIMissing, "tunnel did not start with a TLS ClientHello")
	case tun.isIP && sni != "" && !strings.EqualFold(sni, tun.host):
		return s.refuseInside(tun, rules.ReasonSNIMismatch, "SNI does not match the CONNECT target")
	case !tun.isIP && sni == "":
		return s.refuseInside(tun, rules.ReasonSNIMissing, "no SNI in the ClientHello")
	case !tun.isIP:
		if n, _, err := rules.NormalizeHost(sni); err != nil || n != tun.host {
			return s.refuseInside(tun, rules.ReasonSNIMismatch, "SNI does not match the CONNECT target")
		}
	}
	if _, err := upstream.Write(hello); err != nil {
		return http.StatusOK, int64(len(hello)), 0
	}
	up := &idleConn{Conn: upstream, idle: client.idle}
	in, out = s.pipe(ctx, tun.principal.Tenant, client, up)
	return http.StatusOK, in + int64(len(hello)), out
}

func (s *Server) refuseInside(tun *tunnel, reason rules.Reason, msg string) (int, int64, int64) {
	tun.rec.Decision = audit.DecisionDeny
	tun.rec.Reason = string(reason)
	tun.rec.Message = msg
	return http.StatusForbidden, 0, 0
}

// pipe copies both ways until both directions end, with the tenant's byte
// rates applied, and returns the bytes sent up and down. One direction runs
// in the calling goroutine.
func (s *Server) pipe(ctx context.Context, tenant string, client, upstream *idleConn) (in, out int64) {
	up := make(chan int64, 1)
	go func() {
		n := s.copyHalf(ctx, tenant, true, upstream, client)
		_ = upstream.CloseWrite()
		up <- n
	}()
	out = s.copyHalf(ctx, tenant, false, client, upstream)
	_ = client.CloseWrite()
	return <-up, out
}

// copyBufs are the spliced tunnels' copy buffers. A tunnel holds one only
// while bytes move: between bursts it waits for its source to become
// readable without a buffer, so a thousand idle tunnels do not pin two
// 32 KiB buffers each.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// copyHalf copies src to dst until src ends or either side fails.
func (s *Server) copyHalf(ctx context.Context, tenant string, egress bool, dst, src *idleConn) int64 {
	r := s.opts.Limits.Reader(ctx, tenant, egress, src)
	wait := readableWaiter(src.Conn)
	var total int64
	for {
		if wait != nil {
			src.armRead()
			if err := wait(); err != nil {
				return total
			}
		}
		bp := copyBufs.Get().(*[]byte)
		n, err := r.Read(*bp)
		if n > 0 {
			if _, werr := dst.Write((*bp)[:n]); werr != nil {
				copyBufs.Put(bp)
				return total
			}
			total += int64(n)
		}
		copyBufs.Put(bp)
		if err != nil {
			return total
		}
	}
}

// readableWaiter returns a function that blocks until c has bytes to read
// (or EOF, or an error, or its read deadline), holding no buffer while it
// waits. It returns nil when c is not a plain socket underneath or has bytes
// buffered above the socket, and the caller then just reads.
func readableWaiter(c net.Conn) func() error {
	for {
		switch v := c.(type) {
		case *guardedConn:
			if v.guard.buffered() {
				return nil
			}
			c = v.Conn
		case *trackedConn:
			c = v.Conn
		case syscall.Conn:
			rc, err := v.SyscallConn()
			if err != nil {
				return nil
			}
			var peek [1]byte
			ready := func(fd uintptr) bool {
				// MSG_PEEK leaves the byte for the real read; EAGAIN means
				// nothing yet, so the poller waits for readability.
				_, _, err := syscall.Recvfrom(int(fd), peek[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
				return err != syscall.EAGAIN
			}
			return func() error { return rc.Read(ready) }
		default:
			return nil
		}
	}
}

// intercept terminates the client's TLS with a leaf for the CONNECT host and
// serves the requests inside, each through the same pipeline as a plain
// request, re-bound to the tunnel's host and port and decided again.
func (s *Server) intercept(ctx context.Context, tun *tunnel, client *idleConn) (status int, in, out int64) {
	cfg, err := s.opts.Certs.ServerConfig(ctx, tun.host)
	if err != nil {
		s.log.Error("no certificate for intercepted tunnel", "host", tun.host, "err", err)
		tun.rec.Decision = audit.DecisionError
		tun.rec.Reason = string(rules.ReasonInterceptionUnavailable)
		s.writeRefusal(client, http.StatusServiceUnavailable, rules.ReasonInterceptionUnavailable, tun)
		return http.StatusServiceUnavailable, 0, 0
	}
	if _, err := io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return http.StatusOK, 0, 0
	}
	counted := &countingConn{idleConn: client}
	tlsConn := tls.Server(counted, cfg)
	hctx, cancel := context.WithTimeout(ctx, time.Duration(s.cfg.ReadHeaderTimeout))
	err = tlsConn.HandshakeContext(hctx)
	cancel()
	if err != nil {
		tun.rec.Message = "client TLS handshake failed"
		return http.StatusOK, counted.in.Load(), counted.out.Load()
	}
	if sni := tlsConn.ConnectionState().ServerName; sni != "" {
		if n, _, err := rules.NormalizeHost(sni); err != nil || n != tun.host {
			st, _, _ := s.refuseInside(tun, rules.ReasonSNIMismatch, "SNI does not match the CONNECT target")
			return st, counted.in.Load(), counted.out.Load()
		}
	}

	guard := newFramingGuard(tlsConn, int(s.cfg.MaxHeaderBytes), s.cfg.MaxHeaderCount)
	br := bufio.NewReader(guard)
	bw := bufio.NewWriter(tlsConn)
	remote := tun.rec.Client
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			if v := guard.Violation(); v != nil {
				fake := &http.Request{Method: "?", URL: &urlPlaceholder, Header: http.Header{}, RemoteAddr: remote}
				rec := s.newRecord(fake, tun)
				rec.Method = ""
				rec.Message = v.Detail
				resp := s.deny(ctx, rec, fake, v.Status, v.Reason, "")
				resp.Close = true
				_ = resp.Write(bw)
				_ = bw.Flush()
			}
			break
		}
		req.RemoteAddr = remote
		rctx, rcancel := context.WithCancel(ctx)
		resp := s.handle(req.WithContext(rctx), tun)
		if resp.StatusCode == http.StatusSwitchingProtocols {
			s.switchProtocols(ctx, tun, resp, br, bw, tlsConn)
			rcancel()
			break
		}
		keep := s.writeInner(req, resp, bw)
		rcancel()
		if !keep {
			break
		}
	}
	_ = tlsConn.Close()
	return http.StatusOK, counted.in.Load(), counted.out.Load()
}

// urlPlaceholder stands for the target of a request head that was refused
// before it could be parsed.
var urlPlaceholder = url.URL{Path: "/"}

// writeInner writes one response inside an intercepted tunnel and says
// whether the connection can carry another request.
func (s *Server) writeInner(req *http.Request, resp *http.Response, bw *bufio.Writer) bool {
	defer resp.Body.Close()
	resp.Proto, resp.ProtoMajor, resp.ProtoMinor = "HTTP/1.1", 1, 1
	if resp.ContentLength < 0 && req.Method != http.MethodHead && bodyAllowed(resp.StatusCode) {
		resp.TransferEncoding = []string{"chunked"}
	}
	if req.Close {
		resp.Close = true
	}
	if rb, ok := resp.Body.(*recordingBody); ok && rb.streaming {
		// http.Response.Write never flushes between body chunks: without
		// this, a streamed response (server-sent events) would sit in bw
		// until the origin finished it. A body of known length arrives as
		// fast as the origin can send it, so it is written out in as few
		// TLS records as bw allows.
		resp.Body = &flushBeforeRead{ReadCloser: resp.Body, bw: bw}
	}
	// writerOnly hides bw's ReadFrom: io.Copy would otherwise hand the body
	// a slice of bw's own buffer to read into, and flushBeforeRead's Flush
	// during that Read resets the buffer under it, so the client would get
	// stale head bytes in place of the body.
	if err := resp.Write(writerOnly{bw}); err != nil {
		return false
	}
	if err := bw.Flush(); err != nil {
		return false
	}
	// Whatever the handler left of the request body must be consumed
	// before the next request can be read; a client that keeps sending is
	// cut off rather than drained forever.
	if req.Body != nil {
		n, _ := io.CopyN(io.Discard, req.Body, 256<<10)
		if n == 256<<10 {
			return false
		}
		_ = req.Body.Close()
	}
	return !resp.Close
}

// flushBeforeRead sends what has been written so far to the client before
// each read of the upstream body may block, so nothing the origin already
// sent waits in a buffer for bytes that have not arrived.
type flushBeforeRead struct {
	io.ReadCloser
	bw *bufio.Writer
}

func (f *flushBeforeRead) Read(p []byte) (int, error) {
	if f.bw.Buffered() > 0 {
		if err := f.bw.Flush(); err != nil {
			return 0, err
		}
	}
	return f.ReadCloser.Read(p)
}

// writerOnly is an io.Writer and nothing more (no ReadFrom).
type writerOnly struct{ io.Writer }

func bodyAllowed(status int) bool {
	return !(status >= 100 && status < 200) && status != http.StatusNoContent && status != http.StatusNotModified
}

// switchProtocols finishes a WebSocket (or other) upgrade inside an
// intercepted tunnel: the handshake went through the pipeline, the bytes after
// it are spliced.
func (s *Server) switchProtocols(ctx context.Context, tun *tunnel, resp *http.Response, br *bufio.Reader, bw *bufio.Writer, client *tls.Conn) {
	upstream, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		_ = resp.Body.Close()
		return
	}
	defer upstream.Close()
	body := resp.Body
	resp.Body = nil
	if err := resp.Write(bw); err != nil || bw.Flush() != nil {
		return
	}
	resp.Body = body
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		_, _ = io.Copy(upstream, s.opts.Limits.Reader(ctx, tun.principal.Tenant, true, br))
		_ = upstream.Close()
	}()
	go func() {
		defer wg.Done()
		_, _ = io.Copy(client, s.opts.Limits.Reader(ctx, tun.principal.Tenant, false, upstream))
		_ = client.Close()
	}()
	wg.Wait()
}

// writeRefusal answers a CONNECT that was accepted by policy but could not be
// served (the guard refused the address, the dial failed) before any 200.
func (s *Server) writeRefusal(client net.Conn, status int, reason rules.Reason, tun *tunnel) {
	resp := denialResponse(&http.Request{Method: http.MethodConnect}, status, reason, tun.host, tun.rec.Rule, tun.id)
	resp.Close = true
	_ = resp.Write(client)
}

// idleConn gives a hijacked connection the idle timeout goproxy does not:
// every read and write pushes the deadline forward.
type idleConn struct {
	net.Conn
	idle time.Duration
	// The deadlines last set. Moving a deadline costs a timer update, so
	// it is pushed forward only once half the idle time has been used: a
	// connection idle for between idle/2 and idle is cut.
	rdl, wdl time.Time
}

func (c *idleConn) Read(p []byte) (int, error) {
	c.armRead()
	return c.Conn.Read(p)
}

func (c *idleConn) Write(p []byte) (int, error) {
	if c.idle > 0 {
		if now := time.Now(); c.wdl.Sub(now) < c.idle/2 {
			c.wdl = now.Add(c.idle)
			_ = c.Conn.SetWriteDeadline(c.wdl)
		}
	}
	return c.Conn.Write(p)
}

// armRead pushes the idle read deadline forward before a wait that does
// not go through Read.
func (c *idleConn) armRead() {
	if c.idle > 0 {
		if now := time.Now(); c.rdl.Sub(now) < c.idle/2 {
			c.rdl = now.Add(c.idle)
			_ = c.Conn.SetReadDeadline(c.rdl)
		}
	}
}

// SetReadDeadline and SetWriteDeadline let a caller impose its own deadline
// (a handshake, a hello peek); the idle deadline resumes at the next call.
func (c *idleConn) SetReadDeadline(t time.Time) error {
	c.rdl = time.Time{}
	return c.Conn.SetReadDeadline(t)
}

func (c *idleConn) SetWriteDeadline(t time.Time) error {
	c.wdl = time.Time{}
	return c.Conn.SetWriteDeadline(t)
}

func (c *idleConn) SetDeadline(t time.Time) error {
	c.rdl, c.wdl = time.Time{}, time.Time{}
	return c.Conn.SetDeadline(t)
}

func (c *idleConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// countingConn counts the raw bytes of an intercepted tunnel.
type countingConn struct {
	*idleConn
	in, out atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.idleConn.Read(p)
	c.in.Add(int64(n))
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.idleConn.Write(p)
	c.out.Add(int64(n))
	return n, err
}

func itoa(n int) string { return strconv.Itoa(n) }
