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
			if r.Status != 200 || string(r.Body) != "ok /s\n" {
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

// ---------------------------------------------------------------------------
// Hot reload.

// reloadConfig is a valid policy: always.test is allowed in every version,
// <version>-only.test only in that version.
func reloadConfig(version string, cred testCredential, port int, cidrs string, extra string) string {
	return fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`limits:
  auth_failures_per_minute: 100000
tenants:
  - id: acme
%[1]s    allow_private_cidrs: [%[4]s]
    allow:
      - id: always
        host: always.test
        ports: [%[2]d]
      - id: only-%[3]s
        host: %[3]s-only.test
        ports: [%[2]d]
%[5]s`, opsCred(cred), port, version, cidrs, extra)
}

// reloadOp is one rewrite of the config file.
type reloadOp struct {
	kind    string // valid, syntax, unknown-key, bad-cidr, half, delete-recreate, rename, rename-broken
	version string // the valid version written (valid, half, delete-recreate, rename)
	settle  bool   // wait until sluice has acted on it
}

func TestE2EOpsHotReload(t *testing.T) {
	env := newE2EEnv(t)
	dns := startTestDNS(t, map[string][]string{
		"always.test": {"127.0.0.1"}, "a-only.test": {"127.0.0.1"}, "b-only.test": {"127.0.0.1"}, "broken.test": {"127.0.0.1"},
	})
	origin := startOpsOrigin(t, nil)
	cred := env.StaticCredential("acme", "acme-ci")
	P := origin.Port
	const cidrs = "127.0.0.0/8"
	// Every write is unique (a valid one also allows its own w<i>.test, a
	// broken one carries a comment), so each is really decoded rather than
	// skipped as unchanged, and a settled write can be told from the ones
	// before it.
	mark := func(i int) string {
		return fmt.Sprintf("      - id: mark\n        host: w%d.test\n        ports: [%d]\n", i, P)
	}
	valid := func(v string, i int) string { return reloadConfig(v, cred, P, cidrs, mark(i)) }
	// Each broken version would allow broken.test if it were applied.
	brokenRule := fmt.Sprintf("      - id: broken\n        host: broken.test\n        ports: [%d]\n", P)
	broken := func(kind string, i int) string {
		stamp := fmt.Sprintf("# rewrite %d\n", i)
		switch kind {
		case "syntax", "rename-broken":
			return stamp + reloadConfig("a", cred, P, cidrs, fmt.Sprintf("      - id: broken\n        host: broken.test\n        ports: [%d\n", P))
		case "unknown-key":
			return stamp + reloadConfig("a", cred, P, cidrs, brokenRule+"        hots: [x]\n")
		case "bad-cidr":
			return stamp + reloadConfig("b", cred, P, cidrs+", 10.0.0.0/33", brokenRule)
		}
		t.Fatalf("no broken version %q", kind)
		return ""
	}
	for i := range 101 {
		dns.Set(t, fmt.Sprintf("w%d.test", i), "127.0.0.1")
	}
	p := env.StartSluice(valid("a", 100), sluiceOptions{Resolver: dns.Addr})
	path := p.ConfigPath

	// 100 rewrites: ten cycles of ten. Even cycles wait for sluice to act on
	// most writes (so broken and half-written files are really read); odd
	// cycles write faster than the debounce. Every cycle ends with a valid
	// version in force and then a broken write on top of it.
	pattern := []reloadOp{
		{kind: "valid", version: "a", settle: true},
		{kind: "syntax", settle: true},
		{kind: "valid", version: "b"},
		{kind: "unknown-key"},
		{kind: "half", version: "a", settle: true},
		{kind: "bad-cidr"},
		{kind: "delete-recreate", version: "b", settle: true},
		{kind: "rename", version: "a"},
		{kind: "rename", version: "b", settle: true},
		{kind: "rename-broken", settle: true},
	}
	var ops []reloadOp
	for c := range 10 {
		for i, op := range pattern {
			if c%2 == 1 && i < 8 {
				op.settle = false
			}
			ops = append(ops, op)
		}
	}

	cl := func() *http.Client { return p.Client(cred, nil) }
	u := func(host string) string { return fmt.Sprintf("http://%s:%d/", host, P) }

	// The load: four workers on the host every version allows, one on the
	// host only broken versions allow.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var total, failed, brokenAllowed, brokenProbes atomic.Int64
	var failMu sync.Mutex
	var failures []string
	note := func(s string) {
		failMu.Lock()
		if len(failures) < 10 {
			failures = append(failures, s)
		}
		failMu.Unlock()
	}
	hardStop := time.Now().Add(60 * time.Second)
	for w := range 4 {
		wg.Go(func() {
			c := cl()
			defer c.CloseIdleConnections()
			for i := 0; i < 20000 && time.Now().Before(hardStop); i++ {
				select {
				case <-stop:
					return
				default:
				}
				r := opsGet(c, u("always.test"))
				total.Add(1)
				if r.Err != nil || r.Status != http.StatusOK {
					failed.Add(1)
					note(fmt.Sprintf("worker %d: %s", w, r))
				}
				time.Sleep(3 * time.Millisecond)
			}
		})
	}
	wg.Go(func() {
		c := cl()
		defer c.CloseIdleConnections()
		for i := 0; i < 5000 && time.Now().Before(hardStop); i++ {
			select {
			case <-stop:
				return
			default:
			}
			r := opsGet(c, u("broken.test"))
			brokenProbes.Add(1)
			if r.Err != nil || r.Status != http.StatusForbidden || r.Header.Get("X-Sluice-Reason") != "not_allowlisted" {
				brokenAllowed.Add(1)
				note("broken.test: " + r.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()

	probe := cl()
	defer probe.CloseIdleConnections()
	// inForce waits (bounded) until version v is the policy in force.
	inForce := func(v string, i int) {
		t.Helper()
		other := map[string]string{"a": "b", "b": "a"}[v]
		deadline := time.Now().Add(e2eTimeout)
		for {
			r := opsGet(probe, u(fmt.Sprintf("w%d.test", i)))
			if r.Status == http.StatusOK {
				r = opsGet(probe, u(v+"-only.test"))
			}
			if r.Status == http.StatusOK {
				if r2 := opsGet(probe, u(other+"-only.test")); r2.Status != http.StatusForbidden {
					t.Fatalf("version %s in force but %s-only.test answers %s", v, other, r2)
				}
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("write %d (version %s) never came into force (last probe: %s)", i, v, r)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// failedAfter waits (bounded) until the failed-reload counter passes n.
	failedAfter := func(n float64, what string) {
		t.Helper()
		opsWaitMetrics(t, p, "a failed reload after "+what, func(m opsMetrics) bool { return opsReloads(m, "failed") > n })
	}
	failedNow := func() float64 { return opsReloads(opsScrape(t, p), "failed") }
	writeFile := func(data string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	renameOver := func(data string) {
		t.Helper()
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}

	start := time.Now()
	settledValid, settledBroken := 0, 0
	for i, op := range ops {
		before := 0.0
		if op.settle && op.version == "" {
			before = failedNow()
		}
		switch op.kind {
		case "valid":
			writeFile(valid(op.version, i))
		case "syntax", "unknown-key", "bad-cidr":
			writeFile(broken(op.kind, i))
		case "rename":
			renameOver(valid(op.version, i))
		case "rename-broken":
			renameOver(broken(op.kind, i))
		case "half":
			// A writer that stalls mid-file: the prefix ends inside a key, so
			// it is not valid YAML; settled cycles make sure sluice reads it.
			full := valid(op.version, i)
			cut := strings.Index(full, "allow_private_cidrs") + len("allow_private_ci")
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			n := failedNow()
			if _, err := f.WriteString(full[:cut]); err != nil {
				t.Fatal(err)
			}
			if op.settle {
				failedAfter(n, "a half-written file")
			} else {
				time.Sleep(30 * time.Millisecond)
			}
			if _, err := f.WriteString(full[cut:]); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		case "delete-recreate":
			n := failedNow()
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if op.settle {
				failedAfter(n, "deleting the config")
			} else {
				time.Sleep(30 * time.Millisecond)
			}
			writeFile(valid(op.version, i))
		default:
			t.Fatalf("op %d: unknown kind %q", i, op.kind)
		}
		switch {
		case op.settle && op.version != "":
			inForce(op.version, i)
			settledValid++
		case op.settle:
			failedAfter(before, op.kind)
			settledBroken++
		default:
			time.Sleep(30 * time.Millisecond)
		}
	}
	rewriting := time.Since(start)
	close(stop)
	wg.Wait()

	t.Logf("%d rewrites in %v (%d settled valid, %d settled broken); %d requests to always.test, %d probes of broken.test",
		len(ops), rewriting.Round(time.Millisecond), settledValid, settledBroken, total.Load(), brokenProbes.Load())
	if failed.Load() != 0 || brokenAllowed.Load() != 0 {
		t.Errorf("%d of %d requests to the always-allowed host failed; %d of %d probes of broken.test were not refused; first: %s",
			failed.Load(), total.Load(), brokenAllowed.Load(), brokenProbes.Load(), strings.Join(failures, "; "))
	}
	if total.Load() < 100 || brokenProbes.Load() < 50 {
		t.Errorf("too little load ran alongside the rewrites: %d requests, %d probes", total.Load(), brokenProbes.Load())
	}
	// The last write was broken: the last good version, b (write 98), is in force.
	inForce("b", len(ops)-2)
	if r := opsGet(probe, u("broken.test")); r.Status != http.StatusForbidden {
		t.Errorf("broken.test after the rewrites: %s", r)
	}
	m := opsScrape(t, p)
	if ok := opsReloads(m, "ok"); ok < float64(settledValid) {
		t.Errorf("sluice_config_reloads_total{ok} = %v, want at least %d", ok, settledValid)
	}
	if f := opsReloads(m, "failed"); f < float64(settledBroken) {
		t.Errorf("sluice_config_reloads_total{failed} = %v, want at least %d", f, settledBroken)
	}
	recs := p.Records(t)
	reloadsOK := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Kind == audit.KindConfigReload && r.Decision == "allow" })
	reloadsBad := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Kind == audit.KindConfigReload && r.Decision == "error" })
	if len(reloadsOK) < settledValid || len(reloadsBad) < settledBroken {
		t.Errorf("audit: %d reload and %d failed-reload records, want at least %d and %d", len(reloadsOK), len(reloadsBad), settledValid, settledBroken)
	}

	t.Run("SIGHUP", func(t *testing.T) {
		before := opsReloads(opsScrape(t, p), "unchanged")
		if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		// The file has not changed, so the reload SIGHUP triggers reads it
		// and reports it unchanged.
		opsWaitMetrics(t, p, "a reload after SIGHUP", func(m opsMetrics) bool { return opsReloads(m, "unchanged") > before })
		// A changed file with a SIGHUP is applied and logged as such. The
		// file watch sees the same change, and on a loaded machine its
		// reload (or the poll's) can land before the signal, leaving the
		// SIGHUP nothing new to apply: each attempt writes a fresh version,
		// and three lost races in a row would be a bug.
		applied := false
		for attempt := 0; attempt < 3 && !applied; attempt++ {
			i := 100 + attempt
			writeFile(valid("a", i))
			if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
				t.Fatal(err)
			}
			inForce("a", i)
			deadline := time.Now().Add(2 * time.Second)
			for !applied && time.Now().Before(deadline) {
				applied = strings.Contains(p.Stderr(), `"trigger":"sighup"`)
				time.Sleep(20 * time.Millisecond)
			}
		}
		if !applied {
			t.Fatalf("no reload logged with trigger sighup:\n%s", tail(p.Stderr(), 3000))
		}
	})
}

// TestE2EOpsReloadTunnels checks what docs/operations.md says about tunnels
// on reload: a spliced tunnel keeps running until it closes, while the next
// request inside an intercepted tunnel, and every new CONNECT, is decided by
// the new policy.
func TestE2EOpsReloadTunnels(t *testing.T) {
	env := newE2EEnv(t)
	pki := newTestPKI(t, env.Dir)
	caCert, caKey, sluiceCA := opsInitCA(t, env)
	dns := startTestDNS(t, map[string][]string{"spliced.test": {"127.0.0.1"}, "inspected.test": {"127.0.0.1"}})
	origin := startOpsOrigin(t, pki.ServerConfig(t, "spliced.test", "inspected.test"))
	cred := env.StaticCredential("acme", "acme-ci")
	P := origin.Port
	config := func(withRules bool) string {
		rulesYAML := fmt.Sprintf("      - id: keep\n        host: keep.test\n        ports: [%d]\n", P)
		if withRules {
			rulesYAML += fmt.Sprintf(`      - id: spliced
        host: spliced.test
        ports: [%[1]d]
      - id: inspected
        host: inspected.test
        ports: [%[1]d]
        inspect: true
`, P)
		}
		return fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`ca:
  cert: %s
  key: %s
tenants:
  - id: acme
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
%s`, caCert, caKey, opsCred(cred), rulesYAML)
	}
	p := env.StartSluice(config(true), sluiceOptions{Resolver: dns.Addr, UpstreamCA: pki.CAFile})

	open := func(host string, cfg *tls.Config) (*tls.Conn, *bufio.Reader) {
		t.Helper()
		conn, resp, body, err := opsConnect(p.ProxyAddr, cred, fmt.Sprintf("%s:%d", host, P))
		if err != nil || conn == nil {
			t.Fatalf("CONNECT %s: %v %v %.200q", host, err, resp != nil, body)
		}
		tc, err := opsTLS(conn, cfg)
		if err != nil {
			t.Fatalf("TLS to %s: %v", host, err)
		}
		t.Cleanup(func() { tc.Close() })
		return tc, bufio.NewReader(tc)
	}
	spliced, sbr := open("spliced.test", pki.ClientConfig("spliced.test"))
	inspected, ibr := open("inspected.test", &tls.Config{RootCAs: sluiceCA, ServerName: "inspected.test", MinVersion: tls.VersionTLS12})
	sHost, iHost := fmt.Sprintf("spliced.test:%d", P), fmt.Sprintf("inspected.test:%d", P)
	if r := opsGetInside(spliced, sbr, sHost, "/before"); r.Status != 200 {
		t.Fatalf("spliced tunnel before reload: %s", r)
	}
	if r := opsGetInside(inspected, ibr, iHost, "/before"); r.Status != 200 || string(r.Body) != "ok /before\n" {
		t.Fatalf("intercepted tunnel before reload: %s", r)
	}

	before := opsReloads(opsScrape(t, p), "ok")
	if err := os.WriteFile(p.ConfigPath, []byte(config(false)), 0o600); err != nil {
		t.Fatal(err)
	}
	opsWaitMetrics(t, p, "the reload that drops both rules", func(m opsMetrics) bool { return opsReloads(m, "ok") > before })

	if r := opsGetInside(spliced, sbr, sHost, "/after"); r.Status != 200 {
		t.Errorf("spliced tunnel after its rule was removed: %s (it should run until it closes)", r)
	}
	r := opsGetInside(inspected, ibr, iHost, "/after")
	checkDenial(t, "request inside an intercepted tunnel after its rule was removed",
		&http.Response{StatusCode: r.Status, Header: r.Header}, r.Body, http.StatusForbidden, "not_allowlisted")
	conn, resp, body, err := opsConnect(p.ProxyAddr, cred, fmt.Sprintf("spliced.test:%d", P))
	if err != nil || conn != nil {
		t.Fatalf("new CONNECT after the rule was removed: conn=%v err=%v", conn != nil, err)
	}
	checkDenial(t, "new CONNECT after the rule was removed", resp, body, http.StatusForbidden, "not_allowlisted")
}

// ---------------------------------------------------------------------------
// Metrics.

func TestE2EOpsMetrics(t *testing.T) {
	env := newE2EEnv(t)
	pki := newTestPKI(t, env.Dir)
	dns := startTestDNS(t, map[string][]string{"m.test": {"127.0.0.1"}, "other.test": {"127.0.0.1"}, "tls.m.test": {"127.0.0.1"}})
	origin := startOpsOrigin(t, nil)
	tlsOrigin := startOpsOrigin(t, pki.ServerConfig(t, "tls.m.test"))
	acme := env.StaticCredential("acme", "acme-ci")
	slow := env.StaticCredential("slowpoke", "slowpoke-ci")
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`limits:
  auth_failures_per_minute: 10000
tenants:
  - id: acme
%[1]s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: acme-m
        host: m.test
        ports: [%[3]d]
      - id: acme-tls
        host: tls.m.test
        ports: [%[4]d]
  - id: slowpoke
%[2]s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: slowpoke-m
        host: m.test
        ports: [%[3]d]
    limits: {requests_per_second: 0.1, burst: 1}
`, opsCred(acme), opsCred(slow), origin.Port, tlsOrigin.Port)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr, UpstreamCA: pki.CAFile})
	m0 := opsScrape(t, p)
	for _, name := range []string{"sluice_audit_queue_depth", "sluice_audit_lost_total", "sluice_tunnels_active", "sluice_connections_active", "sluice_policy_loaded_timestamp_seconds"} {
		if !m0.Has(name) {
			t.Errorf("/metrics has no %s", name)
		}
	}

	cl := p.Client(acme, nil)
	defer cl.CloseIdleConnections()
	// Allowed GETs and POSTs whose sizes the test knows exactly.
	var down, up int64
	const gets, posts = 5, 3
	for i := range gets {
		r := opsGet(cl, fmt.Sprintf("http://m.test:%d/get/%d", origin.Port, i))
		if r.Status != 200 {
			t.Fatalf("GET %d: %s", i, r)
		}
		down += int64(len(r.Body))
	}
	for i := range posts {
		body := bytes.Repeat([]byte("p"), 1000*(i+1))
		req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://m.test:%d/upload", origin.Port), bytes.NewReader(body))
		r := opsDo(cl, req)
		if r.Status != 200 {
			t.Fatalf("POST %d: %s", i, r)
		}
		down += int64(len(r.Body))
		up += int64(len(body))
	}
	// Denials: not allowlisted, rate limited, and authentication failures
	// naming tenants that do not exist.
	const denied = 4
	for i := range denied {
		if r := opsGet(cl, fmt.Sprintf("http://other.test:%d/%d", origin.Port, i)); r.Status != 403 {
			t.Fatalf("denied request %d: %s", i, r)
		}
	}
	slowCl := p.Client(slow, nil)
	defer slowCl.CloseIdleConnections()
	for i, want := range []int{200, 429, 429} {
		if r := opsGet(slowCl, fmt.Sprintf("http://m.test:%d/s", origin.Port)); r.Status != want {
			t.Fatalf("slowpoke request %d: %s, want %d", i, r, want)
		}
	}
	const strangers = 6
	for i := range strangers {
		c := env.Credential(fmt.Sprintf("no-such-tenant-%d-%s", i, opsRandomHex(t, 4)), "x-"+opsRandomHex(t, 12))
		sc := p.Client(c, nil)
		if r := opsGet(sc, fmt.Sprintf("http://m.test:%d/", origin.Port)); r.Status != http.StatusProxyAuthRequired {
			t.Fatalf("unknown tenant %d: %s", i, r)
		}
		sc.CloseIdleConnections()
	}
	// A tunnel, open while scraped.
	conn, resp, body, err := opsConnect(p.ProxyAddr, acme, fmt.Sprintf("tls.m.test:%d", tlsOrigin.Port))
	if err != nil || conn == nil {
		t.Fatalf("CONNECT: %v %v %.200q", err, resp != nil, body)
	}
	tc, err := opsTLS(conn, pki.ClientConfig("tls.m.test"))
	if err != nil {
		t.Fatal(err)
	}
	if r := opsGetInside(tc, bufio.NewReader(tc), "tls.m.test", "/t"); r.Status != 200 {
		t.Fatalf("inside the tunnel: %s", r)
	}
	m := opsScrape(t, p)
	if got := m.Get("sluice_tunnels_active"); got != 1 {
		t.Errorf("sluice_tunnels_active = %v with one tunnel open", got)
	}
	tc.Close()
	m = opsWaitMetrics(t, p, "the tunnel to close", func(m opsMetrics) bool { return m.Get("sluice_tunnels_active") == 0 })

	// Reloads: one broken, one good.
	before := m
	if err := os.WriteFile(p.ConfigPath, []byte(cfg+"bogus_key: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	opsWaitMetrics(t, p, "failed reload", func(m opsMetrics) bool { return opsReloads(m, "failed") == opsReloads(before, "failed")+1 })
	if err := os.WriteFile(p.ConfigPath, []byte(cfg+"# touched\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	m = opsWaitMetrics(t, p, "good reload", func(m opsMetrics) bool { return opsReloads(m, "ok") == opsReloads(before, "ok")+1 })

	want := []struct {
		labels []string
		value  float64
	}{
		{[]string{"tenant", "acme", "decision", "allow", "reason", "allowed"}, gets + posts + 1}, // + the (spliced) tunnel, counted when it closes
		{[]string{"tenant", "acme", "decision", "deny", "reason", "not_allowlisted"}, denied},
		{[]string{"tenant", "slowpoke", "decision", "allow", "reason", "allowed"}, 1},
		{[]string{"tenant", "slowpoke", "decision", "deny", "reason", "rate_limited"}, 2},
		{[]string{"tenant", "unknown", "decision", "deny", "reason", "auth_invalid"}, strangers},
	}
	for _, w := range want {
		if got := m.Get("sluice_requests_total", w.labels...); got != w.value {
			t.Errorf("sluice_requests_total%v = %v, want %v", w.labels, got, w.value)
		}
	}
	if got := m.Get("sluice_limit_refusals_total", "tenant", "slowpoke", "limit", "rate"); got != 2 {
		t.Errorf("sluice_limit_refusals_total{slowpoke,rate} = %v, want 2", got)
	}
	// Bytes: plain requests count body bytes exactly; the tunnel counts
	// what crossed it, as its audit record says.
	recs := p.Records(t)
	var tunIn, tunOut int64
	for _, r := range recs {
		if r.Kind == audit.KindTunnel {
			tunIn += r.BytesIn
			tunOut += r.BytesOut
		}
	}
	if tunIn == 0 || tunOut == 0 {
		t.Errorf("tunnel records count in=%d out=%d", tunIn, tunOut)
	}
	// The request inside the tunnel is a plain (not intercepted) one here,
	// so only the tunnel's raw bytes count.
	if got := m.Get("sluice_bytes_total", "tenant", "acme", "direction", "ingress"); got != float64(down+tunOut) {
		t.Errorf("sluice_bytes_total{acme,ingress} = %v, want %d (bodies %d + tunnel %d)", got, down+tunOut, down, tunOut)
	}
	if got := m.Get("sluice_bytes_total", "tenant", "acme", "direction", "egress"); got != float64(up+tunIn) {
		t.Errorf("sluice_bytes_total{acme,egress} = %v, want %d (bodies %d + tunnel %d)", got, up+tunIn, up, tunIn)
	}
	// Label cardinality: only configured tenants and "unknown".
	for v := range m.LabelValues("sluice_", "tenant") {
		if v != "acme" && v != "slowpoke" && v != "unknown" {
			t.Errorf("a metric carries tenant label %q, which is not in the config", v)
		}
	}
	if !strings.Contains(m.text, "sluice_request_duration_seconds_bucket") {
		t.Error("/metrics has no request duration histogram")
	}
}

// ---------------------------------------------------------------------------
// Readiness.

func TestE2EOpsReadyz(t *testing.T) {
	t.Run("stale file secret", func(t *testing.T) {
		env := newE2EEnv(t)
		secretsPath := env.Path("secrets.yaml")
		value := "sk-ready-" + opsRandomHex(t, 16)
		env.MarkSecret(value)
		if err := os.WriteFile(secretsPath, []byte("api: "+value+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg := fmt.Sprintf(opsHeader, "5s") + `broker:
  refresh: 200ms
  file:
    path: secrets.yaml
secrets:
  - name: api
    source: file
    hosts: [api.test]
    max_staleness: 1s
tenants:
  - id: acme
    allow:
      - host: api.test
`
		p := env.StartSluice(cfg, sluiceOptions{})
		if st, body, err := opsAdminGet(p, "/readyz"); err != nil || st != 200 {
			t.Fatalf("/readyz with a fresh secret: %d %q %v", st, body, err)
		}
		// A secrets file others may read is refused by the file source, so
		// refreshes fail from now on and the cached value ages.
		if err := os.Chmod(secretsPath, 0o644); err != nil {
			t.Fatal(err)
		}
		waitReady(t, p, http.StatusServiceUnavailable, "api")
		if st, _, _ := opsAdminGet(p, "/healthz"); st != 200 {
			t.Errorf("/healthz while not ready: %d (liveness must not follow readiness)", st)
		}
		if err := os.Chmod(secretsPath, 0o600); err != nil {
			t.Fatal(err)
		}
		waitReady(t, p, http.StatusOK, "ready")
	})

	t.Run("audit sink failing", func(t *testing.T) {
		env := newE2EEnv(t)
		dns := startTestDNS(t, map[string][]string{"ok.test": {"127.0.0.1"}})
		origin := startOpsOrigin(t, nil)
		cred := env.StaticCredential("acme", "acme-ci")
		cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`tenants:
  - id: acme
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - host: ok.test
        ports: [%d]
`, opsCred(cred), origin.Port)
		// Every write to /dev/full fails with ENOSPC.
		p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr, Args: []string{"--audit", "/dev/full"}})
		if st, body, err := opsAdminGet(p, "/readyz"); err != nil || st != 200 {
			t.Fatalf("/readyz before anything was written: %d %q %v", st, body, err)
		}
		cl := p.Client(cred, nil)
		defer cl.CloseIdleConnections()
		u := fmt.Sprintf("http://ok.test:%d/", origin.Port)
		if r := opsGet(cl, u); r.Err == nil && r.Status == 200 && string(r.Body) == "ok /\n" {
			t.Errorf("a response was completed although its audit record could not be written")
		}
		waitReady(t, p, http.StatusServiceUnavailable, "audit")
		before := origin.requests.Load()
		r := opsGet(cl, u)
		checkDenial(t, "request while the audit log fails", &http.Response{StatusCode: r.Status, Header: r.Header}, r.Body,
			http.StatusServiceUnavailable, "audit_unavailable")
		if origin.requests.Load() != before {
			t.Error("a request reached the origin while the audit log was failing")
		}
	})
}

// waitReady polls /readyz (bounded) until it answers status with a body
// containing substr.
func waitReady(t *testing.T, p *sluiceProc, status int, substr string) {
	t.Helper()
	deadline := time.Now().Add(e2eTimeout)
	for {
		st, body, err := opsAdminGet(p, "/readyz")
		if err == nil && st == status && strings.Contains(body, substr) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz: %d %q (%v), want %d containing %q", st, body, err, status, substr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ---------------------------------------------------------------------------
// Graceful shutdown.

func TestE2EOpsGracefulShutdown(t *testing.T) {
	env := newE2EEnv(t)
	pki := newTestPKI(t, env.Dir)
	dns := startTestDNS(t, map[string][]string{"app.test": {"127.0.0.1"}, "tls.test": {"127.0.0.1"}})
	origin := startOpsOrigin(t, nil)
	tlsOrigin := startOpsOrigin(t, pki.ServerConfig(t, "tls.test"))
	cred := env.StaticCredential("acme", "acme-ci")
	const shutdownTimeout = 5 * time.Second
	cfg := fmt.Sprintf(opsHeader, shutdownTimeout.String()) + fmt.Sprintf(`tenants:
  - id: acme
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: app
        host: app.test
        ports: [%d]
      - id: tls
        host: tls.test
        ports: [%d]
`, opsCred(cred), origin.Port, tlsOrigin.Port)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr, UpstreamCA: pki.CAFile})

	// An idle spliced tunnel that never closes by itself: shutdown must cut
	// it at the deadline and still record it.
	conn, resp, body, err := opsConnect(p.ProxyAddr, cred, fmt.Sprintf("tls.test:%d", tlsOrigin.Port))
	if err != nil || conn == nil {
		t.Fatalf("CONNECT: %v %v %.200q", err, resp != nil, body)
	}
	tunnel, err := opsTLS(conn, pki.ClientConfig("tls.test"))
	if err != nil {
		t.Fatal(err)
	}
	defer tunnel.Close()
	tbr := bufio.NewReader(tunnel)
	if r := opsGetInside(tunnel, tbr, "tls.test", "/t"); r.Status != 200 {
		t.Fatalf("inside the tunnel: %s", r)
	}

	// Background load: fast requests until the proxy stops answering.
	deadline0 := time.Now().Add(e2eTimeout)
	type tally struct{ ok, refused, failed int }
	var mu sync.Mutex
	var load tally
	var refusedIDs, failures []string
	stopLoad := make(chan struct{})
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			c := p.Client(cred, nil)
			defer c.CloseIdleConnections()
			for i := 0; i < 5000; i++ {
				select {
				case <-stopLoad:
					return
				default:
				}
				r := opsGet(c, fmt.Sprintf("http://app.test:%d/fast", origin.Port))
				mu.Lock()
				switch {
				case r.Err == nil && r.Status == 200:
					load.ok++
				case r.Err == nil && r.Status == http.StatusServiceUnavailable && r.Header.Get("X-Sluice-Reason") == "shutting_down":
					load.refused++
					refusedIDs = append(refusedIDs, r.Header.Get("X-Sluice-Request-Id"))
				default:
					load.failed++
					if len(failures) < 5 {
						failures = append(failures, r.String())
					}
				}
				mu.Unlock()
				if r.Err != nil {
					return // the listener is gone
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}

	// Let the load run a little before the slow requests start.
	for {
		mu.Lock()
		n := load.ok
		mu.Unlock()
		if n >= 60 || time.Now().After(deadline0) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}

	// In-flight slow requests, each on its own connection.
	const slowN = 8
	slowRes := make([]opsResult, slowN)
	var slowWG sync.WaitGroup
	for i := range slowN {
		slowWG.Go(func() {
			c := p.Client(cred, nil)
			defer c.CloseIdleConnections()
			slowRes[i] = opsGet(c, fmt.Sprintf("http://app.test:%d/slow?ms=2000", origin.Port))
		})
	}
	deadline := time.Now().Add(e2eTimeout)
	for origin.inflight.Load() < slowN {
		if time.Now().After(deadline) {
			t.Fatalf("only %d slow requests reached the origin", origin.inflight.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}

	// SIGTERM (Stop requires exit status 0).
	stopped := make(chan time.Duration, 1)
	sigAt := time.Now()
	go func() {
		p.Stop(t)
		stopped <- time.Since(sigAt)
	}()
	// New connections are refused while the slow requests are still running.
	refusedAt := time.Duration(-1)
	for time.Since(sigAt) < 5*time.Second {
		c, err := net.DialTimeout("tcp", p.ProxyAddr, time.Second)
		if err != nil {
			if errors.Is(err, syscall.ECONNREFUSED) {
				refusedAt = time.Since(sigAt)
				break
			}
		} else {
			c.Close()
		}
		time.Sleep(5 * time.Millisecond)
	}
	stillRunning := origin.inflight.Load()
	if refusedAt < 0 {
		t.Error("the proxy listener still accepted connections 5 s after SIGTERM")
	} else if stillRunning == 0 {
		t.Errorf("new connections were refused only %v after SIGTERM, after the in-flight requests had ended", refusedAt)
	}
	slowWG.Wait()
	for i, r := range slowRes {
		if r.Err != nil || r.Status != 200 || string(r.Body) != "slow done\n" {
			t.Errorf("in-flight request %d across shutdown: %s", i, r)
		}
	}
	var took time.Duration
	select {
	case took = <-stopped:
	case <-time.After(e2eTimeout + 5*time.Second):
		t.Fatal("sluice did not exit")
	}
	close(stopLoad)
	wg.Wait()
	t.Logf("SIGTERM: listener refused after %v with %d requests in flight; exit after %v (shutdown_timeout %v); load: %+v %q",
		refusedAt.Round(time.Millisecond), stillRunning, took.Round(time.Millisecond), shutdownTimeout, load, failures)
	// The idle tunnel holds the drain open until the deadline; then it is
	// cut and the process exits promptly.
	if took > shutdownTimeout+3*time.Second {
		t.Errorf("exit took %v, shutdown_timeout is %v", took, shutdownTimeout)
	}
	if r := opsGetInside(tunnel, tbr, "tls.test", "/after"); r.Err == nil {
		t.Errorf("the tunnel still answered after sluice exited: %s", r)
	}

	// Every response received has its record, and the log verifies.
	recs := p.Records(t)
	slowRecs := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Path == "/slow" && r.Decision == "allow" && r.Status == 200 })
	if len(slowRecs) != slowN {
		t.Errorf("audit: %d records of in-flight requests, want %d", len(slowRecs), slowN)
	}
	fastRecs := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Path == "/fast" && r.Decision == "allow" })
	// A record is written before the last byte of its response, so every
	// 200 a client got has one; a request cut off by the shutdown may have
	// one too.
	if len(fastRecs) < load.ok || len(fastRecs) > load.ok+load.failed {
		t.Errorf("audit: %d records of fast requests; clients got %d complete responses and %d failures", len(fastRecs), load.ok, load.failed)
	}
	ids := map[string]bool{}
	for _, r := range recs {
		ids[r.ID] = true
	}
	for _, id := range refusedIDs {
		if !ids[id] {
			t.Errorf("refusal %s has no audit record", id)
		}
	}
	tunnels := opsRecordsWhere(recs, func(r audit.Record) bool { return r.Kind == audit.KindTunnel })
	if len(tunnels) != 1 || tunnels[0].BytesIn == 0 || tunnels[0].BytesOut == 0 {
		t.Errorf("audit: tunnel records %s", describeRecords(tunnels))
	}
	if out, stderr, code := runSluice(t, "", "logs", "verify", p.AuditPath); code != 0 {
		t.Errorf("sluice logs verify: exit %d\n%s%s", code, out, stderr)
	}
}

// TestE2EOpsReloadConfigMap updates the config the way a Kubernetes
// ConfigMap volume does: the file is a symlink through "..data", and an
// update swaps that symlink by rename. The file watch must see it (trigger
// "change"), not only the slow poll.
func TestE2EOpsReloadConfigMap(t *testing.T) {
	env := newE2EEnv(t)
	dns := startTestDNS(t, map[string][]string{"always.test": {"127.0.0.1"}, "a-only.test": {"127.0.0.1"}, "b-only.test": {"127.0.0.1"}})
	origin := startOpsOrigin(t, nil)
	cred := env.StaticCredential("acme", "acme-ci")
	mount := env.Path("configmap")
	publish := func(n int, content string) {
		t.Helper()
		dir := fmt.Sprintf("..2026_01_01_00_00_%02d.%d", n, n)
		if err := os.MkdirAll(mount+"/"+dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(mount+"/"+dir+"/sluice.yaml", []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(dir, mount+"/..data_tmp"); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(mount+"/..data_tmp", mount+"/..data"); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(mount, 0o755); err != nil {
		t.Fatal(err)
	}
	publish(1, reloadConfig("a", cred, origin.Port, "127.0.0.0/8", ""))
	if err := os.Symlink("..data/sluice.yaml", mount+"/sluice.yaml"); err != nil {
		t.Fatal(err)
	}
	p := env.StartSluice(reloadConfig("a", cred, origin.Port, "127.0.0.0/8", ""),
		sluiceOptions{Resolver: dns.Addr, Args: []string{"--config", mount + "/sluice.yaml"}})
	cl := p.Client(cred, nil)
	defer cl.CloseIdleConnections()
	u := func(host string) string { return fmt.Sprintf("http://%s:%d/", host, origin.Port) }
	if r := opsGet(cl, u("a-only.test")); r.Status != 200 {
		t.Fatalf("version a before the update: %s", r)
	}
	publish(2, reloadConfig("b", cred, origin.Port, "127.0.0.0/8", ""))
	deadline := time.Now().Add(e2eTimeout)
	for !strings.Contains(p.Stderr(), `"msg":"policy reloaded","trigger"`) {
		if time.Now().After(deadline) {
			t.Fatalf("no reload after the ConfigMap update:\n%s", tail(p.Stderr(), 3000))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !strings.Contains(p.Stderr(), `"msg":"policy reloaded","trigger":"change"`) {
		t.Errorf("the ConfigMap update was picked up by polling, not by the file watch:\n%s", tail(p.Stderr(), 2000))
	}
	if r := opsGet(cl, u("b-only.test")); r.Status != 200 {
		t.Errorf("version b after the update: %s", r)
	}
	if r := opsGet(cl, u("always.test")); r.Status != 200 {
		t.Errorf("always.test after the update: %s", r)
	}
}
