package main

// End-to-end acceptance tests for limits, hot reload, metrics, readiness and
// graceful shutdown (issue "Limits, hot reload and operations"), through the
// real `sluice serve` binary. Every load loop here is bounded in count and in
// time, every address is on loopback, and figures (byte rates) are checked
// against the configured setting, never against a wall-clock budget for
// sluice's own speed.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/audit"
)

// ---------------------------------------------------------------------------
// Helpers of their own for these tests (the shared ones live in
// e2e_helpers_test.go). None of them calls t.Fatal, so they can run on
// worker goroutines.

// opsHeader is the server/audit part every ops config starts with.
const opsHeader = `version: 1
server:
  read_header_timeout: 10s
  idle_timeout: 30s
  dial_timeout: 3s
  upstream_timeout: 10s
  shutdown_timeout: %s
audit:
  fsync: never
`

// opsCred renders a static credential for a tenant's credentials list.
func opsCred(c testCredential) string {
	return fmt.Sprintf("    credentials:\n      - name: %s\n        hash: %s\n", c.Name, c.Hash)
}

// opsOrigin is an HTTP(S) origin with the endpoints these tests need:
//
//	/slow?ms=N    waits N ms (counted in InFlight), then "slow done"
//	/big?n=N      N bytes of body with a Content-Length
//	/upload       reads the body and answers its length
//	anything else "ok <path>", remembering the Authorization header
type opsOrigin struct {
	Addr string
	Port int

	requests atomic.Int64
	inflight atomic.Int64
	mu       sync.Mutex
	auth     []string
	srv      *http.Server
}

func startOpsOrigin(t *testing.T, tlsCfg *tls.Config) *opsOrigin {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &opsOrigin{Addr: ln.Addr().String(), Port: ln.Addr().(*net.TCPAddr).Port}
	if tlsCfg != nil {
		ln = tls.NewListener(ln, tlsCfg)
	}
	o.srv = &http.Server{Handler: http.HandlerFunc(o.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = o.srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := o.srv.Shutdown(ctx); err != nil {
			_ = o.srv.Close()
		}
	})
	return o
}

func (o *opsOrigin) serve(w http.ResponseWriter, r *http.Request) {
	o.requests.Add(1)
	switch r.URL.Path {
	case "/slow":
		o.inflight.Add(1)
		defer o.inflight.Add(-1)
		ms, _ := strconv.Atoi(r.URL.Query().Get("ms"))
		select {
		case <-time.After(time.Duration(ms) * time.Millisecond):
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "slow done\n")
	case "/big":
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		w.Header().Set("Content-Length", strconv.Itoa(n))
		chunk := bytes.Repeat([]byte("x"), 32<<10)
		for n > 0 {
			k := min(n, len(chunk))
			if _, err := w.Write(chunk[:k]); err != nil {
				return
			}
			n -= k
		}
	case "/upload":
		n, _ := io.Copy(io.Discard, r.Body)
		_, _ = fmt.Fprintf(w, "%d\n", n)
	default:
		o.mu.Lock()
		o.auth = append(o.auth, r.Header.Get("Authorization"))
		o.mu.Unlock()
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
		_, _ = fmt.Fprintf(w, "ok %s\n", r.URL.Path)
	}
}

// Authorizations returns the Authorization headers seen on default paths.
func (o *opsOrigin) Authorizations() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.auth...)
}

// opsResult is one exchange as a client saw it.
type opsResult struct {
	Status int
	Header http.Header
	Body   []byte
	Err    error
}

// opsDo sends req with cl and reads the whole body; it never fails the test.
func opsDo(cl *http.Client, req *http.Request) opsResult {
	resp, err := cl.Do(req)
	if err != nil {
		return opsResult{Err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return opsResult{Status: resp.StatusCode, Header: resp.Header, Body: body, Err: err}
}

func opsGet(cl *http.Client, rawURL string) opsResult {
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	if err != nil {
		return opsResult{Err: err}
	}
	return opsDo(cl, req)
}

func (r opsResult) String() string {
	if r.Err != nil {
		return "error: " + r.Err.Error()
	}
	return fmt.Sprintf("%d %s %.200q", r.Status, r.Header.Get("X-Sluice-Reason"), r.Body)
}

// opsClient is a proxied client that may keep its connection alive.
func opsClient(p *sluiceProc, c testCredential, tlsCfg *tls.Config) *http.Client {
	cl := p.Client(c, tlsCfg)
	return cl
}

// opsConnect sends a CONNECT for target and returns the tunnel on 200. It
// reads the response head byte by byte so no tunnel bytes are swallowed.
func opsConnect(proxyAddr string, c testCredential, target string) (net.Conn, *http.Response, []byte, error) {
	conn, err := net.DialTimeout("tcp", proxyAddr, 5*time.Second)
	if err != nil {
		return nil, nil, nil, err
	}
	_ = conn.SetDeadline(time.Now().Add(e2eTimeout))
	head := fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\n\r\n", target, target, proxyAuthorization(c))
	if _, err := io.WriteString(conn, head); err != nil {
		conn.Close()
		return nil, nil, nil, err
	}
	resp, err := http.ReadResponse(bufio.NewReaderSize(&oneByteReader{conn}, 16), &http.Request{Method: http.MethodConnect})
	if err != nil {
		conn.Close()
		return nil, nil, nil, err
	}
	if resp.StatusCode == http.StatusOK {
		_ = conn.SetDeadline(time.Time{})
		return conn, resp, nil, nil
	}
	body, _ := io.ReadAll(resp.Body)
	conn.Close()
	return nil, resp, body, nil
}

// opsTLS starts TLS for serverName over an established tunnel.
func opsTLS(conn net.Conn, cfg *tls.Config) (*tls.Conn, error) {
	tc := tls.Client(conn, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	if err := tc.HandshakeContext(ctx); err != nil {
		return nil, err
	}
	return tc, nil
}

// opsGetInside sends one keep-alive GET over an established TLS session and
// reads the response.
func opsGetInside(tc *tls.Conn, br *bufio.Reader, host, path string) opsResult {
	_ = tc.SetDeadline(time.Now().Add(e2eTimeout))
	if _, err := fmt.Fprintf(tc, "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", path, host); err != nil {
		return opsResult{Err: err}
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return opsResult{Err: err}
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	return opsResult{Status: resp.StatusCode, Header: resp.Header, Body: body, Err: err}
}

// ---------------------------------------------------------------------------
// Metrics: a small parser for the Prometheus text format.

// opsMetrics maps "name{k="v",...}" (labels sorted) to the sample value.
type opsMetrics struct {
	samples map[string]float64
	text    string
}

func opsMetricKey(name string, kv ...string) string {
	type pair struct{ k, v string }
	var ps []pair
	for i := 0; i+1 < len(kv); i += 2 {
		ps = append(ps, pair{kv[i], kv[i+1]})
	}
	sort.Slice(ps, func(i, j int) bool { return ps[i].k < ps[j].k })
	var b strings.Builder
	b.WriteString(name)
	if len(ps) > 0 {
		b.WriteByte('{')
		for i, p := range ps {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, "%s=%q", p.k, p.v)
		}
		b.WriteByte('}')
	}
	return b.String()
}

// opsParseMetrics reads the text exposition format (no timestamps, as
// client_golang writes it).
func opsParseMetrics(text string) (opsMetrics, error) {
	m := opsMetrics{samples: make(map[string]float64), text: text}
	for _, line := range strings.Split(text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, rest := line, ""
		var kv []string
		if i := strings.IndexByte(line, '{'); i >= 0 {
			name = line[:i]
			j := i + 1
			for {
				if j >= len(line) {
					return m, fmt.Errorf("unterminated labels: %q", line)
				}
				if line[j] == '}' {
					j++
					break
				}
				if line[j] == ',' {
					j++
					continue
				}
				eq := strings.IndexByte(line[j:], '=')
				if eq < 0 || j+eq+1 >= len(line) || line[j+eq+1] != '"' {
					return m, fmt.Errorf("bad label in %q", line)
				}
				key := line[j : j+eq]
				j += eq + 2
				var v strings.Builder
				for j < len(line) && line[j] != '"' {
					if line[j] == '\\' && j+1 < len(line) {
						j++
						switch line[j] {
						case 'n':
							v.WriteByte('\n')
						default:
							v.WriteByte(line[j])
						}
					} else {
						v.WriteByte(line[j])
					}
					j++
				}
				j++ // closing quote
				kv = append(kv, key, v.String())
			}
			rest = strings.TrimSpace(line[j:])
		} else {
			sp := strings.IndexByte(line, ' ')
			if sp < 0 {
				return m, fmt.Errorf("no value in %q", line)
			}
			name, rest = line[:sp], strings.TrimSpace(line[sp+1:])
		}
		f, err := strconv.ParseFloat(strings.Fields(rest)[0], 64)
		if err != nil {
			return m, fmt.Errorf("value in %q: %v", line, err)
		}
		m.samples[opsMetricKey(name, kv...)] = f
	}
	return m, nil
}

// Get returns the sample for name and labels (exact label set), 0 if absent.
func (m opsMetrics) Get(name string, kv ...string) float64 {
	return m.samples[opsMetricKey(name, kv...)]
}

// Has says whether a sample with exactly these labels exists.
func (m opsMetrics) Has(name string, kv ...string) bool {
	_, ok := m.samples[opsMetricKey(name, kv...)]
	return ok
}

// LabelValues returns every value label takes in samples of metrics whose
// name starts with prefix.
func (m opsMetrics) LabelValues(prefix, label string) map[string]bool {
	out := map[string]bool{}
	needle := label + "=\""
	for k := range m.samples {
		if !strings.HasPrefix(k, prefix) {
			continue
		}
		for _, part := range strings.Split(strings.TrimSuffix(k[strings.IndexByte(k+"{", '{'):], "}"), ",") {
			part = strings.TrimPrefix(part, "{")
			if v, ok := strings.CutPrefix(part, needle); ok {
				if uq, err := strconv.Unquote("\"" + v); err == nil {
					out[uq] = true
				}
			}
		}
	}
	return out
}

// opsScrape fetches /metrics over HTTP from the admin listener.
func opsScrape(t *testing.T, p *sluiceProc) opsMetrics {
	t.Helper()
	status, body, err := opsAdminGet(p, "/metrics")
	if err != nil || status != http.StatusOK {
		t.Fatalf("GET /metrics: %d %v", status, err)
	}
	m, err := opsParseMetrics(body)
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	return m
}

func opsAdminGet(p *sluiceProc, path string) (int, string, error) {
	cl := &http.Client{Timeout: e2eTimeout, Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	resp, err := cl.Get("http://" + p.AdminAddr + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// opsWaitMetrics polls /metrics (bounded) until cond holds and returns that scrape.
func opsWaitMetrics(t *testing.T, p *sluiceProc, what string, cond func(opsMetrics) bool) opsMetrics {
	t.Helper()
	deadline := time.Now().Add(e2eTimeout)
	for {
		m := opsScrape(t, p)
		if cond(m) {
			return m
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for metrics: %s", e2eTimeout, what)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

func opsReloads(m opsMetrics, result string) float64 {
	return m.Get("sluice_config_reloads_total", "result", result)
}

// opsInitCA runs `sluice ca init` and returns the CA files and a pool that
// trusts the CA (what a sandbox installs).
func opsInitCA(t *testing.T, env *e2eEnv) (certPath, keyPath string, pool *x509.CertPool) {
	t.Helper()
	certPath, keyPath = env.Path("ca.pem"), env.Path("ca.key")
	if _, stderr, code := runSluice(t, "", "ca", "init", "--cert", certPath, "--key", keyPath); code != 0 {
		t.Fatalf("sluice ca init: exit %d: %s", code, stderr)
	}
	raw, err := os.ReadFile(certPath)
	if err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	if !pool.AppendCertsFromPEM(raw) {
		t.Fatal("ca init wrote no PEM certificate")
	}
	return certPath, keyPath, pool
}

func opsRandomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// opsRecordsWhere filters audit records.
func opsRecordsWhere(recs []audit.Record, keep func(audit.Record) bool) []audit.Record {
	var out []audit.Record
	for _, r := range recs {
		if keep(r) {
			out = append(out, r)
		}
	}
	return out
}

// parallel runs n copies of f released together and returns their results.
func opsParallel(n int, f func(i int) opsResult) []opsResult {
	out := make([]opsResult, n)
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	ready.Add(n)
	done.Add(n)
	for i := range n {
		go func() {
			defer done.Done()
			ready.Done()
			<-start
			out[i] = f(i)
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()
	return out
}

// retryAfter parses a Retry-After header in seconds (-1 if absent or bad).
func opsRetryAfter(h http.Header) int {
	n, err := strconv.Atoi(h.Get("Retry-After"))
	if err != nil {
		return -1
	}
	return n
}

var _ = url.URL{}
var _ = errors.New
var _ = syscall.SIGTERM

// ---------------------------------------------------------------------------
// Limits.

func TestE2EOpsRequestLimits(t *testing.T) {
	env := newE2EEnv(t)
	dns := startTestDNS(t, map[string][]string{
		"burst.test": {"127.0.0.1"}, "refill.test": {"127.0.0.1"},
		"limited.test": {"127.0.0.1"}, "free.test": {"127.0.0.1"},
	})
	origin := startOpsOrigin(t, nil)
	burst := env.StaticCredential("burst", "burst-ci")
	refill := env.StaticCredential("refill", "refill-ci")
	ruled := env.StaticCredential("ruled", "ruled-ci")
	P := origin.Port
	// burst refills one token every 10 s, so the tokens a test spends are
	// exactly the configured burst; refill refills fast enough to check
	// that Retry-After is honest.
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`limits:
  auth_failures_per_minute: 10000
tenants:
  - id: burst
%[1]s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: burst-any
        host: burst.test
        ports: [%[4]d]
    limits: {requests_per_second: 0.1, burst: 10}
  - id: refill
%[2]s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: refill-any
        host: refill.test
        ports: [%[4]d]
    limits: {requests_per_second: 2, burst: 3}
  - id: ruled
%[3]s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: ruled-limited
        host: limited.test
        ports: [%[4]d]
        limits: {requests_per_second: 0.1, burst: 3}
      - id: ruled-free
        host: free.test
        ports: [%[4]d]
`, opsCred(burst), opsCred(refill), opsCred(ruled), P)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr})

	t.Run("burst under concurrency", func(t *testing.T) {
		const clients, want = 24, 10
		mark := p.AuditMark(t)
		before := origin.requests.Load()
		res := opsParallel(clients, func(int) opsResult {
			cl := p.Client(burst, nil) // one connection per client
			defer cl.CloseIdleConnections()
			return opsGet(cl, fmt.Sprintf("http://burst.test:%d/b", P))
		})
		ok, limited := 0, 0
		for _, r := range res {
			switch {
			case r.Err != nil:
				t.Errorf("request failed: %v", r.Err)
			case r.Status == http.StatusOK:
				ok++
			case r.Status == http.StatusTooManyRequests:
				limited++
				resp := &http.Response{StatusCode: r.Status, Header: r.Header}
				d := checkDenial(t, "rate limited", resp, r.Body, http.StatusTooManyRequests, "rate_limited")
				if d.Rule != "burst-any" {
					t.Errorf("denial names rule %q, want burst-any", d.Rule)
				}
				// The next token is 10 s away less the time the burst took:
				// Retry-After rounds that up.
				if ra := opsRetryAfter(r.Header); ra < 8 || ra > 10 {
					t.Errorf("Retry-After %q, want 8..10 seconds at 0.1 requests/s", r.Header.Get("Retry-After"))
				}
			default:
				t.Errorf("unexpected response %s", r)
			}
		}
		if ok != want || limited != clients-want {
			t.Errorf("%d clients at once: %d allowed, %d limited; want exactly %d allowed (the burst)", clients, ok, limited, want)
		}
		if got := origin.requests.Load() - before; got != want {
			t.Errorf("origin received %d requests, want %d", got, want)
		}
		recs := p.WaitRecords(t, mark, clients)
		allow := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Decision == "allow" && r.Status == 200 })
		deny := opsRecordsWhere(recs, func(r audit.Record) bool {
			return r.Decision == "deny" && r.Reason == "rate_limited" && r.Status == 429 && r.Rule == "burst-any"
		})
		if len(recs) != clients || len(allow) != want || len(deny) != clients-want {
			t.Errorf("audit: %d records (%d allow, %d rate_limited), want %d/%d/%d:\n%s",
				len(recs), len(allow), len(deny), clients, want, clients-want, describeRecords(recs))
		}
		m := opsScrape(t, p)
		if got := m.Get("sluice_limit_refusals_total", "tenant", "burst", "limit", "rate"); got != clients-want {
			t.Errorf("sluice_limit_refusals_total{burst,rate} = %v, want %d", got, clients-want)
		}
		if got := m.Get("sluice_requests_total", "tenant", "burst", "decision", "deny", "reason", "rate_limited"); got != clients-want {
			t.Errorf("sluice_requests_total{burst,deny,rate_limited} = %v, want %d", got, clients-want)
		}
		if got := m.Get("sluice_requests_total", "tenant", "burst", "decision", "allow", "reason", "allowed"); got != want {
			t.Errorf("sluice_requests_total{burst,allow,allowed} = %v, want %d", got, want)
		}
	})

	t.Run("Retry-After is enough", func(t *testing.T) {
		cl := p.Client(refill, nil)
		defer cl.CloseIdleConnections()
		u := fmt.Sprintf("http://refill.test:%d/r", P)
		for i := range 3 {
			if r := opsGet(cl, u); r.Status != http.StatusOK {
				t.Fatalf("request %d within the burst: %s", i+1, r)
			}
		}
		r := opsGet(cl, u)
		if r.Status != http.StatusTooManyRequests {
			t.Fatalf("request after the burst: %s", r)
		}
		ra := opsRetryAfter(r.Header)
		// At 2 requests/s the next token is at most 0.5 s away.
		if ra != 1 {
			t.Fatalf("Retry-After %q, want 1", r.Header.Get("Retry-After"))
		}
		time.Sleep(time.Duration(ra) * time.Second)
		if r := opsGet(cl, u); r.Status != http.StatusOK {
			t.Errorf("after waiting Retry-After: %s", r)
		}
	})

	t.Run("rule limit", func(t *testing.T) {
		cl := p.Client(ruled, nil)
		defer cl.CloseIdleConnections()
		lim := fmt.Sprintf("http://limited.test:%d/x", P)
		for i := range 3 {
			if r := opsGet(cl, lim); r.Status != http.StatusOK {
				t.Fatalf("request %d within the rule's burst: %s", i+1, r)
			}
		}
		r := opsGet(cl, lim)
		d := checkDenial(t, "rule limit", &http.Response{StatusCode: r.Status, Header: r.Header}, r.Body, http.StatusTooManyRequests, "rate_limited")
		if d.Rule != "ruled-limited" {
			t.Errorf("denial names rule %q", d.Rule)
		}
		// Another rule of the same tenant has its own (unlimited) budget.
		for i := range 5 {
			if r := opsGet(cl, fmt.Sprintf("http://free.test:%d/y", P)); r.Status != http.StatusOK {
				t.Fatalf("request %d to the unlimited rule: %s", i+1, r)
			}
		}
	})
}

func TestE2EOpsTunnelLimit(t *testing.T) {
	env := newE2EEnv(t)
	pki := newTestPKI(t, env.Dir)
	dns := startTestDNS(t, map[string][]string{"tls.test": {"127.0.0.1"}})
	origin := startOpsOrigin(t, pki.ServerConfig(t, "tls.test"))
	cred := env.StaticCredential("tun", "tun-ci")
	const maxTunnels = 3
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`tenants:
  - id: tun
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: tun-tls
        host: tls.test
        ports: [%d]
    limits: {max_tunnels: %d}
`, opsCred(cred), origin.Port, maxTunnels)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr, UpstreamCA: pki.CAFile})
	target := fmt.Sprintf("tls.test:%d", origin.Port)
	mark := p.AuditMark(t)

	const attempts = 8
	type attempt struct {
		conn   net.Conn
		resp   *http.Response
		body   []byte
		err    error
		tls    *tls.Conn
		tlsErr error
	}
	got := make([]attempt, attempts)
	opsParallel(attempts, func(i int) opsResult {
		a := &got[i]
		a.conn, a.resp, a.body, a.err = opsConnect(p.ProxyAddr, cred, target)
		if a.conn != nil {
			// Start TLS at once: a spliced tunnel that sends no ClientHello
			// is closed after read_header_timeout.
			a.tls, a.tlsErr = opsTLS(a.conn, pki.ClientConfig("tls.test"))
		}
		return opsResult{}
	})
	var open []*tls.Conn
	refused := 0
	for _, a := range got {
		switch {
		case a.err != nil:
			t.Errorf("CONNECT: %v", a.err)
		case a.conn != nil:
			if a.tlsErr != nil {
				t.Errorf("TLS through an accepted tunnel: %v", a.tlsErr)
				continue
			}
			open = append(open, a.tls)
		default:
			refused++
			checkDenial(t, "CONNECT over the cap", a.resp, a.body, http.StatusTooManyRequests, "tunnel_limit")
			if a.resp.Header.Get("Retry-After") != "1" {
				t.Errorf("tunnel_limit Retry-After %q, want 1", a.resp.Header.Get("Retry-After"))
			}
		}
	}
	t.Cleanup(func() {
		for _, c := range open {
			c.Close()
		}
	})
	if len(open) != maxTunnels || refused != attempts-maxTunnels {
		t.Fatalf("%d CONNECTs at once with max_tunnels %d: %d open, %d refused", attempts, maxTunnels, len(open), refused)
	}
	// The open tunnels work.
	for i, tc := range open {
		if r := opsGetInside(tc, bufio.NewReader(tc), "tls.test", "/in"); r.Status != http.StatusOK {
			t.Errorf("request through tunnel %d: %s", i, r)
		}
	}
	m := opsScrape(t, p)
	if got := m.Get("sluice_tunnels_active"); got != maxTunnels {
		t.Errorf("sluice_tunnels_active = %v, want %d", got, maxTunnels)
	}
	if got := m.Get("sluice_limit_refusals_total", "tenant", "tun", "limit", "tunnel"); got != attempts-maxTunnels {
		t.Errorf("sluice_limit_refusals_total{tun,tunnel} = %v, want %d", got, attempts-maxTunnels)
	}
	// Still full: the next CONNECT is refused.
	if c, resp, body, err := opsConnect(p.ProxyAddr, cred, target); err != nil || c != nil {
		t.Fatalf("CONNECT with %d tunnels open: conn=%v err=%v", maxTunnels, c != nil, err)
	} else {
		checkDenial(t, "CONNECT at the cap", resp, body, http.StatusTooManyRequests, "tunnel_limit")
	}

	// Closing one frees its slot.
	open[0].Close()
	opsWaitMetrics(t, p, "tunnels_active back to 2", func(m opsMetrics) bool { return m.Get("sluice_tunnels_active") == maxTunnels-1 })
	c, resp, body, err := opsConnect(p.ProxyAddr, cred, target)
	if err != nil || c == nil {
		t.Fatalf("CONNECT after a tunnel closed: err=%v resp=%v %.200q", err, resp != nil && resp.StatusCode != 0, body)
	}
	tc, err := opsTLS(c, pki.ClientConfig("tls.test"))
	if err != nil {
		t.Fatal(err)
	}
	open[0] = tc
	for _, c := range open {
		c.Close()
	}
	opsWaitMetrics(t, p, "tunnels_active back to 0", func(m opsMetrics) bool { return m.Get("sluice_tunnels_active") == 0 })

	recs := p.WaitRecords(t, mark, attempts+2) // every attempt, the refusal at the cap, the tunnel after it
	tunnels := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Kind == audit.KindTunnel && r.Decision == "allow" })
	capped := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Reason == "tunnel_limit" && r.Status == 429 })
	if len(tunnels) != maxTunnels+1 || len(capped) != attempts-maxTunnels+1 {
		t.Errorf("audit: %d tunnel records, %d tunnel_limit refusals; want %d and %d:\n%s",
			len(tunnels), len(capped), maxTunnels+1, attempts-maxTunnels+1, describeRecords(recs))
	}
	for _, r := range tunnels {
		if r.BytesIn == 0 || r.BytesOut == 0 {
			t.Errorf("tunnel record %s counts in=%d out=%d", r.ID, r.BytesIn, r.BytesOut)
		}
	}
}

func TestE2EOpsByteRate(t *testing.T) {
	env := newE2EEnv(t)
	pki := newTestPKI(t, env.Dir)
	dns := startTestDNS(t, map[string][]string{"bytes.test": {"127.0.0.1"}})
	tlsOrigin := startOpsOrigin(t, pki.ServerConfig(t, "bytes.test"))
	plain := startOpsOrigin(t, nil)
	cred := env.StaticCredential("bytes", "bytes-ci")
	const rate = 256 << 10 // bytes per second, each direction
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`tenants:
  - id: bytes
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: bytes-any
        host: bytes.test
        ports: [%d, %d]
    limits: {egress_bytes_per_second: 256KiB, ingress_bytes_per_second: 256KiB}
`, opsCred(cred), tlsOrigin.Port, plain.Port)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr, UpstreamCA: pki.CAFile})

	// About 2.5 s of transfer each way: long enough that the first burst
	// (a quarter of a second's worth) moves the average by about 10%.
	const size = 640 << 10
	within := func(what string, n int64, d time.Duration) {
		t.Helper()
		got := float64(n) / d.Seconds()
		t.Logf("%s: %d bytes in %v = %.0f KiB/s (limit %d KiB/s)", what, n, d.Round(time.Millisecond), got/1024, rate>>10)
		if got < 0.8*rate || got > 1.2*rate {
			t.Errorf("%s: %.0f KiB/s is not within 20%% of %d KiB/s", what, got/1024, rate>>10)
		}
	}

	t.Run("download through a spliced tunnel", func(t *testing.T) {
		conn, resp, body, err := opsConnect(p.ProxyAddr, cred, fmt.Sprintf("bytes.test:%d", tlsOrigin.Port))
		if err != nil || conn == nil {
			t.Fatalf("CONNECT: %v %v %.200q", err, resp != nil, body)
		}
		tc, err := opsTLS(conn, pki.ClientConfig("bytes.test"))
		if err != nil {
			t.Fatal(err)
		}
		defer tc.Close()
		start := time.Now()
		if _, err := fmt.Fprintf(tc, "GET /big?n=%d HTTP/1.1\r\nHost: bytes.test\r\nConnection: close\r\n\r\n", size); err != nil {
			t.Fatal(err)
		}
		r, err := http.ReadResponse(bufio.NewReader(tc), nil)
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.Copy(io.Discard, r.Body)
		elapsed := time.Since(start)
		if err != nil || n != size {
			t.Fatalf("download: %d bytes, %v", n, err)
		}
		within("ingress (tunnel download)", n, elapsed)
	})

	t.Run("upload body", func(t *testing.T) {
		cl := p.Client(cred, nil)
		defer cl.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, fmt.Sprintf("http://bytes.test:%d/upload", plain.Port),
			bytes.NewReader(bytes.Repeat([]byte("u"), size)))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		r := opsDo(cl, req)
		elapsed := time.Since(start)
		if r.Status != http.StatusOK || strings.TrimSpace(string(r.Body)) != strconv.Itoa(size) {
			t.Fatalf("upload: %s", r)
		}
		within("egress (upload body)", size, elapsed)
	})

	m := opsScrape(t, p)
	if got := m.Get("sluice_bytes_total", "tenant", "bytes", "direction", "ingress"); got < size {
		t.Errorf("sluice_bytes_total{bytes,ingress} = %v, want at least %d", got, size)
	}
	if got := m.Get("sluice_bytes_total", "tenant", "bytes", "direction", "egress"); got < size {
		t.Errorf("sluice_bytes_total{bytes,egress} = %v, want at least %d", got, size)
	}
}

func TestE2EOpsSecretBudget(t *testing.T) {
	env := newE2EEnv(t)
	pki := newTestPKI(t, env.Dir)
	caCert, caKey, sluiceCA := opsInitCA(t, env)
	dns := startTestDNS(t, map[string][]string{
		"a.secret.test": {"127.0.0.1"}, "b.secret.test": {"127.0.0.1"}, "plain.secret.test": {"127.0.0.1"},
	})
	// Not tracked by env: this origin is meant to receive the secret.
	origin := startOpsOrigin(t, pki.ServerConfig(t, "a.secret.test", "b.secret.test", "plain.secret.test"))
	secret := "sk-budget-" + opsRandomHex(t, 16)
	env.MarkSecret(secret)
	if err := os.WriteFile(env.Path("secrets.yaml"), []byte("api: "+secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cred := env.StaticCredential("acme", "acme-ci")
	const budget = 4
	P := origin.Port
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`ca:
  cert: %[1]s
  key: %[2]s
broker:
  file:
    path: secrets.yaml
secrets:
  - name: api
    source: file
    hosts: [a.secret.test, b.secret.test]
    limits: {requests_per_second: 0.1, burst: %[5]d}
tenants:
  - id: acme
%[3]s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: acme-a
        host: a.secret.test
        ports: [%[4]d]
        inject:
          - header: Authorization
            value: "Bearer ${secret:api}"
      - id: acme-b
        host: b.secret.test
        ports: [%[4]d]
        inject:
          - header: Authorization
            value: "Bearer ${secret:api}"
      - id: acme-plain
        host: plain.secret.test
        ports: [%[4]d]
        inspect: true
`, caCert, caKey, opsCred(cred), P, budget)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr, UpstreamCA: pki.CAFile})
	clientTLS := &tls.Config{RootCAs: sluiceCA, MinVersion: tls.VersionTLS12}
	u := func(host string) string { return fmt.Sprintf("https://%s:%d/s", host, P) }
	mark := p.AuditMark(t)

	// Four requests, spread over two rules and three tunnels (c1 carries
	// two), spend the secret's whole budget ...
	c1 := p.Client(cred, clientTLS)
	defer c1.CloseIdleConnections()
	fresh := func(host string) opsResult {
		cl := p.Client(cred, clientTLS)
		defer cl.CloseIdleConnections()
		return opsGet(cl, u(host))
	}
	steps := []struct {
		name string
		do   func() opsResult
		want int
	}{
		{"rule a, tunnel 1", func() opsResult { return opsGet(c1, u("a.secret.test")) }, 200},
		{"rule a, tunnel 1 again", func() opsResult { return opsGet(c1, u("a.secret.test")) }, 200},
		{"rule b, tunnel 2", func() opsResult { return fresh("b.secret.test") }, 200},
		{"rule a, tunnel 3", func() opsResult { return fresh("a.secret.test") }, 200},
		// ... so both rules are refused now, in new tunnels and old ones.
		{"rule b, tunnel 4", func() opsResult { return fresh("b.secret.test") }, 429},
		{"rule a, tunnel 1 after the budget", func() opsResult { return opsGet(c1, u("a.secret.test")) }, 429},
		{"rule b, tunnel 5", func() opsResult { return fresh("b.secret.test") }, 429},
	}
	for _, s := range steps {
		r := s.do()
		if r.Err != nil {
			t.Fatalf("%s: %v", s.name, r.Err)
		}
		if s.want == 200 {
			if r.Status != 200 {
				t.Errorf("%s: %s", s.name, r)
			}
			continue
		}
		checkDenial(t, s.name, &http.Response{StatusCode: r.Status, Header: r.Header}, r.Body, http.StatusTooManyRequests, "rate_limited")
		if ra := opsRetryAfter(r.Header); ra < 1 || ra > 10 {
			t.Errorf("%s: Retry-After %q, want 1..10", s.name, r.Header.Get("Retry-After"))
		}
	}
	// The tenant itself is not limited: a rule without the secret still works.
	for i := range 3 {
		if r := fresh("plain.secret.test"); r.Status != 200 {
			t.Errorf("request %d to a rule without the secret: %s", i+1, r)
		}
	}
	auths := origin.Authorizations()
	withSecret := 0
	for _, a := range auths {
		if a == "Bearer "+secret {
			withSecret++
		} else if a != "" {
			t.Errorf("origin saw an unexpected Authorization header (length %d)", len(a))
		}
	}
	if withSecret != budget {
		t.Errorf("origin received %d requests carrying the secret, want exactly the budget %d", withSecret, budget)
	}
	recs := p.WaitRecords(t, mark, len(steps)+3)
	inner := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Kind == audit.KindRequest && r.Intercepted })
	allowed := opsRecordsWhere(inner, func(r audit.Record) bool {
		return r.Decision == "allow" && len(r.Secrets) == 1 && r.Secrets[0] == "api"
	})
	limited := opsRecordsWhere(inner, func(r audit.Record) bool { return r.Reason == "rate_limited" && r.Status == 429 })
	if len(allowed) != budget || len(limited) != 3 {
		t.Errorf("audit: %d allowed requests naming secret api, %d rate_limited; want %d and 3:\n%s",
			len(allowed), len(limited), budget, describeRecords(recs))
	}
	m := opsScrape(t, p)
	if got := m.Get("sluice_limit_refusals_total", "tenant", "acme", "limit", "rate"); got != 3 {
		t.Errorf("sluice_limit_refusals_total{acme,rate} = %v, want 3", got)
	}
	if strings.Contains(m.text, secret) {
		t.Error("/metrics contains the secret value")
	}
}

func TestE2EOpsAuthThrottle(t *testing.T) {
	env := newE2EEnv(t)
	dns := startTestDNS(t, map[string][]string{"ok.test": {"127.0.0.1"}})
	origin := startOpsOrigin(t, nil)
	good := env.StaticCredential("acme", "acme-ci")
	bad := env.Credential("acme", "wrong-"+opsRandomHex(t, 16))
	const perMinute = 5
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`limits:
  auth_failures_per_minute: %d
tenants:
  - id: acme
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: acme-ok
        host: ok.test
        ports: [%d]
`, perMinute, opsCred(good), origin.Port)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr})
	target := fmt.Sprintf("http://ok.test:%d/", origin.Port)
	mark := p.AuditMark(t)

	// from returns a client whose connections come from source (a loopback
	// address): the throttle is per source address.
	from := func(c testCredential, source string) *http.Client {
		cl := p.Client(c, nil)
		d := &net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(source)}}
		cl.Transport.(*http.Transport).DialContext = d.DialContext
		return cl
	}
	badA := from(bad, "127.0.0.1")
	defer badA.CloseIdleConnections()
	for i := range perMinute {
		r := opsGet(badA, target)
		if r.Status != http.StatusProxyAuthRequired || r.Header.Get("X-Sluice-Reason") != "auth_invalid" {
			t.Fatalf("failure %d of %d: %s", i+1, perMinute, r)
		}
	}
	r := opsGet(badA, target)
	checkDenial(t, "failure over the limit", &http.Response{StatusCode: r.Status, Header: r.Header}, r.Body, http.StatusProxyAuthRequired, "auth_throttled")
	if r.Header.Get("Proxy-Authenticate") == "" {
		t.Error("throttled 407 without Proxy-Authenticate")
	}
	// Throttled means the credential is not even checked: a good one from
	// the same address is refused too ...
	goodA := from(good, "127.0.0.1")
	defer goodA.CloseIdleConnections()
	if r := opsGet(goodA, target); r.Header.Get("X-Sluice-Reason") != "auth_throttled" {
		t.Errorf("good credential from the throttled address: %s", r)
	}
	// ... while another source address is not affected.
	goodB := from(good, "127.0.0.2")
	defer goodB.CloseIdleConnections()
	if r := opsGet(goodB, target); r.Status != http.StatusOK {
		t.Errorf("good credential from another address: %s", r)
	}
	recs := p.WaitRecords(t, mark, perMinute+3)
	throttled := opsRecordsWhere(recs, func(r audit.Record) bool {
		return r.Kind == audit.KindAuthFailure && r.Reason == "auth_throttled" && r.Status == 407 && strings.HasPrefix(r.Client, "127.0.0.1:")
	})
	if len(throttled) != 2 {
		t.Errorf("audit: %d auth_throttled records from 127.0.0.1, want 2:\n%s", len(throttled), describeRecords(recs))
	}
	m := opsScrape(t, p)
	if got := m.Get("sluice_requests_total", "tenant", "unknown", "decision", "deny", "reason", "auth_throttled"); got != 2 {
		t.Errorf("sluice_requests_total{unknown,deny,auth_throttled} = %v, want 2", got)
	}
}
