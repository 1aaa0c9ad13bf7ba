package proxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sluicehq/sluice/broker"
	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/internal/netguard"
	"github.com/sluicehq/sluice/rules"
)

// handle is the per-request pipeline (DESIGN.md steps 1–8) for a plain proxied
// request (tun == nil) or for a request inside an intercepted tunnel. It
// always returns the response the client gets, and exactly one audit record is
// written for the request: for a refusal before this returns, for a forwarded
// request when its response body has been read to the end (before the last
// bytes reach the client) or abandoned.
func (s *Server) handle(req *http.Request, tun *tunnel) *http.Response {
	ctx := req.Context()
	rec := s.newRecord(req, tun)
	snap := s.snapshot()
	rec.Policy = snap.policy.Version()

	if s.closing.Load() {
		return s.deny(ctx, rec, req, http.StatusServiceUnavailable, rules.ReasonShuttingDown, "")
	}
	if err := s.opts.Audit.Healthy(); err != nil {
		// Fail closed: traffic that cannot be recorded is not let through.
		return s.deny(ctx, rec, req, http.StatusServiceUnavailable, rules.ReasonAuditUnavailable, "")
	}
	if countHeaderFields(req.Header) > s.cfg.MaxHeaderCount {
		return s.deny(ctx, rec, req, http.StatusRequestHeaderFieldsTooLarge, rules.ReasonBadRequest, "")
	}

	// 1. Identify. Inside a tunnel the principal is the one that opened it;
	// a Proxy-Authorization header there is the client's mistake, and it is
	// removed below like everywhere else.
	var p identity.Principal
	if tun != nil {
		p = tun.principal
	} else {
		var resp *http.Response
		if p, resp = s.identify(ctx, rec, req, snap); resp != nil {
			return resp
		}
	}
	rec.Tenant, rec.Sandbox = p.Tenant, p.Sandbox

	// 2. Normalise the destination and bind it to the tunnel, if any.
	dst, reason := s.target(req, tun)
	rec.Scheme, rec.Host, rec.Port, rec.Path = dst.scheme, dst.host, dst.port, dst.path
	if reason != "" {
		status := http.StatusBadRequest
		if reason == rules.ReasonAmbiguousPath || reason == rules.ReasonInvalidHost {
			status = http.StatusForbidden
		}
		return s.deny(ctx, rec, req, status, reason, "")
	}

	// A secret's placeholder may only travel to that secret's hosts. Seen
	// anywhere else it is an exfiltration attempt, denied in every mode.
	swaps, foreign := s.findPlaceholders(snap, req, dst.host)
	if foreign != "" {
		rec.Exfiltration = true
		rec.Secrets = []string{foreign}
		return s.deny(ctx, rec, req, http.StatusForbidden, rules.ReasonExfiltrationAttempt, "")
	}

	// 3. Decide with the current policy.
	d := snap.policy.Decide(rules.Query{
		Tenant: p.Tenant, Host: dst.host, IsIP: dst.isIP, Port: dst.port,
		Method: req.Method, Path: dst.path,
	})
	applyDecision(rec, d)
	if !d.Allowed {
		return s.deny(ctx, rec, req, http.StatusForbidden, d.Reason, ruleID(d))
	}
	tenant := d.Tenant

	// 5a. Work out which secrets this request will carry before limiting, so
	// that a secret's budget is charged too.
	var inject []rules.Injection
	var secretNames []string
	if d.Rule != nil && !d.WouldDeny {
		inject = d.Rule.Injections
		secretNames = d.Rule.Secrets
	}
	for _, sw := range swaps {
		secretNames = appendUnique(secretNames, sw.secret)
	}
	if (len(inject) > 0 || len(swaps) > 0) && dst.scheme != "https" && (d.Rule == nil || !d.Rule.InjectOverHTTP) {
		return s.deny(ctx, rec, req, http.StatusForbidden, rules.ReasonInjectionRequiresTLS, ruleID(d))
	}

	// 4. Limit: keys are the tenant, the rule id and secret names, all from
	// the configuration.
	if ok, retry := s.opts.Limits.AllowRequest(p.Tenant, ruleID(d), secretNames); !ok {
		s.opts.Observer.Refused(p.Tenant, "rate")
		resp := s.deny(ctx, rec, req, http.StatusTooManyRequests, rules.ReasonRateLimited, ruleID(d))
		resp.Header.Set("Retry-After", strconv.Itoa(retryAfterSeconds(retry)))
		return resp
	}

	// 5b. Inject: replace every client copy of the header, never append.
	// A secret that is unavailable or stale fails the request closed.
	out := prepareOutbound(req, dst)
	var reveal [][]byte
	for _, inj := range inject {
		value, used, err := s.render(inj)
		if err != nil {
			rec.Secrets = used
			return s.deny(ctx, rec, req, http.StatusServiceUnavailable, rules.ReasonSecretUnavailable, ruleID(d))
		}
		out.Header.Del(inj.Header)
		out.Header.Set(inj.Header, value.text)
		reveal = append(reveal, value.secrets...)
	}
	for _, sw := range swaps {
		v, err := s.secretValue(sw.secret)
		if err != nil {
			rec.Secrets = []string{sw.secret}
			return s.deny(ctx, rec, req, http.StatusServiceUnavailable, rules.ReasonSecretUnavailable, ruleID(d))
		}
		replaceInHeaders(out.Header, sw.value, string(v))
		reveal = append(reveal, v)
	}
	rec.Secrets = secretNames
	if len(reveal) > 0 {
		// Only identity bodies can be scrubbed as they stream; likewise a
		// compressed WebSocket (permessage-deflate) would hide a reflected
		// secret from the scrubber after an upgrade.
		out.Header.Set("Accept-Encoding", "identity")
		out.Header.Del("Sec-WebSocket-Extensions")
	}

	// 6. Forward through the guarded transport. No redirect is followed:
	// http.Transport returns 3xx responses as they are.
	var upstreamIP string
	trace := &httptrace.ClientTrace{GotConn: func(ci httptrace.GotConnInfo) {
		if a, ok := ci.Conn.RemoteAddr().(*net.TCPAddr); ok {
			upstreamIP = a.IP.String()
		}
	}}
	octx := httptrace.WithClientTrace(netguard.WithExceptions(ctx, tenant.AllowCIDRs), trace)
	var reqBody *countingReader
	if out.Body != nil && out.Body != http.NoBody {
		reqBody = &countingReader{r: s.opts.Limits.Reader(ctx, p.Tenant, true, out.Body), c: out.Body}
		out.Body = reqBody
	}
	resp, err := s.transportFor(tenant.AllowCIDRs).RoundTrip(out.WithContext(octx))
	rec.UpstreamIP = upstreamIP
	if err != nil {
		status, reason := classifyUpstreamError(err)
		rec.Decision = audit.DecisionError
		if reason == rules.ReasonDestinationNotPermitted {
			// The guard refusing the resolved address is a denial, as it
			// is for a CONNECT, not an upstream failure: a reviewer
			// filtering on deny must see these attempts.
			rec.Decision = audit.DecisionDeny
		}
		return s.deny(ctx, rec, req, status, reason, ruleID(d))
	}
	removeHopByHop(resp.Header, resp.StatusCode == http.StatusSwitchingProtocols)

	// 7. Scrub: a response to a request that carried a secret never hands
	// the secret back, in headers or anywhere in the streamed body.
	if len(reveal) > 0 {
		if ce := resp.Header.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
			_ = resp.Body.Close()
			rec.Message = "origin sent an encoded body to a request that carried a secret"
			rec.Decision = audit.DecisionError
			return s.deny(ctx, rec, req, http.StatusBadGateway, rules.ReasonUpstreamError, ruleID(d))
		}
		if broker.ScrubHeader(resp.Header, reveal) {
			rec.ReflectionScrubbed = true
		}
	}

	// 8. Record when the body ends (or right now for a protocol switch,
	// whose body is the raw connection).
	rec.Status = resp.StatusCode
	if resp.StatusCode == http.StatusSwitchingProtocols {
		if len(reveal) > 0 {
			rwc, ok := resp.Body.(io.ReadWriteCloser)
			if !ok {
				_ = resp.Body.Close()
				rec.Decision = audit.DecisionError
				return s.deny(ctx, rec, req, http.StatusBadGateway, rules.ReasonUpstreamError, ruleID(d))
			}
			resp.Body = newScrubbedUpgrade(rwc, reveal)
		}
		if err := s.finish(ctx, rec, reqBody, 0); err != nil {
			// Failing closed: no unrecorded upgrade. The record's failure
			// is already counted in the writer's gap.
			_ = resp.Body.Close()
			return denialResponse(req, http.StatusServiceUnavailable, rules.ReasonAuditUnavailable, rec.Host, ruleID(d), rec.ID)
		}
		return resp
	}
	body := &recordingBody{s: s, ctx: ctx, rec: rec, reqBody: reqBody, length: resp.ContentLength, abort: tun == nil, streaming: resp.ContentLength < 0}
	if req.Method == http.MethodHead || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified {
		// Content-Length here describes a body that is never sent.
		body.length = 0
	}
	if len(reveal) > 0 {
		sc := broker.NewScrubber(readCloser{Reader: s.opts.Limits.Reader(ctx, p.Tenant, false, resp.Body), Closer: resp.Body}, reveal, []byte(redaction))
		body.scrubber, body.rc = sc, sc
		body.trailer, body.reveal = resp.Trailer, reveal
		resp.ContentLength = -1
		resp.Header.Del("Content-Length")
		body.length = -1
	} else {
		body.rc = readCloser{Reader: s.opts.Limits.Reader(ctx, p.Tenant, false, resp.Body), Closer: resp.Body}
	}
	resp.Body = body
	return resp
}

// redaction replaces a reflected secret in a response.
const redaction = "[REDACTED-BY-SLUICE]"

// scrubbedUpgrade is a connection after a protocol switch whose handshake
// carried secrets: what the origin sends is scrubbed of them as it streams,
// or an echoing WebSocket endpoint would hand the key back after the
// pipeline is done. Each occurrence is masked with as many '*' as it has
// bytes, so WebSocket frame lengths stay valid.
type scrubbedUpgrade struct {
	io.ReadWriteCloser
	r io.Reader
}

func newScrubbedUpgrade(rwc io.ReadWriteCloser, secrets [][]byte) *scrubbedUpgrade {
	var r io.Reader = rwc
	for _, sec := range secrets {
		r = broker.NewScrubber(io.NopCloser(r), [][]byte{sec}, bytes.Repeat([]byte{'*'}, len(sec)))
	}
	return &scrubbedUpgrade{ReadWriteCloser: rwc, r: r}
}

func (u *scrubbedUpgrade) Read(p []byte) (int, error) { return u.r.Read(p) }

// identify authenticates a plain request or a CONNECT from its
// Proxy-Authorization header; a failure is answered with 407.
func (s *Server) identify(ctx context.Context, rec *audit.Record, req *http.Request, snap *snapshot) (identity.Principal, *http.Response) {
	p, resp := s.authenticate(ctx, rec, req, snap)
	if resp != nil {
		return p, resp
	}
	// Per-tenant connection caps: the tenant is known only now, so the
	// connection is counted against it at its first authenticated request.
	if tc := trackedConnOf(ctx); tc != nil && !tc.holdTenant(p.Tenant, s.opts.Limits.AcquireConnection) {
		rec.Tenant, rec.Sandbox = p.Tenant, p.Sandbox
		s.opts.Observer.Refused(p.Tenant, "connection")
		resp := s.deny(ctx, rec, req, http.StatusTooManyRequests, rules.ReasonConnectionLimit, "")
		resp.Header.Set("Retry-After", "1")
		// Close the connection: it must not linger uncounted. (goproxy
		// passes headers, not resp.Close, on to net/http.)
		resp.Close = true
		resp.Header.Set("Connection", "close")
		return identity.Principal{}, resp
	}
	return p, nil
}

// trackedConnOf finds the accepted connection a request came on.
func trackedConnOf(ctx context.Context) *trackedConn {
	gc, ok := ctx.Value(connKey{}).(*guardedConn)
	if !ok {
		return nil
	}
	tc, _ := gc.Conn.(*trackedConn)
	return tc
}

// authenticate resolves the principal from Proxy-Authorization, or from the
// listener's binding.
func (s *Server) authenticate(ctx context.Context, rec *audit.Record, req *http.Request, snap *snapshot) (identity.Principal, *http.Response) {
	if s.opts.Bound != nil {
		return *s.opts.Bound, nil
	}
	values := req.Header.Values("Proxy-Authorization")
	if len(values) > 1 {
		return identity.Principal{}, s.authFailure(ctx, rec, req, identity.ErrMalformed)
	}
	header := ""
	if len(values) == 1 {
		header = values[0]
	}
	// Clients on a Unix socket have no address to throttle by; who may
	// connect there is decided by the socket's file permissions.
	src := clientAddr(req)
	if src.IsValid() && !s.opts.Limits.AuthAllowed(src) {
		return identity.Principal{}, s.authFailure(ctx, rec, req, errAuthThrottled)
	}
	p, err := snap.auth.Authenticate(header, s.opts.Now())
	if err != nil {
		if src.IsValid() && !errors.Is(err, identity.ErrMissing) {
			// A client's first request often comes without credentials
			// and is retried after the 407: only wrong ones count.
			s.opts.Limits.AuthFailed(src)
		}
		return identity.Principal{}, s.authFailure(ctx, rec, req, err)
	}
	return p, nil
}

func (s *Server) authFailure(ctx context.Context, rec *audit.Record, req *http.Request, err error) *http.Response {
	rec.Kind = audit.KindAuthFailure
	reason := rules.ReasonAuthInvalid
	switch {
	case errors.Is(err, identity.ErrMissing):
		reason = rules.ReasonAuthRequired
	case errors.Is(err, identity.ErrExpired):
		reason = rules.ReasonAuthExpired
	case errors.Is(err, errAuthThrottled):
		reason = rules.ReasonAuthThrottled
	}
	// The record says why, never what was presented.
	rec.Message = authMessage(err)
	resp := s.deny(ctx, rec, req, http.StatusProxyAuthRequired, reason, "")
	resp.Header.Set("Proxy-Authenticate", `Basic realm="sluice"`)
	return resp
}

func authMessage(err error) string {
	for _, e := range []error{identity.ErrMissing, identity.ErrMalformed, identity.ErrUnknown, identity.ErrExpired, identity.ErrRevoked, identity.ErrTenantMismatch, errAuthThrottled} {
		if errors.Is(err, e) {
			return e.Error()
		}
	}
	return "authentication failed"
}

// destination is a normalised request target.
type destination struct {
	scheme string
	host   string
	isIP   bool
	port   int
	path   string
}

// target normalises where a request goes. Outside a tunnel that is its
// absolute-form URL; inside one it is the tunnel's host and port, and the
// request's own Host (header or absolute-form) must name exactly that.
func (s *Server) target(req *http.Request, tun *tunnel) (destination, rules.Reason) {
	var d destination
	u := req.URL
	if u.User != nil {
		return d, rules.ReasonBadRequest
	}
	if tun != nil {
		d.scheme, d.host, d.isIP, d.port = tun.scheme, tun.host, tun.isIP, tun.port
		authority := req.Host
		if u.IsAbs() {
			if !strings.EqualFold(u.Scheme, tun.scheme) {
				return d, rules.ReasonHostMismatch
			}
			authority = u.Host
		}
		nh, _, port, err := rules.ParseAuthority(authority, defaultPort(tun.scheme))
		if err != nil || nh != tun.host || port != tun.port {
			return d, rules.ReasonHostMismatch
		}
	} else {
		if !u.IsAbs() || !strings.EqualFold(u.Scheme, "http") {
			// https:// in absolute form would ask us to originate TLS on the
			// client's behalf; clients must use CONNECT for that.
			return d, rules.ReasonBadRequest
		}
		nh, isIP, port, err := rules.ParseAuthority(u.Host, 80)
		if err != nil {
			return d, rules.ReasonInvalidHost
		}
		d.scheme, d.host, d.isIP, d.port = "http", nh, isIP, port
	}
	path, err := rules.NormalizePath(u.EscapedPath())
	if err != nil {
		return d, rules.ReasonAmbiguousPath
	}
	d.path = path
	return d, ""
}

func defaultPort(scheme string) int {
	if scheme == "https" {
		return 443
	}
	return 80
}

type swap struct {
	secret string
	value  string
}

// findPlaceholders looks for secret placeholders in the request's headers and
// URL. Those meant for this host are returned to be swapped; the first one
// bound for a host that is not its secret's is returned as foreign.
func (s *Server) findPlaceholders(snap *snapshot, req *http.Request, host string) (swaps []swap, foreign string) {
	for _, ph := range snap.placeholders {
		if !requestContains(req, ph.value) {
			continue
		}
		allowed := false
		for _, h := range ph.hosts {
			if h == host {
				allowed = true
				break
			}
		}
		if !allowed {
			return nil, ph.secret
		}
		if strings.Contains(req.URL.RawQuery, ph.value) || strings.Contains(req.URL.Path, ph.value) {
			// Placeholders are swapped in headers only; one in the URL
			// would reach the origin (and its logs) as is.
			return nil, ph.secret
		}
		swaps = append(swaps, swap{secret: ph.secret, value: ph.value})
	}
	return swaps, ""
}

func requestContains(req *http.Request, needle string) bool {
	if strings.Contains(req.URL.RawQuery, needle) || strings.Contains(req.URL.Path, needle) || strings.Contains(req.URL.RawPath, needle) {
		return true
	}
	for k, vs := range req.Header {
		if strings.Contains(k, needle) {
			return true
		}
		for _, v := range vs {
			if strings.Contains(v, needle) {
				return true
			}
		}
	}
	return false
}

func replaceInHeaders(h http.Header, old, new string) {
	for k, vs := range h {
		for i, v := range vs {
			if strings.Contains(v, old) {
				vs[i] = strings.ReplaceAll(v, old, new)
			}
		}
		h[k] = vs
	}
}

type rendered struct {
	text    string
	secrets [][]byte
}

// render expands an injection template from the broker's snapshot.
func (s *Server) render(inj rules.Injection) (rendered, []string, error) {
	var b strings.Builder
	var out rendered
	var names []string
	for _, part := range inj.Parts {
		if part.Secret == "" {
			b.WriteString(part.Literal)
			continue
		}
		names = append(names, part.Secret)
		v, err := s.secretValue(part.Secret)
		if err != nil {
			return rendered{}, names, err
		}
		b.Write(v)
		out.secrets = append(out.secrets, v)
	}
	out.text = b.String()
	return out, names, nil
}

func (s *Server) secretValue(name string) ([]byte, error) {
	if s.opts.Secrets == nil {
		return nil, errors.New("proxy: no secret broker configured")
	}
	v, err := s.opts.Secrets.Get(name)
	if err != nil {
		return nil, err
	}
	return v.Bytes(), nil
}

// prepareOutbound builds the upstream request: the client's request minus
// proxy and hop-by-hop headers, pointed at the normalised destination.
func prepareOutbound(req *http.Request, dst destination) *http.Request {
	// The request is ours (goproxy or the interception loop parsed it for
	// this call alone), so it is rewritten in place rather than cloned.
	out := req
	out.RequestURI = ""
	out.URL.Scheme = dst.scheme
	out.URL.Host = joinHostPort(dst.host, dst.port, dst.scheme)
	out.URL.User = nil
	// Forward the normalised path, the one the policy decided on: sent as
	// the client spelled it ("/a/%2e%2e/b"), an origin that does not resolve
	// encoded dot segments would serve a path no rule allowed. dst.path
	// holds only valid escapes, so it is its own RawPath.
	if p, err := url.PathUnescape(dst.path); err == nil {
		out.URL.Path, out.URL.RawPath = p, dst.path
	}
	out.Host = out.URL.Host
	// The client's "Connection: close" is about its own hop; upstream
	// connections stay pooled.
	out.Close = false
	removeHopByHop(out.Header, isUpgrade(req.Header))
	out.Header.Del("Proxy-Authorization")
	out.Header.Del("Proxy-Connection")
	out.Header.Del("Proxy-Authenticate")
	if _, ok := out.Header["User-Agent"]; !ok {
		// Keep Go's transport from inventing one on the client's behalf.
		out.Header["User-Agent"] = nil
	}
	return out
}

func joinHostPort(host string, port int, scheme string) string {
	if port == defaultPort(scheme) && !strings.Contains(host, ":") {
		return host
	}
	return net.JoinHostPort(host, strconv.Itoa(port))
}

var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// removeHopByHop drops hop-by-hop headers, including those the Connection
// header names. For a protocol upgrade, Connection and Upgrade must pass.
func removeHopByHop(h http.Header, upgrade bool) {
	for _, v := range h.Values("Connection") {
		for _, name := range strings.Split(v, ",") {
			name = strings.TrimSpace(name)
			if name == "" || (upgrade && strings.EqualFold(name, "upgrade")) {
				continue
			}
			h.Del(name)
		}
	}
	for _, name := range hopByHop {
		if upgrade && (name == "Connection" || name == "Upgrade") {
			continue
		}
		h.Del(name)
	}
}

func isUpgrade(h http.Header) bool {
	for _, v := range h.Values("Connection") {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), "upgrade") {
				return h.Get("Upgrade") != ""
			}
		}
	}
	return false
}

func countHeaderFields(h http.Header) int {
	n := 0
	for _, vs := range h {
		n += len(vs)
	}
	return n
}

func appendUnique(list []string, s string) []string {
	for _, x := range list {
		if x == s {
			return list
		}
	}
	return append(list, s)
}

func retryAfterSeconds(d time.Duration) int {
	secs := int((d + time.Second - 1) / time.Second)
	if secs < 1 {
		secs = 1
	}
	return secs
}

func ruleID(d rules.Decision) string {
	if d.Rule == nil {
		return ""
	}
	return d.Rule.ID
}

func applyDecision(rec *audit.Record, d rules.Decision) {
	rec.Rule = ruleID(d)
	rec.Reason = string(d.Reason)
	rec.Mode = "enforce"
	if d.Tenant != nil && d.Tenant.Report {
		rec.Mode = "report"
	}
	switch {
	case d.WouldDeny:
		rec.Decision = audit.DecisionWouldDeny
	case d.Allowed:
		rec.Decision = audit.DecisionAllow
	default:
		rec.Decision = audit.DecisionDeny
	}
}

// classifyUpstreamError maps a transport error to what the client is told.
// The raw error (addresses, resolver output) never reaches the client.
func classifyUpstreamError(err error) (int, rules.Reason) {
	var denied *netguard.DeniedError
	switch {
	case errors.As(err, &denied):
		return http.StatusForbidden, rules.ReasonDestinationNotPermitted
	case errors.Is(err, context.DeadlineExceeded), isTimeout(err):
		return http.StatusGatewayTimeout, rules.ReasonUpstreamTimeout
	}
	return http.StatusBadGateway, rules.ReasonUpstreamError
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

var errAuthThrottled = errors.New("too many failed authentications from this address")

type readCloser struct {
	io.Reader
	io.Closer
}

// countingReader counts request body bytes sent upstream.
type countingReader struct {
	r io.Reader
	c io.Closer
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func (c *countingReader) Close() error { return c.c.Close() }

// recordingBody streams a response body to the client and writes the
// request's audit record when the body ends: before the read that delivers
// the last bytes returns, so a client never holds a complete response whose
// record is missing. If the record cannot be written (audit failing closed),
// the response is cut short instead of completed.
type recordingBody struct {
	s        *Server
	ctx      context.Context
	rec      *audit.Record
	reqBody  *countingReader
	rc       io.ReadCloser
	scrubber *broker.Scrubber
	trailer  http.Header // scrubbed at the end of the body, when it is filled in
	// streaming marks a body whose length the origin did not announce
	// (chunked, event streams): its parts are passed on as they arrive.
	streaming bool
	reveal    [][]byte
	length    int64
	n         int64
	once      sync.Once
	err       error
	// abort is set for plain requests, whose body goproxy copies inside
	// net/http's handler. Returning an error there is not enough: goproxy
	// ignores it and net/http still ends a chunked or empty response
	// properly, so the client would hold a complete, unrecorded response.
	// Aborting the handler closes the connection instead.
	abort bool
}

func (b *recordingBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	b.n += int64(n)
	if err == io.EOF || (err == nil && b.length >= 0 && b.n >= b.length) {
		if ferr := b.done(); ferr != nil {
			if b.abort {
				panic(http.ErrAbortHandler)
			}
			return 0, ferr
		}
	}
	return n, err
}

// Close writes the record if the body was not read to its end; a failure to
// write it is returned, so that a response written without reading its body
// (HEAD inside an intercepted tunnel) is not completed either.
func (b *recordingBody) Close() error {
	err := b.rc.Close()
	if derr := b.done(); derr != nil && err == nil {
		err = derr
	}
	return err
}

func (b *recordingBody) done() error {
	b.once.Do(func() {
		if b.scrubber != nil && b.scrubber.Scrubbed() {
			b.rec.ReflectionScrubbed = true
		}
		if b.trailer != nil && broker.ScrubHeader(b.trailer, b.reveal) {
			b.rec.ReflectionScrubbed = true
		}
		if b.length >= 0 && b.n < b.length {
			b.rec.Message = "response body ended early"
		}
		b.err = b.s.finish(b.ctx, b.rec, b.reqBody, b.n)
	})
	return b.err
}

// finish completes and writes the record of a forwarded request.
func (s *Server) finish(ctx context.Context, rec *audit.Record, reqBody *countingReader, out int64) error {
	if reqBody != nil {
		rec.BytesIn = reqBody.n
	}
	rec.BytesOut = out
	rec.DurationMS = float64(s.opts.Now().Sub(rec.Time).Microseconds()) / 1000
	s.opts.Observer.Decision(rec.Tenant, string(rec.Decision), rules.Reason(rec.Reason), rec.DurationMS/1000)
	s.opts.Observer.Bytes(rec.Tenant, rec.BytesIn, rec.BytesOut)
	return s.write(context.WithoutCancel(ctx), rec)
}

func (s *Server) write(ctx context.Context, rec *audit.Record) error {
	if err := s.opts.Audit.Write(ctx, rec); err != nil {
		s.log.Error("audit record not written", "id", rec.ID, "kind", rec.Kind, "err", err)
		return err
	}
	return nil
}
