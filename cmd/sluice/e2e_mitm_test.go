package main

// End-to-end acceptance tests for TLS interception and secret injection
// (issue "TLS interception and Vault-backed secret injection"), through the
// real `sluice serve` binary with the file secret source; e2e_vault_test.go
// runs the same injection against a real Vault. The sandbox side trusts only
// sluice's interception CA (made with `sluice ca init`); origins are HTTPS
// servers on 127.0.0.1 with a throwaway CA that sluice trusts through
// --upstream-ca, reached by names the loopback DNS server resolves.
//
// Every test ends with a leak scan: sluice's stderr, its audit files and
// everything the client saw (headers, bodies, errors) must not contain any
// secret value. Origins that legitimately receive secrets are not tracked by
// the environment's own scan (they must see them); the scan of what they saw
// is done per test where it matters.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/audit"
)

// ---------------------------------------------------------------------------
// Helpers shared by the MITM and Vault tests.

// interceptionCA creates sluice's interception CA with the real CLI and
// returns the file paths and a pool that trusts only it (what a sandbox
// installs).
func interceptionCA(t *testing.T, dir string) (certPath, keyPath string, pool *x509.CertPool) {
	t.Helper()
	certPath, keyPath = filepath.Join(dir, "sluice-ca.pem"), filepath.Join(dir, "sluice-ca-key.pem")
	out, errOut, code := runSluice(t, "", "ca", "init", "--cert", certPath, "--key", keyPath)
	if code != 0 {
		t.Fatalf("sluice ca init: exit %d\n%s%s", code, out, errOut)
	}
	pemBytes, err := os.ReadFile(certPath)
	if err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemBytes) {
		t.Fatal("sluice ca init wrote no PEM certificate")
	}
	return certPath, keyPath, pool
}

// clientLog keeps everything a sandbox client saw, for the leak scan.
type clientLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *clientLog) response(resp *http.Response, body []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if resp != nil {
		fmt.Fprintf(&l.buf, "%s\n", resp.Status)
		_ = resp.Header.Write(&l.buf)
		_ = resp.Trailer.Write(&l.buf)
	}
	l.buf.Write(body)
	l.buf.WriteByte('\n')
}

func (l *clientLog) text(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.WriteString(s)
	l.buf.WriteByte('\n')
}

func (l *clientLog) bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return bytes.Clone(l.buf.Bytes())
}

// secretScan checks, once every sluice process of env has stopped, that
// no secret value appears in any log line, audit record or anything the
// client saw. It must be registered after newE2EEnv so that it runs before
// the environment's own cleanup (which would stop the processes anyway).
func secretScan(t *testing.T, env *e2eEnv, saw *clientLog, values func() []string) {
	t.Cleanup(func() {
		env.mu.Lock()
		procs := append([]*sluiceProc(nil), env.procs...)
		env.mu.Unlock()
		for _, p := range procs {
			p.Stop(t)
		}
		hs := processOutputs(t, procs)
		hs = append(hs, haystack{"what the client saw", saw.bytes()})
		vals := values()
		checked := 0
		for _, v := range vals {
			if v == "" {
				continue
			}
			checked++
			for _, h := range hs {
				if len(h.data) == 0 {
					continue
				}
				if bytes.Contains(h.data, []byte(v)) {
					t.Errorf("secret scan: a secret value (length %d) appears in %s", len(v), h.name)
				}
			}
		}
		if checked == 0 {
			t.Error("secret scan: no secret values to look for")
		}
		t.Logf("secret scan: %d secret values checked against %d outputs (%d bytes seen by the client)", checked, len(hs), len(saw.bytes()))
	})
}

// waitRecordWhere polls the audit file (bounded) for records after mark
// that match, and requires exactly one.
func waitRecordWhere(t *testing.T, p *sluiceProc, mark int, what string, match func(audit.Record) bool) audit.Record {
	t.Helper()
	deadline := time.Now().Add(e2eTimeout)
	for {
		recs := p.Records(t)
		var found []audit.Record
		if len(recs) > mark {
			for _, r := range recs[mark:] {
				if match(r) {
					found = append(found, r)
				}
			}
		}
		if len(found) == 1 {
			return found[0]
		}
		if len(found) > 1 {
			t.Fatalf("%s: %d matching audit records, want 1:\n%s", what, len(found), describeRecords(found))
		}
		if time.Now().After(deadline) {
			var rest []audit.Record
			if len(recs) > mark {
				rest = recs[mark:]
			}
			t.Fatalf("%s: no matching audit record within %s; records after mark:\n%s", what, e2eTimeout, describeRecords(rest))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func requestAt(path string) func(audit.Record) bool {
	return func(r audit.Record) bool { return r.Kind == audit.KindRequest && r.Path == path }
}

// ---------------------------------------------------------------------------
// An HTTPS origin that records, reflects and upgrades.

// reflectOrigin is a loopback origin whose handler, by path suffix:
//
//	.../reflect-header   echoes Authorization and X-Api-Key in response headers (and in a header name)
//	.../reflect-body     echoes them in a plain body with Content-Length
//	.../reflect-chunked  echoes them in a chunked body, each value split in two chunks with a flush and a pause between
//	.../ws               answers a WebSocket-style upgrade, then echoes lines ("whoami" gets the Authorization back)
//	anything else        200 "ok"
type reflectOrigin struct {
	Addr string
	Port int
	srv  *http.Server

	accepts atomic.Int64
	mu      sync.Mutex
	seen    []seenRequest
	wsLines []string
	release chan struct{} // .../stream waits for it between its two events
}

func startReflectOrigin(t *testing.T, pki *testPKI, names ...string) *reflectOrigin {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &reflectOrigin{Addr: ln.Addr().String(), Port: ln.Addr().(*net.TCPAddr).Port, release: make(chan struct{})}
	var l net.Listener = &countingListener{Listener: ln, n: &o.accepts}
	if pki != nil {
		l = tls.NewListener(l, pki.ServerConfig(t, names...))
	}
	o.srv = &http.Server{Handler: http.HandlerFunc(o.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = o.srv.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := o.srv.Shutdown(ctx); err != nil {
			_ = o.srv.Close()
		}
	})
	return o
}

func (o *reflectOrigin) Accepts() int64 { return o.accepts.Load() }

func (o *reflectOrigin) Seen() []seenRequest {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]seenRequest(nil), o.seen...)
}

// last returns the last request the origin saw at path, failing if none.
func (o *reflectOrigin) last(t *testing.T, path string) seenRequest {
	t.Helper()
	seen := o.Seen()
	for i := len(seen) - 1; i >= 0; i-- {
		if strings.SplitN(seen[i].RequestURI, "?", 2)[0] == path {
			return seen[i]
		}
	}
	t.Fatalf("origin %s saw no request for %s (saw %d requests)", o.Addr, path, len(seen))
	return seenRequest{}
}

func (o *reflectOrigin) serve(w http.ResponseWriter, r *http.Request) {
	o.mu.Lock()
	o.seen = append(o.seen, seenRequest{Method: r.Method, Host: r.Host, RequestURI: r.RequestURI, Header: r.Header.Clone()})
	o.mu.Unlock()
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
	values := append(r.Header.Values("Authorization"), r.Header.Values("X-Api-Key")...)
	switch {
	case strings.HasSuffix(r.URL.Path, "/reflect-header"):
		w.Header()["X-Echo-Authorization"] = r.Header.Values("Authorization")
		w.Header()["X-Echo-Api-Key"] = r.Header.Values("X-Api-Key")
		for _, v := range values {
			// A value in a header name: "Bearer x" → "X-Bearer-X-Seen".
			w.Header().Set("X-"+strings.ReplaceAll(v, " ", "-")+"-Seen", "1")
		}
		_, _ = io.WriteString(w, "ok\n")
	case strings.HasSuffix(r.URL.Path, "/reflect-body"):
		body := "you sent: " + strings.Join(values, " | ") + "\n"
		w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		_, _ = io.WriteString(w, body)
	case strings.HasSuffix(r.URL.Path, "/reflect-chunked"):
		f := w.(http.Flusher)
		_, _ = io.WriteString(w, "you sent: ")
		f.Flush()
		for _, v := range values {
			half := len(v) / 2
			_, _ = io.WriteString(w, v[:half])
			f.Flush()
			time.Sleep(30 * time.Millisecond)
			_, _ = io.WriteString(w, v[half:])
			f.Flush()
			_, _ = io.WriteString(w, " | ")
		}
		_, _ = io.WriteString(w, "end\n")
	case strings.HasSuffix(r.URL.Path, "/ws"):
		o.upgrade(w, r)
	case strings.HasSuffix(r.URL.Path, "/stream"):
		// Server-sent events: the first event must reach the client
		// before the second exists. The first carries the reflected value,
		// so a scrubber is in the path when the request had a secret.
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: first "+strings.Join(values, " | ")+"\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-o.release:
		case <-r.Context().Done():
			return
		case <-time.After(e2eTimeout):
		}
		_, _ = io.WriteString(w, "data: second\n\n")
	default:
		_, _ = io.WriteString(w, "ok\n")
	}
}

// wsAccept is RFC 6455's Sec-WebSocket-Accept for key.
func wsAccept(key string) string {
	h := sha1.Sum([]byte(key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
	return base64.StdEncoding.EncodeToString(h[:])
}

// upgrade is a tiny WebSocket-like endpoint: the handshake is real, the
// bytes after it are lines, not frames, which is all a proxy that splices
// can be asked about.
func (o *reflectOrigin) upgrade(w http.ResponseWriter, r *http.Request) {
	if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") || !strings.Contains(strings.ToLower(r.Header.Get("Connection")), "upgrade") {
		http.Error(w, "upgrade required", http.StatusUpgradeRequired)
		return
	}
	conn, brw, err := w.(http.Hijacker).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(e2eTimeout))
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n", wsAccept(r.Header.Get("Sec-WebSocket-Key")))
	if brw.Flush() != nil {
		return
	}
	for {
		line, err := brw.ReadString('\n')
		if err != nil {
			return
		}
		line = strings.TrimSuffix(line, "\n")
		o.mu.Lock()
		o.wsLines = append(o.wsLines, line)
		o.mu.Unlock()
		reply := "echo:" + line
		if line == "whoami" {
			// Reflect the credential over the upgraded stream.
			reply = "you sent: " + strings.Join(r.Header.Values("Authorization"), " | ")
		}
		if line == "bye" {
			_, _ = io.WriteString(brw, "bye\n")
			_ = brw.Flush()
			return
		}
		if _, err := io.WriteString(brw, reply+"\n"); err != nil || brw.Flush() != nil {
			return
		}
	}
}

// ---------------------------------------------------------------------------
// The MITM world.

// mitmWorld is the setup every interception test runs with: DNS names for
// the origins, an origin CA that sluice trusts, sluice's interception CA
// (the only one the client trusts), a file of secrets, one tenant.
type mitmWorld struct {
	env  *e2eEnv
	dns  *testDNS
	pki  *testPKI
	cred testCredential
	saw  *clientLog

	caCert, caKey string
	sandboxRoots  *x509.CertPool

	api      *reflectOrigin // https api.test:A: the secret's host
	apiPort2 *reflectOrigin // https api.test:A2: same host, another port
	other    *reflectOrigin // https other.test:B: allowed, no injection, not the secret's host
	plain    *reflectOrigin // http on H: api.test (inject, TLS required), plain.test (inject_over_http)

	secretsFile string
	tok, ph     string // secret values
	placeholder string

	mu     sync.Mutex
	values []string // every secret value the scan looks for

	p *sluiceProc
}

func newMITMWorld(t *testing.T) *mitmWorld {
	t.Helper()
	w := &mitmWorld{env: newE2EEnv(t), saw: &clientLog{}}
	w.dns = startTestDNS(t, map[string][]string{
		"api.test": {"127.0.0.1"}, "other.test": {"127.0.0.1"}, "plain.test": {"127.0.0.1"},
	})
	w.pki = newTestPKI(t, w.env.Dir)
	w.caCert, w.caKey, w.sandboxRoots = interceptionCA(t, w.env.Dir)
	w.api = startReflectOrigin(t, w.pki, "api.test")
	w.apiPort2 = startReflectOrigin(t, w.pki, "api.test")
	w.other = startReflectOrigin(t, w.pki, "other.test")
	w.plain = startReflectOrigin(t, nil)
	w.cred = w.env.StaticCredential("acme", "ci")

	w.tok = "tok" + randomToken(t)
	w.ph = "ph" + randomToken(t)
	w.placeholder = "SLUICE_PLACEHOLDER_ph_" + randomToken(t)[:12]
	w.secretsFile = w.env.Path("secrets.yaml")
	w.writeSecrets(t, map[string]string{"tok": w.tok, "ph": w.ph})
	w.addSecret(w.tok)
	w.addSecret(w.ph)
	secretScan(t, w.env, w.saw, func() []string {
		w.mu.Lock()
		defer w.mu.Unlock()
		return append([]string(nil), w.values...)
	})
	return w
}

// addSecret adds a value to the leak scan.
func (w *mitmWorld) addSecret(v string) {
	w.mu.Lock()
	w.values = append(w.values, v)
	w.mu.Unlock()
}

// randomToken is 32 random hex digits: a value that can only appear where
// it was put.
func randomToken(t *testing.T) string {
	t.Helper()
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func (w *mitmWorld) writeSecrets(t *testing.T, values map[string]string) {
	t.Helper()
	var b strings.Builder
	for k, v := range values {
		fmt.Fprintf(&b, "%s: %q\n", k, v)
	}
	tmp := w.secretsFile + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, w.secretsFile); err != nil {
		t.Fatal(err)
	}
}

// config is the policy of the interception tests. extraAllow is appended
// to acme's allow list (for the reload test).
func (w *mitmWorld) config(apiRules string) string {
	if apiRules == "" {
		apiRules = w.apiRules()
	}
	return fmt.Sprintf(`version: 1
server:
  read_header_timeout: 5s
  dial_timeout: 3s
  upstream_timeout: 10s
  shutdown_timeout: 5s
audit:
  on_failure: closed
  fsync: never
ca:
  cert: %[1]s
  key: %[2]s
broker:
  refresh: 200ms
  max_staleness: 1m
  file:
    path: %[3]s
secrets:
  - name: tok
    source: file
    hosts: [api.test, plain.test]
  - name: ph
    source: file
    hosts: [api.test]
    placeholder: %[4]s
tenants:
  - id: acme
    credentials:
      - name: %[5]s
        hash: %[6]s
    allow_private_cidrs: [127.0.0.0/8]
    allow:
%[7]s
      - id: api-port2
        host: api.test
        ports: [%[8]d]
        inspect: true
      - id: other
        host: other.test
        ports: [%[9]d]
        inspect: true
      - id: api-http
        host: api.test
        ports: [%[10]d]
        inject:
          - header: Authorization
            value: "Bearer ${secret:tok}"
      - id: plain-http
        host: plain.test
        ports: [%[10]d]
        inject_over_http: true
        inject:
          - header: Authorization
            value: "Bearer ${secret:tok}"
`, w.caCert, w.caKey, w.secretsFile, w.placeholder, w.cred.Name, w.cred.Hash,
		apiRules, w.apiPort2.Port, w.other.Port, w.plain.Port)
}

// apiRules are the rules for api.test:A: /v1/** gets the secret, anything
// else is allowed without it; the tunnel is intercepted because of the first.
func (w *mitmWorld) apiRules() string {
	return fmt.Sprintf(`      - id: api-inject
        host: api.test
        ports: [%[1]d]
        paths: ["/v1/**"]
        inject:
          - header: Authorization
            value: "Bearer ${secret:tok}"
      - id: api-open
        host: api.test
        ports: [%[1]d]`, w.api.Port)
}

func (w *mitmWorld) start(t *testing.T) *sluiceProc {
	t.Helper()
	w.p = w.env.StartSluice(w.config(""), sluiceOptions{Resolver: w.dns.Addr, UpstreamCA: w.pki.CAFile})
	return w.p
}

// client goes through sluice with the tenant's credential and trusts only
// the interception CA, like a sandbox with sluice's bundle installed.
func (w *mitmWorld) client() *http.Client {
	return w.p.Client(w.cred, &tls.Config{RootCAs: w.sandboxRoots, MinVersion: tls.VersionTLS12})
}

// do sends req with a fresh client and returns the response with its body
// read; both (or the error) go into the client log.
func (w *mitmWorld) do(t *testing.T, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	cl := w.client()
	defer cl.CloseIdleConnections()
	resp, err := cl.Do(req)
	if err != nil {
		w.saw.text(err.Error())
		t.Fatalf("%s %s through sluice: %v", req.Method, req.URL, err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	w.saw.response(resp, body)
	if err != nil {
		w.saw.text(err.Error())
		t.Fatalf("%s %s through sluice: reading body: %v", req.Method, req.URL, err)
	}
	return resp, body
}

func (w *mitmWorld) get(t *testing.T, rawURL string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req := newRequest(t, http.MethodGet, rawURL)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	return w.do(t, req)
}

func (w *mitmWorld) apiURL(path string) string {
	return fmt.Sprintf("https://api.test:%d%s", w.api.Port, path)
}

// innerConn is a raw intercepted tunnel: TLS to sluice's leaf, requests
// written by hand so a test controls Host, request-target and keep-alive.
type innerConn struct {
	w    *mitmWorld
	conn *tls.Conn
	br   *bufio.Reader
}

func (w *mitmWorld) openTunnel(t *testing.T, target, serverName string) *innerConn {
	t.Helper()
	conn, resp, body := w.p.Connect(t, w.cred, target)
	if conn == nil {
		w.saw.response(resp, body)
		t.Fatalf("CONNECT %s: %d %.300s", target, resp.StatusCode, body)
	}
	tc := tls.Client(conn, &tls.Config{RootCAs: w.sandboxRoots, ServerName: serverName, MinVersion: tls.VersionTLS12})
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	if err := tc.HandshakeContext(ctx); err != nil {
		t.Fatalf("TLS to sluice's leaf for %s: %v", serverName, err)
	}
	t.Cleanup(func() { tc.Close() })
	return &innerConn{w: w, conn: tc, br: bufio.NewReader(tc)}
}

// roundTrip writes one raw request head (CRLFs added) and reads the
// response and its body.
func (c *innerConn) roundTrip(t *testing.T, method string, lines ...string) (*http.Response, []byte) {
	t.Helper()
	raw := strings.Join(lines, "\r\n") + "\r\n\r\n"
	if _, err := io.WriteString(c.conn, raw); err != nil {
		t.Fatalf("writing inside the tunnel: %v", err)
	}
	resp, err := http.ReadResponse(c.br, &http.Request{Method: method})
	if err != nil {
		c.w.saw.text(err.Error())
		t.Fatalf("reading a response inside the tunnel: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	c.w.saw.response(resp, body)
	if err != nil {
		t.Fatalf("reading a body inside the tunnel: %v", err)
	}
	return resp, body
}

// ---------------------------------------------------------------------------
// Tests.

// TestE2EMITMInjection: the secret reaches exactly the rule's host, port
// and paths over TLS, replacing whatever the client sent; nowhere else.
func TestE2EMITMInjection(t *testing.T) {
	w := newMITMWorld(t)
	p := w.start(t)
	want := "Bearer " + w.tok

	t.Run("injected into a request made without it", func(t *testing.T) {
		mark := p.AuditMark(t)
		resp, body := w.get(t, w.apiURL("/v1/plain"))
		if resp.StatusCode != 200 || string(body) != "ok\n" {
			t.Fatalf("status %d body %q", resp.StatusCode, body)
		}
		if got := w.api.last(t, "/v1/plain").Header.Values("Authorization"); len(got) != 1 || got[0] != want {
			t.Errorf("origin saw %d Authorization values, want exactly the injected one", len(got))
		}
		rec := waitRecordWhere(t, p, mark, "/v1/plain", requestAt("/v1/plain"))
		checkRecord(t, rec, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "api-inject", Tenant: "acme", Host: "api.test", Port: w.api.Port, Status: 200})
		if !rec.Intercepted || rec.TunnelID == "" || rec.Scheme != "https" {
			t.Errorf("record intercepted=%v tunnel=%q scheme=%q", rec.Intercepted, rec.TunnelID, rec.Scheme)
		}
		if len(rec.Secrets) != 1 || rec.Secrets[0] != "tok" {
			t.Errorf("record secrets %v, want [tok]", rec.Secrets)
		}
		if rec.ReflectionScrubbed {
			t.Error("record says reflection_scrubbed for a response that reflected nothing")
		}
	})

	t.Run("client's own Authorization replaced, never duplicated", func(t *testing.T) {
		resp, _ := w.get(t, w.apiURL("/v1/own"), "Authorization", "Bearer client-own-value", "Authorization", "Basic Y2xpZW50OnZhbHVl", "authorization", "token lower-case")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		got := w.api.last(t, "/v1/own").Header.Values("Authorization")
		if len(got) != 1 || got[0] != want {
			t.Errorf("origin saw %d Authorization values (injected one present: %v), want exactly the injected one",
				len(got), len(got) > 0 && got[0] == want)
		}
	})

	t.Run("non-matching path: allowed, no injection", func(t *testing.T) {
		mark := p.AuditMark(t)
		resp, _ := w.get(t, w.apiURL("/public/x"), "Authorization", "Bearer client-own-value")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := w.api.last(t, "/public/x").Header.Values("Authorization"); len(got) != 1 || got[0] != "Bearer client-own-value" {
			t.Errorf("origin saw Authorization %q, want the client's own value untouched", got)
		}
		rec := waitRecordWhere(t, p, mark, "/public/x", requestAt("/public/x"))
		checkRecord(t, rec, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "api-open", Tenant: "acme", Host: "api.test", Status: 200})
		if len(rec.Secrets) != 0 {
			t.Errorf("record secrets %v, want none", rec.Secrets)
		}
	})

	t.Run("another port of the same host: no injection", func(t *testing.T) {
		resp, _ := w.get(t, fmt.Sprintf("https://api.test:%d/v1/port2", w.apiPort2.Port))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := w.apiPort2.last(t, "/v1/port2").Header.Values("Authorization"); len(got) != 0 {
			t.Errorf("origin on another port got %d Authorization values", len(got))
		}
	})

	t.Run("another host: no injection", func(t *testing.T) {
		resp, _ := w.get(t, fmt.Sprintf("https://other.test:%d/v1/other", w.other.Port))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := w.other.last(t, "/v1/other").Header.Values("Authorization"); len(got) != 0 {
			t.Errorf("another host got %d Authorization values", len(got))
		}
	})

	t.Run("cleartext HTTP refused with injection_requires_tls", func(t *testing.T) {
		before := len(w.plain.Seen())
		accepts := w.plain.Accepts()
		mark := p.AuditMark(t)
		resp, body := w.get(t, fmt.Sprintf("http://api.test:%d/v1/cleartext", w.plain.Port))
		checkDenial(t, "cleartext injection", resp, body, http.StatusForbidden, "injection_requires_tls")
		rec := waitRecordWhere(t, p, mark, "cleartext", requestAt("/v1/cleartext"))
		checkRecord(t, rec, wantRecord{Decision: audit.DecisionDeny, Reason: "injection_requires_tls", Rule: "api-http",
			Tenant: "acme", Host: "api.test", Status: 403})
		if len(w.plain.Seen()) != before || w.plain.Accepts() != accepts {
			t.Error("the cleartext origin was contacted")
		}
	})

	t.Run("cleartext HTTP with inject_over_http", func(t *testing.T) {
		resp, _ := w.get(t, fmt.Sprintf("http://plain.test:%d/v1/over-http", w.plain.Port), "Authorization", "Bearer client-own-value")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := w.plain.last(t, "/v1/over-http").Header.Values("Authorization"); len(got) != 1 || got[0] != want {
			t.Errorf("origin saw %d Authorization values, want exactly the injected one", len(got))
		}
	})

	// Only api.test:A (TLS) and plain.test (explicitly cleartext) may have
	// seen the value.
	for _, o := range []*reflectOrigin{w.apiPort2, w.other} {
		for _, r := range o.Seen() {
			var b bytes.Buffer
			_ = r.Header.Write(&b)
			if bytes.Contains(b.Bytes(), []byte(w.tok)) {
				t.Errorf("origin %s (not the secret's host and port) received the secret", o.Addr)
			}
		}
	}
}

// TestE2EMITMFileSourceRotation: the quickstart path. A new value in the
// secrets file is used within the refresh interval (bounded poll).
func TestE2EMITMFileSourceRotation(t *testing.T) {
	w := newMITMWorld(t)
	p := w.start(t)
	old := w.tok
	resp, _ := w.get(t, w.apiURL("/v1/before"))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if got := w.api.last(t, "/v1/before").Header.Get("Authorization"); got != "Bearer "+old {
		t.Fatal("origin did not get the file's value")
	}

	rotated := "tok" + randomToken(t)
	w.addSecret(rotated)
	w.writeSecrets(t, map[string]string{"tok": rotated, "ph": w.ph})
	deadline := time.Now().Add(e2eTimeout)
	for i := 0; ; i++ {
		path := fmt.Sprintf("/v1/after/%d", i)
		resp, _ := w.get(t, w.apiURL(path))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d during rotation", resp.StatusCode)
		}
		got := w.api.last(t, path).Header.Get("Authorization")
		if got == "Bearer "+rotated {
			break
		}
		if got != "Bearer "+old {
			t.Fatal("origin got neither the old nor the new value")
		}
		if time.Now().After(deadline) {
			t.Fatalf("new file value not used within %s", e2eTimeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(p.Stderr(), `"broker: secret rotated"`) {
		t.Error(`no "broker: secret rotated" log line`)
	}
}

// TestE2EMITMHostBinding: every request inside an intercepted tunnel is
// bound to the CONNECT host and port and decided again.
func TestE2EMITMHostBinding(t *testing.T) {
	w := newMITMWorld(t)
	p := w.start(t)
	target := fmt.Sprintf("api.test:%d", w.api.Port)
	host := target
	otherHost := fmt.Sprintf("other.test:%d", w.other.Port)

	// host_mismatch is a client error (400) everywhere in sluice, in a
	// tunnel as outside one. recHost is what the record names: the
	// tunnel's host, or nothing when the framing guard refused the head
	// before it was parsed.
	refused := func(t *testing.T, c *innerConn, name, recHost string, lines ...string) {
		t.Helper()
		accepts, seen := w.other.Accepts(), len(w.other.Seen())
		apiSeen := len(w.api.Seen())
		mark := p.AuditMark(t)
		resp, body := c.roundTrip(t, http.MethodGet, lines...)
		checkDenial(t, name, resp, body, http.StatusBadRequest, "host_mismatch")
		rec := waitRecordWhere(t, p, mark, name, func(r audit.Record) bool { return r.Kind == audit.KindRequest })
		checkRecord(t, rec, wantRecord{Decision: audit.DecisionDeny, Reason: "host_mismatch", Rule: "", Tenant: "acme", Host: recHost, Status: 400})
		if rec.TunnelID == "" || !rec.Intercepted {
			t.Errorf("record tunnel=%q intercepted=%v", rec.TunnelID, rec.Intercepted)
		}
		if w.other.Accepts() != accepts || len(w.other.Seen()) != seen {
			t.Errorf("%s: the other origin saw a connection", name)
		}
		if len(w.api.Seen()) != apiSeen {
			t.Errorf("%s: the tunnel's origin got the refused request", name)
		}
	}

	t.Run("Host header names another host", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		refused(t, c, "Host other.test", "api.test", "GET /v1/a HTTP/1.1", "Host: "+otherHost)
	})
	t.Run("Host header names another port", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		refused(t, c, "Host api.test:port2", "api.test", "GET /v1/a HTTP/1.1", fmt.Sprintf("Host: api.test:%d", w.apiPort2.Port))
	})
	t.Run("absolute-form names another host, Host agrees with it", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		refused(t, c, "absolute-form", "api.test", "GET https://"+otherHost+"/v1/a HTTP/1.1", "Host: "+otherHost)
	})
	t.Run("absolute-form names another host than Host", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		refused(t, c, "absolute-form vs Host", "", "GET https://"+otherHost+"/v1/a HTTP/1.1", "Host: "+host)
	})
	t.Run("absolute-form with another scheme", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		refused(t, c, "absolute-form http", "api.test", "GET http://"+host+"/v1/a HTTP/1.1", "Host: "+host)
	})
	t.Run("second request on the same keep-alive connection", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		resp, _ := c.roundTrip(t, http.MethodGet, "GET /v1/first HTTP/1.1", "Host: "+host)
		if resp.StatusCode != 200 {
			t.Fatalf("first request: %d", resp.StatusCode)
		}
		if got := w.api.last(t, "/v1/first").Header.Get("Authorization"); got != "Bearer "+w.tok {
			t.Error("first request was not injected")
		}
		refused(t, c, "second request for other.test", "api.test", "GET /v1/second HTTP/1.1", "Host: "+otherHost)
		// The refusal did not end the tunnel; a bound request still works.
		resp, _ = c.roundTrip(t, http.MethodGet, "GET /v1/third HTTP/1.1", "Host: "+host)
		if resp.StatusCode != 200 {
			t.Errorf("third request: %d", resp.StatusCode)
		}
	})

	t.Run("policy change stops the next request in a live tunnel", func(t *testing.T) {
		c := w.openTunnel(t, target, "api.test")
		resp, _ := c.roundTrip(t, http.MethodGet, "GET /v1/before-reload HTTP/1.1", "Host: "+host)
		if resp.StatusCode != 200 {
			t.Fatalf("before reload: %d", resp.StatusCode)
		}
		tunnelID := ""
		mark := p.AuditMark(t)
		// Revoke /v1/** for api.test:A; everything else stays.
		revoked := fmt.Sprintf(`      - id: api-open
        host: api.test
        ports: [%d]
        paths: ["/public/**"]`, w.api.Port)
		rewriteConfig(t, p, w.config(revoked))
		waitRecordWhere(t, p, mark, "config reload", func(r audit.Record) bool {
			return r.Kind == audit.KindConfigReload && r.Decision == audit.DecisionAllow
		})
		seen := len(w.api.Seen())
		mark = p.AuditMark(t)
		resp, body := c.roundTrip(t, http.MethodGet, "GET /v1/after-reload HTTP/1.1", "Host: "+host)
		if resp.StatusCode != http.StatusForbidden {
			t.Fatalf("after reload: status %d, want 403 (%.200q)", resp.StatusCode, body)
		}
		if resp.Header.Get("X-Sluice-Reason") == "" {
			t.Error("refusal has no X-Sluice-Reason")
		}
		rec := waitRecordWhere(t, p, mark, "after reload", requestAt("/v1/after-reload"))
		if rec.Decision != audit.DecisionDeny || rec.Status != 403 || len(rec.Secrets) != 0 {
			t.Errorf("record decision=%s status=%d secrets=%v", rec.Decision, rec.Status, rec.Secrets)
		}
		tunnelID = rec.TunnelID
		if len(w.api.Seen()) != seen {
			t.Error("origin got the request the new policy refuses")
		}
		// The same tunnel still serves what the new policy allows.
		resp, _ = c.roundTrip(t, http.MethodGet, "GET /public/after-reload HTTP/1.1", "Host: "+host)
		if resp.StatusCode != 200 {
			t.Errorf("allowed path after reload: %d", resp.StatusCode)
		}
		rec2 := waitRecordWhere(t, p, mark, "allowed after reload", requestAt("/public/after-reload"))
		if rec2.TunnelID != tunnelID || tunnelID == "" {
			t.Errorf("requests were not in the same tunnel: %q vs %q", rec2.TunnelID, tunnelID)
		}
	})
}

// rewriteConfig replaces the running process's config file atomically
// (write and rename, as config management does).
func rewriteConfig(t *testing.T, p *sluiceProc, config string) {
	t.Helper()
	tmp := p.ConfigPath + ".new"
	if err := os.WriteFile(tmp, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, p.ConfigPath); err != nil {
		t.Fatal(err)
	}
}

// TestE2EMITMReflection: an origin that echoes the injected value back
// never gets it to the client, in headers, plain or chunked bodies.
func TestE2EMITMReflection(t *testing.T) {
	w := newMITMWorld(t)
	p := w.start(t)
	for _, path := range []string{"/v1/reflect-header", "/v1/reflect-body", "/v1/reflect-chunked"} {
		t.Run(path, func(t *testing.T) {
			mark := p.AuditMark(t)
			resp, body := w.get(t, w.apiURL(path))
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			var head bytes.Buffer
			_ = resp.Header.Write(&head)
			all := append(head.Bytes(), body...)
			if bytes.Contains(all, []byte(w.tok)) {
				t.Fatal("the client received the secret")
			}
			// Headers say [REDACTED], bodies [REDACTED-BY-SLUICE].
			if !bytes.Contains(all, []byte("[REDACTED")) {
				t.Errorf("no redaction where the origin reflected the value; headers %q body %q", head.String(), body)
			}
			if path == "/v1/reflect-header" {
				for name := range resp.Header {
					if strings.HasSuffix(name, "-Seen") {
						t.Errorf("header whose name carries the value reached the client (%d bytes)", len(name))
					}
				}
			}
			rec := waitRecordWhere(t, p, mark, path, requestAt(path))
			checkRecord(t, rec, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "api-inject", Tenant: "acme", Host: "api.test", Status: 200})
			if !rec.ReflectionScrubbed {
				t.Error("record does not say reflection_scrubbed")
			}
		})
	}

	t.Run("Accept-Encoding forced to identity", func(t *testing.T) {
		resp, _ := w.get(t, w.apiURL("/v1/enc"), "Accept-Encoding", "gzip")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := w.api.last(t, "/v1/enc").Header.Values("Accept-Encoding"); len(got) != 1 || got[0] != "identity" {
			t.Errorf("origin saw Accept-Encoding %q, want identity", got)
		}
	})
}

// TestE2EMITMPlaceholder: the sandbox holds a placeholder; sluice swaps it
// for the secret's hosts and refuses it anywhere else.
func TestE2EMITMPlaceholder(t *testing.T) {
	w := newMITMWorld(t)
	p := w.start(t)

	t.Run("swapped for the secret's host", func(t *testing.T) {
		mark := p.AuditMark(t)
		resp, _ := w.get(t, w.apiURL("/public/ph"), "X-Api-Key", w.placeholder)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		got := w.api.last(t, "/public/ph").Header.Values("X-Api-Key")
		if len(got) != 1 || got[0] != w.ph {
			t.Errorf("origin did not get the real value in place of the placeholder (%d values)", len(got))
		}
		rec := waitRecordWhere(t, p, mark, "placeholder", requestAt("/public/ph"))
		checkRecord(t, rec, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "api-open", Tenant: "acme", Host: "api.test", Status: 200})
		if len(rec.Secrets) != 1 || rec.Secrets[0] != "ph" || rec.Exfiltration {
			t.Errorf("record secrets=%v exfiltration=%v", rec.Secrets, rec.Exfiltration)
		}
	})

	t.Run("swapped value reflected is scrubbed", func(t *testing.T) {
		resp, body := w.get(t, w.apiURL("/public/reflect-body"), "X-Api-Key", w.placeholder)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if bytes.Contains(body, []byte(w.ph)) || !bytes.Contains(body, []byte("[REDACTED-BY-SLUICE]")) {
			t.Errorf("reflected swapped value not redacted (%d bytes)", len(body))
		}
	})

	t.Run("Bearer placeholder in Authorization", func(t *testing.T) {
		resp, _ := w.get(t, w.apiURL("/public/bearer"), "Authorization", "Bearer "+w.placeholder)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := w.api.last(t, "/public/bearer").Header.Values("Authorization"); len(got) != 1 || got[0] != "Bearer "+w.ph {
			t.Errorf("origin did not get Bearer <real value> (%d values)", len(got))
		}
	})

	t.Run("foreign host: exfiltration attempt", func(t *testing.T) {
		seen := len(w.other.Seen())
		mark := p.AuditMark(t)
		resp, body := w.get(t, fmt.Sprintf("https://other.test:%d/v1/steal", w.other.Port), "Authorization", "Bearer "+w.placeholder)
		checkDenial(t, "placeholder to other.test", resp, body, http.StatusForbidden, "exfiltration_attempt")
		rec := waitRecordWhere(t, p, mark, "exfiltration", requestAt("/v1/steal"))
		checkRecord(t, rec, wantRecord{Decision: audit.DecisionDeny, Reason: "exfiltration_attempt", Rule: "", Tenant: "acme", Host: "other.test", Status: 403})
		if !rec.Exfiltration || len(rec.Secrets) != 1 || rec.Secrets[0] != "ph" {
			t.Errorf("record exfiltration=%v secrets=%v", rec.Exfiltration, rec.Secrets)
		}
		if len(w.other.Seen()) != seen {
			t.Error("the foreign origin got the request")
		}
	})

	t.Run("foreign host in the query string", func(t *testing.T) {
		resp, body := w.get(t, fmt.Sprintf("https://other.test:%d/v1/q?key=%s", w.other.Port, w.placeholder))
		checkDenial(t, "placeholder in query", resp, body, http.StatusForbidden, "exfiltration_attempt")
	})

	t.Run("own host in the URL is refused too", func(t *testing.T) {
		resp, body := w.get(t, w.apiURL("/public/q?key="+w.placeholder))
		checkDenial(t, "placeholder in URL", resp, body, http.StatusForbidden, "exfiltration_attempt")
	})

	t.Run("cleartext to the secret's host", func(t *testing.T) {
		resp, body := w.get(t, fmt.Sprintf("http://api.test:%d/x", w.plain.Port), "X-Api-Key", w.placeholder)
		// The rule for api.test on the cleartext port injects, so TLS is
		// required before anything else.
		checkDenial(t, "placeholder over http", resp, body, http.StatusForbidden, "injection_requires_tls")
	})
}

// TestE2EMITMWebSocket: an upgrade inside an intercepted tunnel goes
// through the pipeline (injection included), then bytes flow both ways.
func TestE2EMITMWebSocket(t *testing.T) {
	w := newMITMWorld(t)
	p := w.start(t)
	target := fmt.Sprintf("api.test:%d", w.api.Port)
	c := w.openTunnel(t, target, "api.test")
	mark := p.AuditMark(t)
	key := base64.StdEncoding.EncodeToString([]byte(randomToken(t)[:16]))
	head := strings.Join([]string{
		"GET /v1/ws HTTP/1.1", "Host: " + target, "Upgrade: websocket", "Connection: Upgrade",
		"Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: " + key, "Authorization: Bearer sandbox-value",
		"Sec-WebSocket-Extensions: permessage-deflate",
	}, "\r\n") + "\r\n\r\n"
	if _, err := io.WriteString(c.conn, head); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(c.br, &http.Request{Method: http.MethodGet})
	if err != nil {
		t.Fatalf("upgrade response: %v", err)
	}
	w.saw.response(resp, nil)
	if resp.StatusCode != http.StatusSwitchingProtocols {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("upgrade: status %d %.200q", resp.StatusCode, b)
	}
	if got := resp.Header.Get("Sec-WebSocket-Accept"); got != wsAccept(key) {
		t.Errorf("Sec-WebSocket-Accept %q, want %q", got, wsAccept(key))
	}
	if !strings.EqualFold(resp.Header.Get("Upgrade"), "websocket") {
		t.Errorf("Upgrade header %q", resp.Header.Get("Upgrade"))
	}
	if ext := w.api.last(t, "/v1/ws").Header.Values("Sec-WebSocket-Extensions"); len(ext) != 0 {
		t.Errorf("compression offered to the origin on a handshake that carries a secret: %q", ext)
	}
	got := w.api.last(t, "/v1/ws").Header.Values("Authorization")
	if len(got) != 1 || got[0] != "Bearer "+w.tok {
		t.Errorf("upgrade request reached the origin with %d Authorization values, want exactly the injected one", len(got))
	}
	rec := waitRecordWhere(t, p, mark, "upgrade", requestAt("/v1/ws"))
	checkRecord(t, rec, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "api-inject", Tenant: "acme", Host: "api.test", Status: 101})
	if len(rec.Secrets) != 1 || rec.Secrets[0] != "tok" {
		t.Errorf("record secrets %v", rec.Secrets)
	}

	// Bytes flow after the switch, in both directions, including lines
	// larger than any single read.
	_ = c.conn.SetDeadline(time.Now().Add(e2eTimeout))
	big := strings.Repeat("x", 100<<10)
	for i, line := range []string{"hello", "second message", big} {
		if _, err := io.WriteString(c.conn, line+"\n"); err != nil {
			t.Fatalf("write %d after upgrade: %v", i, err)
		}
		reply, err := c.br.ReadString('\n')
		if err != nil {
			t.Fatalf("read %d after upgrade: %v", i, err)
		}
		if reply != "echo:"+line+"\n" {
			t.Fatalf("reply %d: %.60q (len %d), want echo of %d bytes", i, reply, len(reply), len(line))
		}
	}
	// A reflected secret is masked byte for byte after the switch too
	// (frame lengths stay valid), and a line after it still arrives.
	if _, err := io.WriteString(c.conn, "whoami\nafter\n"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"you sent: Bearer " + strings.Repeat("*", len(w.tok)) + "\n", "echo:after\n"} {
		reply, err := c.br.ReadString('\n')
		w.saw.text(reply)
		if err != nil {
			t.Fatalf("read after whoami: %v", err)
		}
		if strings.Contains(reply, w.tok) {
			t.Fatal("the secret reached the client over the upgraded connection")
		}
		if reply != want {
			t.Errorf("reply %q, want %q", reply, want)
		}
	}
	if _, err := io.WriteString(c.conn, "bye\n"); err != nil {
		t.Fatal(err)
	}
	if reply, err := c.br.ReadString('\n'); err != nil || reply != "bye\n" {
		t.Fatalf("bye: %q %v", reply, err)
	}
	// The origin closed; the tunnel ends and is recorded.
	if _, err := c.br.ReadByte(); !errors.Is(err, io.EOF) && !isClosedErr(err) {
		t.Errorf("after the origin closed the upgraded connection: %v", err)
	}
	tun := waitRecordWhere(t, p, mark, "tunnel", func(r audit.Record) bool { return r.Kind == audit.KindTunnel })
	if tun.ID != rec.TunnelID || !tun.Intercepted || tun.BytesIn < int64(len(big)) || tun.BytesOut < int64(len(big)) {
		t.Errorf("tunnel record id=%q (request's %q) intercepted=%v in=%d out=%d", tun.ID, rec.TunnelID, tun.Intercepted, tun.BytesIn, tun.BytesOut)
	}
}

// TestE2EMITMStreaming: a streamed response (server-sent events, as LLM
// APIs use) reaches the client as it arrives, inside an intercepted tunnel,
// with and without a secret (and so a scrubber) in the path.
func TestE2EMITMStreaming(t *testing.T) {
	w := newMITMWorld(t)
	w.start(t)
	for _, path := range []string{"/public/stream", "/v1/stream"} {
		t.Run(path, func(t *testing.T) {
			first := make(chan string, 1)
			done := make(chan error, 1)
			req := newRequest(t, http.MethodGet, w.apiURL(path))
			go func() {
				cl := w.client()
				defer cl.CloseIdleConnections()
				resp, err := cl.Do(req)
				if err != nil {
					w.saw.text(err.Error())
					done <- err
					return
				}
				defer resp.Body.Close()
				br := bufio.NewReader(resp.Body)
				var ev strings.Builder
				for !strings.HasSuffix(ev.String(), "\n\n") {
					line, err := br.ReadString('\n')
					ev.WriteString(line)
					if err != nil {
						w.saw.text(ev.String())
						done <- err
						return
					}
				}
				w.saw.text(ev.String())
				first <- ev.String()
				rest, err := io.ReadAll(br)
				w.saw.response(resp, rest)
				if err == nil && string(rest) != "data: second\n\n" {
					err = fmt.Errorf("rest of the stream %q", rest)
				}
				done <- err
			}()
			// Liveness, not speed: the bound is far above any delay a
			// working proxy adds, and the origin holds the second event
			// back until the first has arrived.
			select {
			case ev := <-first:
				if !strings.HasPrefix(ev, "data: first") {
					t.Errorf("first event %q", ev)
				}
				if strings.Contains(ev, w.tok) {
					t.Error("the first event carried the secret to the client")
				}
			case err := <-done:
				t.Fatalf("stream ended before the first event: %v", err)
			case <-time.After(10 * time.Second):
				t.Error("the first event did not reach the client while the origin held the stream open")
			}
			select {
			case w.api.release <- struct{}{}:
			case <-time.After(e2eTimeout):
				t.Error("the origin never waited to send the second event")
			}
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("stream: %v", err)
				}
			case <-time.After(e2eTimeout):
				t.Fatal("stream did not end")
			}
		})
	}
}
