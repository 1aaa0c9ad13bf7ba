package main

// End-to-end acceptance tests for the audit log (issue "The audit log as a
// security team's tool"), through the real `sluice serve` binary and the
// real `sluice logs verify`: kill -9 under load loses no record of a
// completed response; a full disk refuses traffic (on_failure: closed) or
// counts the loss (open) and records the gap once writable; rotation keeps
// the chain, and a deleted file or an edited field is found with its file
// and line. Everything listens on and dials 127.0.0.1 only.

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/audit"
)

// auditWorld is the setup of the audit tests: a DNS server, a plain and a
// TLS origin on 127.0.0.1, an interception CA made by `sluice ca init`, and
// one tenant whose rules cover a forwarded host, a denied host, a spliced
// and an intercepted TLS host.
type auditWorld struct {
	env    *e2eEnv
	dns    *testDNS
	origin *testOrigin
	tls    *testOrigin
	stream *testOrigin // answers /…/chunked/… with a chunked body
	pki    *testPKI
	caCert string
	caKey  string
	trust  *x509.CertPool // the sluice CA and the origin CA: what a sandbox trusts
	acme   testCredential
}

func newAuditWorld(t *testing.T) *auditWorld {
	t.Helper()
	env := newE2EEnv(t)
	w := &auditWorld{env: env, pki: newTestPKI(t, env.Dir)}
	w.dns = startTestDNS(t, map[string][]string{
		"ok.test":     {"127.0.0.1"},
		"no.test":     {"127.0.0.1"},
		"tls.test":    {"127.0.0.1"},
		"in.test":     {"127.0.0.1"},
		"stream.test": {"127.0.0.1"},
	})
	w.stream = startStreamOrigin(t)
	w.origin = env.Track(startHTTPOrigin(t, "127.0.0.1:0"))
	w.tls = env.Track(startTLSOrigin(t, "127.0.0.1:0", w.pki, "tls.test", "in.test"))
	w.acme = env.StaticCredential("acme", "acme-ci")

	w.caCert, w.caKey = env.Path("ca.pem"), env.Path("ca.key")
	if out, errOut, code := runSluice(t, "", "ca", "init", "--cert", w.caCert, "--key", w.caKey); code != 0 {
		t.Fatalf("sluice ca init: %d\n%s%s", code, out, errOut)
	}
	keyPEM, err := os.ReadFile(w.caKey)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := pem.Decode(keyPEM); b != nil {
		// The CA key must appear in no log or audit record either.
		env.MarkSecret(string(pem.EncodeToMemory(b)[len("-----BEGIN "+b.Type+"-----\n"):][:64]))
	}
	certPEM, err := os.ReadFile(w.caCert)
	if err != nil {
		t.Fatal(err)
	}
	w.trust = w.pki.Pool.Clone()
	if !w.trust.AppendCertsFromPEM(certPEM) {
		t.Fatal("sluice ca init wrote no PEM certificate")
	}
	return w
}

// startStreamOrigin is a plain HTTP origin on 127.0.0.1 whose responses
// have no length: two flushed chunks, so the proxy relays them chunked.
func startStreamOrigin(t *testing.T) *testOrigin {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &testOrigin{Addr: ln.Addr().String(), Port: ln.Addr().(*net.TCPAddr).Port}
	o.srv = &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		o.requests.Add(1)
		rw.Header().Set("Content-Type", "text/plain")
		io.WriteString(rw, "first chunk\n")
		rw.(http.Flusher).Flush()
		io.WriteString(rw, "second chunk\n")
	})}
	go func() { _ = o.srv.Serve(ln) }()
	t.Cleanup(func() { _ = o.srv.Close() })
	return o
}

// config is the policy with the given audit block (YAML lines under
// "audit:", indented by two spaces).
func (w *auditWorld) config(auditBlock string) string {
	P, T := w.origin.Port, w.tls.Port
	return fmt.Sprintf(`version: 1
server:
  read_header_timeout: 2s
  dial_timeout: 3s
  upstream_timeout: 10s
  shutdown_timeout: 5s
ca:
  cert: %[3]s
  key: %[4]s
audit:
%[7]s
limits:
  auth_failures_per_minute: 10000
tenants:
  - id: acme
    credentials:
      - name: %[5]s
        hash: %[6]s
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: ok
        host: ok.test
        ports: [%[1]d]
      - id: splice
        host: tls.test
        ports: [%[2]d]
      - id: inspect
        host: in.test
        ports: [%[2]d]
        inspect: true
      - id: stream
        host: stream.test
        ports: [%[8]d]
    deny:
      - id: no
        host: no.test
        ports: [%[1]d]
`, P, T, w.caCert, w.caKey, w.acme.Name, w.acme.Hash, strings.TrimRight(auditBlock, "\n"), w.stream.Port)
}

// start runs sluice with the config; auditPath, if set, replaces the
// helper's audit file (the last --audit flag wins).
func (w *auditWorld) start(t *testing.T, auditBlock, auditPath string) *sluiceProc {
	t.Helper()
	o := sluiceOptions{Resolver: w.dns.Addr, UpstreamCA: w.pki.CAFile}
	if auditPath != "" {
		o.Args = []string{"--audit", auditPath}
	}
	p := w.env.StartSluice(w.config(auditBlock), o)
	if auditPath != "" {
		p.AuditPath = auditPath
	}
	return p
}

// client is a sandbox's HTTP client through p: keep-alive, CONNECT for
// https:// URLs, trusting the sluice CA (intercepted hosts) and the origin
// CA (spliced hosts).
func (w *auditWorld) client(p *sluiceProc, timeout time.Duration) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			Proxy:               http.ProxyURL(p.ProxyURL(w.acme)),
			TLSClientConfig:     &tls.Config{RootCAs: w.trust, MinVersion: tls.VersionTLS12},
			MaxIdleConnsPerHost: 2,
			DisableCompression:  true,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Timeout:       timeout,
	}
}

// audOutcome is what a client got for one request.
type audOutcome struct {
	complete  bool // a full response (head and the whole body) arrived
	status    int
	reason    string // X-Sluice-Reason
	requestID string // X-Sluice-Request-Id: set on every refusal by sluice
	body      []byte
	err       error
}

// audFetchOnce fetches rawURL on a client of its own and closes its
// connections afterwards.
func (w *auditWorld) audFetchOnce(p *sluiceProc, rawURL string) audOutcome {
	cl := w.client(p, e2eTimeout)
	defer cl.CloseIdleConnections()
	return audFetch(cl, http.MethodGet, rawURL)
}

func audFetch(cl *http.Client, method, rawURL string) audOutcome {
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, rawURL, nil)
	if err != nil {
		return audOutcome{err: err}
	}
	resp, err := cl.Do(req)
	if err != nil {
		return audOutcome{err: err}
	}
	defer resp.Body.Close()
	o := audOutcome{status: resp.StatusCode, reason: resp.Header.Get("X-Sluice-Reason"), requestID: resp.Header.Get("X-Sluice-Request-Id")}
	o.body, o.err = io.ReadAll(resp.Body)
	if o.err == nil && method != http.MethodHead && resp.ContentLength >= 0 && int64(len(o.body)) != resp.ContentLength {
		o.err = io.ErrUnexpectedEOF
	}
	o.complete = o.err == nil
	return o
}

// audRawConnect sends one CONNECT and reads the whole answer; it never fails
// the test (the proxy may be gone), it reports.
func audRawConnect(proxyAddr string, c testCredential, target string) audOutcome {
	conn, err := net.DialTimeout("tcp", proxyAddr, 5*time.Second)
	if err != nil {
		return audOutcome{err: err}
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(e2eTimeout))
	if _, err := fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\n\r\n", target, target, proxyAuthorization(c)); err != nil {
		return audOutcome{err: err}
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
	if err != nil {
		return audOutcome{err: err}
	}
	defer resp.Body.Close()
	o := audOutcome{status: resp.StatusCode, reason: resp.Header.Get("X-Sluice-Reason"), requestID: resp.Header.Get("X-Sluice-Request-Id")}
	if resp.StatusCode == http.StatusOK {
		o.complete = true // the tunnel itself is the rest of the answer
		return o
	}
	o.body, o.err = io.ReadAll(resp.Body)
	o.complete = o.err == nil
	return o
}

// audReadSet reads every record of the audit set at path (rotated files
// first), chain headers included.
func audReadSet(t *testing.T, path string) ([]audit.Record, audit.ScanStats) {
	t.Helper()
	files, err := audit.ResolveSet([]string{path})
	if err != nil {
		t.Fatalf("audit set %s: %v", path, err)
	}
	var recs []audit.Record
	st, err := audit.Scan(context.Background(), files, func(r *audit.Record, _ audit.Location) error {
		recs = append(recs, *r)
		return nil
	})
	if err != nil {
		t.Fatalf("reading audit set: %v", err)
	}
	return recs, st
}

// audVerifyCLI runs `sluice logs verify` on path and returns its output and
// exit status.
func audVerifyCLI(t *testing.T, path string) (string, int) {
	t.Helper()
	out, errOut, code := runSluice(t, "", "logs", "verify", path)
	return out + errOut, code
}

// audRequireVerified runs `sluice logs verify` and requires the chain to hold.
func audRequireVerified(t *testing.T, path string) string {
	t.Helper()
	out, code := audVerifyCLI(t, path)
	if code != 0 || !strings.Contains(out, "OK: ") {
		t.Fatalf("sluice logs verify %s: exit %d\n%s", path, code, out)
	}
	return out
}

// audKillHard ends p with SIGKILL (no drain, no final fsync, no deferred
// close) and tells the environment not to expect a clean exit from it.
func audKillHard(t *testing.T, p *sluiceProc) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 sluice: %v", err)
	}
	select {
	case <-p.waitDone:
	case <-time.After(e2eTimeout):
		t.Fatal("sluice did not die on SIGKILL")
	}
	p.stopOnce.Do(func() {}) // the environment's Stop would demand a clean exit
}

// TestE2EAuditKill9UnderLoad kills sluice with SIGKILL while 8 workers
// send plain allowed and denied requests, requests inside intercepted
// tunnels, spliced tunnels and refused CONNECTs, then requires the chain to
// verify (a torn last line is a crash, not tampering) and every request
// that got a complete response to have its record: refusals by their
// X-Sluice-Request-Id, forwarded requests by their unique path. A restart
// on the same log continues the chain.
func TestE2EAuditKill9UnderLoad(t *testing.T) {
	w := newAuditWorld(t)
	block := "  on_failure: closed\n  fsync: never\n"
	path := w.env.Path("kill-audit.log")
	p := w.start(t, block, path)
	P, T := w.origin.Port, w.tls.Port

	type done struct {
		op        string
		path      string // forwarded requests: the unique path
		requestID string // refusals
	}
	const workers = 8
	var (
		mu        sync.Mutex
		completed []done
		failed    atomic.Int64
		killed    atomic.Bool
		spliced   atomic.Int64
	)
	start := time.Now()
	deadline := start.Add(3 * time.Second)
	var wg sync.WaitGroup
	for wk := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl := w.client(p, 5*time.Second)
			defer cl.CloseIdleConnections()
			for i := 0; i < 10000 && !killed.Load() && time.Now().Before(deadline); i++ {
				uniq := fmt.Sprintf("/kill/w%d/%d", wk, i)
				var o audOutcome
				var d done
				switch op := (wk + i) % 6; op {
				case 0, 3:
					d.op = "allow"
					o = audFetch(cl, http.MethodGet, fmt.Sprintf("http://ok.test:%d%s", P, uniq))
				case 1:
					d.op = "deny"
					o = audFetch(cl, http.MethodGet, fmt.Sprintf("http://no.test:%d%s", P, uniq))
				case 2:
					d.op = "intercepted"
					o = audFetch(cl, http.MethodGet, fmt.Sprintf("https://in.test:%d%s", T, uniq))
				case 4:
					d.op = "spliced"
					o = audFetch(cl, http.MethodGet, fmt.Sprintf("https://tls.test:%d%s", T, uniq))
				case 5:
					d.op = "connect-deny"
					o = audRawConnect(p.ProxyAddr, w.acme, fmt.Sprintf("no.test:%d", T))
				}
				if !o.complete {
					failed.Add(1)
					continue
				}
				if o.requestID != "" {
					d.requestID = o.requestID
				} else if o.status == http.StatusOK {
					d.path = uniq
				} else {
					t.Errorf("%s %s: status %d without a request id (%.200q)", d.op, uniq, o.status, o.body)
					continue
				}
				if d.op == "spliced" {
					// A spliced tunnel's inside is not recorded per request;
					// its tunnel record is written when it closes.
					spliced.Add(1)
					continue
				}
				mu.Lock()
				completed = append(completed, d)
				mu.Unlock()
			}
		}()
	}
	time.Sleep(1500 * time.Millisecond)
	audKillHard(t, p)
	killed.Store(true)
	wg.Wait()

	recs, st := audReadSet(t, path)
	byID := map[string]bool{}
	byPath := map[string]bool{}
	for _, r := range recs {
		if r.ID != "" {
			byID[r.ID] = true
		}
		if r.Kind == audit.KindRequest && r.Decision == audit.DecisionAllow && r.Path != "" {
			byPath[r.Host+r.Path] = true
		}
	}
	counts := map[string]int{}
	var missing []string
	for _, d := range completed {
		counts[d.op]++
		switch {
		case d.requestID != "" && !byID[d.requestID]:
			missing = append(missing, d.op+" id="+d.requestID)
		case d.path != "":
			host := "ok.test"
			if d.op == "intercepted" {
				host = "in.test"
			}
			if !byPath[host+d.path] {
				missing = append(missing, d.op+" "+host+d.path)
			}
		}
	}
	t.Logf("kill -9 after %s: %d complete responses %v, %d spliced, %d cut off; %d records, %d torn",
		time.Since(start).Round(time.Millisecond), len(completed), counts, spliced.Load(), failed.Load(), len(recs), st.Torn)
	if len(completed) < 20 || counts["allow"] == 0 || counts["deny"] == 0 || counts["intercepted"] == 0 || counts["connect-deny"] == 0 {
		t.Fatalf("the load did not exercise every kind of request before the kill: %v", counts)
	}
	if len(missing) > 0 {
		t.Errorf("%d requests got a complete response but have no audit record, e.g. %v", len(missing), missing[:min(len(missing), 10)])
	}

	out := audRequireVerified(t, path)
	if st.Torn > 0 && !strings.Contains(out, "partial final line") {
		t.Errorf("verify does not report the torn tail as a crash:\n%s", out)
	}
	if strings.Contains(out, "FAILED") {
		t.Errorf("verify reports tampering after a crash:\n%s", out)
	}
	if st.Torn == 0 {
		// The kill landed between writes (one write(2) per batch makes that
		// likely). Leave what a kill inside a write leaves, the start of
		// the next line, so the torn-tail path is always exercised.
		last := recs[len(recs)-1]
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(f, `{"v":1,"seq":%d,"prev":"%s","time":"2026-`, last.Seq+1, last.Hash)
		f.Close()
		out = audRequireVerified(t, path)
		if !strings.Contains(out, "partial final line") {
			t.Errorf("verify does not report the torn tail as a crash:\n%s", out)
		}
	}

	// A restart on the same log continues the chain (or, after a torn tail,
	// sets the damaged file aside and says so in the next header).
	p2 := w.start(t, block, path)
	if o := w.audFetchOnce(p2, fmt.Sprintf("http://ok.test:%d/after-restart", P)); !o.complete || o.status != 200 {
		t.Fatalf("request after restart: %+v", o)
	}
	p2.Stop(t)
	out = audRequireVerified(t, path)
	after, _ := audReadSet(t, path)
	var found bool
	var headers []string
	for _, r := range after {
		found = found || (r.Kind == audit.KindRequest && r.Path == "/after-restart")
		if r.Kind == audit.KindChain {
			headers = append(headers, r.Reason)
		}
	}
	if !found || len(after) <= len(recs) {
		t.Errorf("after restart: %d records (had %d), /after-restart recorded: %t\n%s", len(after), len(recs), found, out)
	}
	if len(headers) != 2 || headers[1] != audit.ChainTornTail || !strings.Contains(out, "partial line left by a crash") {
		t.Errorf("after restart on a torn log: chain headers %v, want [start torn_tail] and a note in verify:\n%s", headers, out)
	}
	t.Logf("verify after restart: %s", strings.TrimSpace(out))
}

// audMountTmpfs mounts a tmpfs of size (e.g. "64k") on a fresh directory and
// unmounts it at cleanup. Call it before newAuditWorld, so that the unmount
// runs after every sluice process has stopped and the leak scan has read
// the files.
func audMountTmpfs(t *testing.T, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size+",mode=0700"); err != nil {
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
			_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		}
	})
	return dir
}

// audFillUp writes a file until the filesystem is full and returns its path.
func audFillUp(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 1024)
	for range 4096 {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("filling the tmpfs: %v", err)
			}
			return path
		}
	}
	t.Fatal("the tmpfs never filled up")
	return ""
}

// audAdminGet fetches an admin endpoint.
func audAdminGet(t *testing.T, p *sluiceProc, path string) (int, string) {
	t.Helper()
	cl := &http.Client{Timeout: e2eTimeout}
	resp, err := cl.Get("http://" + p.AdminAddr + path)
	if err != nil {
		t.Fatalf("GET admin %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET admin %s: %v", path, err)
	}
	return resp.StatusCode, string(b)
}

// audLostTotal reads sluice_audit_lost_total from /metrics.
func audLostTotal(t *testing.T, p *sluiceProc) float64 {
	t.Helper()
	code, body := audAdminGet(t, p, "/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, "sluice_audit_lost_total "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("sluice_audit_lost_total %q: %v", v, err)
			}
			return f
		}
	}
	t.Fatalf("/metrics has no sluice_audit_lost_total:\n%s", body)
	return 0
}

// audWaitFor polls cond (bounded by e2eTimeout).
func audWaitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(e2eTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for %s", e2eTimeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// audGapRecords returns the audit_gap records of the set at path.
func audGapRecords(t *testing.T, path string) []audit.Record {
	t.Helper()
	recs, _ := audReadSet(t, path)
	var gaps []audit.Record
	for _, r := range recs {
		if r.Kind == audit.KindAuditGap {
			gaps = append(gaps, r)
		}
	}
	return gaps
}

// TestE2EAuditSinkFullClosed fills the audit log's filesystem under a
// running sluice with on_failure: closed, once per kind of response (a
// body of known length, a chunked body, HEAD, and requests inside an
// intercepted tunnel). From the first record that cannot be written on, no
// request completes: the one whose record failed is cut short, the next
// are refused with 503 audit_unavailable (CONNECT too), and /readyz says
// why. Once space is freed traffic flows again, and audit_gap records count
// what could not be written.
func TestE2EAuditSinkFullClosed(t *testing.T) {
	mnt := audMountTmpfs(t, "64k")
	w := newAuditWorld(t)
	path := filepath.Join(mnt, "audit.log")
	p := w.start(t, "  on_failure: closed\n  fsync: always\n", path)
	P, T, S := w.origin.Port, w.tls.Port, w.stream.Port

	var okPaths []string
	for i := range 2 {
		u := fmt.Sprintf("/warm/%d", i)
		if o := w.audFetchOnce(p, fmt.Sprintf("http://ok.test:%d%s", P, u)); !o.complete || o.status != 200 {
			t.Fatalf("warm-up request: %+v", o)
		}
		okPaths = append(okPaths, u)
	}
	phases := []struct {
		name   string
		method string
		url    string // with %d for the attempt
		tunnel bool
	}{
		{"GET", http.MethodGet, fmt.Sprintf("http://ok.test:%d/full/get/%%d", P), false},
		{"chunked GET", http.MethodGet, fmt.Sprintf("http://stream.test:%d/full/chunked/%%d", S), false},
		{"HEAD", http.MethodHead, fmt.Sprintf("http://ok.test:%d/full/head/%%d", P), false},
		{"GET in an intercepted tunnel", http.MethodGet, fmt.Sprintf("https://in.test:%d/full/tget/%%d", T), true},
		{"HEAD in an intercepted tunnel", http.MethodHead, fmt.Sprintf("https://in.test:%d/full/thead/%%d", T), true},
	}
	failedWrites, tunnels := 0, 0
	for _, ph := range phases {
		filler := audFillUp(t, mnt)
		// The file's last page may still have room for a few records.
		refused, cut, firstBad := 0, 0, -1
		for i := 0; i < 80 && (firstBad < 0 || i-firstBad < 3); i++ {
			u := fmt.Sprintf(ph.url, i)
			cl := w.client(p, e2eTimeout)
			o := audFetch(cl, ph.method, u)
			cl.CloseIdleConnections()
			if ph.tunnel {
				tunnels++
			}
			switch {
			case o.complete && o.status == 200:
				if firstBad >= 0 {
					t.Fatalf("%s: request %d completed after request %d could not be recorded", ph.name, i, firstBad)
				}
				okPaths = append(okPaths, u[strings.Index(u, "/full/"):])
				continue
			case o.complete && o.status == http.StatusServiceUnavailable && o.reason == "audit_unavailable":
				refused++
			case !o.complete:
				cut++ // its record failed, so the response was cut short (or the CONNECT refused)
			default:
				t.Fatalf("%s: request %d on a full disk: status %d reason %q (%.200q)", ph.name, i, o.status, o.reason, o.body)
			}
			if firstBad < 0 {
				firstBad = i
			}
		}
		if firstBad < 0 {
			t.Fatalf("%s: no request failed on a full disk", ph.name)
		}
		resp, body := p.Get(t, w.acme, fmt.Sprintf("http://ok.test:%d/full/check", P))
		checkDenial(t, ph.name+": GET on a full disk", resp, body, http.StatusServiceUnavailable, "audit_unavailable")
		refused++
		if o := audRawConnect(p.ProxyAddr, w.acme, fmt.Sprintf("in.test:%d", T)); o.status != http.StatusServiceUnavailable || o.reason != "audit_unavailable" {
			t.Errorf("%s: CONNECT on a full disk: status %d reason %q err %v", ph.name, o.status, o.reason, o.err)
		} else {
			refused++
		}
		if code, body := audAdminGet(t, p, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "audit") {
			t.Errorf("%s: /readyz on a full disk: %d %q", ph.name, code, body)
		}
		failedWrites += refused + cut
		if err := os.Remove(filler); err != nil {
			t.Fatal(err)
		}
		audWaitFor(t, "/readyz to recover after space was freed", func() bool {
			code, _ := audAdminGet(t, p, "/readyz")
			return code == 200
		})
		t.Logf("%s: %d completed before the disk filled, %d cut short, %d refused", ph.name, firstBad, cut, refused)
	}
	if o := w.audFetchOnce(p, fmt.Sprintf("http://ok.test:%d/after", P)); !o.complete || o.status != 200 {
		t.Fatalf("request after recovery: %+v", o)
	}
	okPaths = append(okPaths, "/after")
	p.Stop(t)

	recs, _ := audReadSet(t, path)
	seen := map[string]bool{}
	for _, r := range recs {
		if r.Kind == audit.KindRequest && r.Decision == audit.DecisionAllow {
			seen[r.Path] = true
			if r.Method == http.MethodHead && r.Message != "" {
				t.Errorf("HEAD %s recorded with message %q", r.Path, r.Message)
			}
		}
	}
	for _, u := range okPaths {
		if !seen[u] {
			t.Errorf("request %s completed but has no record", u)
		}
	}
	// Every failed write is in a gap record. A tunnel's own record is
	// written when it closes, which may fall inside or after an outage.
	gaps := audGapRecords(t, path)
	var lost uint64
	for _, g := range gaps {
		lost += g.Lost
		if !strings.Contains(g.Message, "refused") {
			t.Errorf("gap record under the closed policy says %q", g.Message)
		}
	}
	if len(gaps) < len(phases) || lost < uint64(failedWrites) || lost > uint64(failedWrites+tunnels) {
		t.Errorf("%d gap records losing %d; want %d or more, losing %d (+ up to %d tunnel records)", len(gaps), lost, len(phases), failedWrites, tunnels)
	}
	audRequireVerified(t, path)
}

// TestE2EAuditSinkFullOpen is the same with on_failure: open: requests keep
// completing, the loss is counted in sluice_audit_lost_total, and an
// audit_gap record with that count is written once space is freed, without
// new traffic.
func TestE2EAuditSinkFullOpen(t *testing.T) {
	mnt := audMountTmpfs(t, "64k")
	w := newAuditWorld(t)
	path := filepath.Join(mnt, "audit.log")
	p := w.start(t, "  on_failure: open\n  fsync: never\n", path)
	P := w.origin.Port
	url := func(s string) string { return fmt.Sprintf("http://ok.test:%d%s", P, s) }

	if o := w.audFetchOnce(p, url("/warm")); !o.complete || o.status != 200 {
		t.Fatalf("warm-up request: %+v", o)
	}
	filler := audFillUp(t, mnt)
	sent := 0
	for i := 0; i < 60 && audLostTotal(t, p) < 3; i++ {
		o := w.audFetchOnce(p, url(fmt.Sprintf("/open/%d", i)))
		if !o.complete || o.status != 200 {
			t.Fatalf("request %d on a full disk with on_failure open: status %d reason %q err %v", i, o.status, o.reason, o.err)
		}
		sent++
	}
	lost := audLostTotal(t, p)
	if lost < 3 {
		t.Fatalf("sluice_audit_lost_total is %v after %d requests on a full disk", lost, sent)
	}
	if code, body := audAdminGet(t, p, "/readyz"); code != 200 {
		t.Errorf("/readyz with on_failure open: %d %q; the proxy keeps serving, so it stays ready", code, body)
	}
	if len(audGapRecords(t, path)) != 0 {
		t.Fatal("a gap record exists before the disk has room")
	}
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	// No new traffic: the writer's retry records the gap by itself.
	audWaitFor(t, "the audit_gap record", func() bool { return len(audGapRecords(t, path)) > 0 })
	gaps := audGapRecords(t, path)
	if len(gaps) != 1 || float64(gaps[0].Lost) != lost {
		t.Errorf("gap records %+v; want one with lost=%v", gaps, lost)
	}
	if o := w.audFetchOnce(p, url("/after")); !o.complete || o.status != 200 {
		t.Fatalf("request after recovery: %+v", o)
	}
	p.Stop(t)
	audRequireVerified(t, path)
	t.Logf("open: %d requests served on a full disk, %v records lost and recorded as a gap", sent, lost)
}

// audCopySet copies every file of the audit set at path into a new directory
// and returns the copy of the active path and the copied files in order.
func audCopySet(t *testing.T, path string) (string, []string) {
	t.Helper()
	files, err := audit.ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, filepath.Base(f))
		if err := os.WriteFile(dst, b, 0o600); err != nil {
			t.Fatal(err)
		}
		out = append(out, dst)
	}
	return filepath.Join(dir, filepath.Base(path)), out
}

// audEditLine rewrites line n (1-based) of a plain or gzip file with edit.
func audEditLine(t *testing.T, file string, n int, edit func(string) string) {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	gz := strings.HasSuffix(file, ".gz")
	if gz {
		zr, err := gzip.NewReader(bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		if raw, err = io.ReadAll(zr); err != nil {
			t.Fatal(err)
		}
	}
	lines := strings.SplitAfter(string(raw), "\n")
	if n > len(lines) || lines[n-1] == "" {
		t.Fatalf("%s has no line %d", file, n)
	}
	changed := edit(lines[n-1])
	if changed == lines[n-1] {
		t.Fatalf("edit of %s:%d changed nothing: %s", file, n, lines[n-1])
	}
	lines[n-1] = changed
	data := []byte(strings.Join(lines, ""))
	if gz {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Write(data)
		zw.Close()
		data = b.Bytes()
	}
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestE2EAuditRotation rotates the log through the proxy (rotate_size at its
// 4 KiB minimum, compressed): `sluice logs verify` accepts the whole set,
// the reader lists every request across files, and a deleted middle file or
// an edited field (in a compressed file or the active one) is reported with
// its file and line.
func TestE2EAuditRotation(t *testing.T) {
	w := newAuditWorld(t)
	path := w.env.Path("rot/audit.log")
	p := w.start(t, "  on_failure: closed\n  fsync: interval\n  rotate_size: 4096\n  compress: true\n", path)
	P := w.origin.Port
	cl := w.client(p, e2eTimeout)
	const n = 40
	for i := range n {
		host := "ok.test"
		if i%4 == 3 {
			host = "no.test"
		}
		o := audFetch(cl, http.MethodGet, fmt.Sprintf("http://%s:%d/rot/%d", host, P, i))
		if !o.complete || (host == "ok.test" && o.status != 200) || (host == "no.test" && o.reason != "denied_by_rule") {
			t.Fatalf("request %d: %+v", i, o)
		}
	}
	cl.CloseIdleConnections()
	p.Stop(t) // closes the writer and waits for compression

	files, err := audit.ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 4 {
		t.Fatalf("rotate_size 4096 gave %d files for %d requests: %v", len(files), n, files)
	}
	for _, f := range files[:len(files)-1] {
		if !strings.HasSuffix(f, ".gz") {
			t.Errorf("rotated file %s was not compressed", filepath.Base(f))
		}
	}
	out := audRequireVerified(t, path)
	if want := fmt.Sprintf(" in %d files,", len(files)); !strings.Contains(out, want) {
		t.Errorf("verify output lacks %q:\n%s", want, out)
	}
	recs, _ := audReadSet(t, path)
	seen := map[string]audit.Decision{}
	headers := 0
	for _, r := range recs {
		if r.Kind == audit.KindChain {
			headers++
		}
		if r.Kind == audit.KindRequest {
			seen[r.Path] = r.Decision
		}
	}
	if headers != len(files) {
		t.Errorf("%d chain headers in %d files", headers, len(files))
	}
	for i := range n {
		want := audit.DecisionAllow
		if i%4 == 3 {
			want = audit.DecisionDeny
		}
		if got := seen[fmt.Sprintf("/rot/%d", i)]; got != want {
			t.Errorf("/rot/%d: decision %q in the rotated set, want %q", i, got, want)
		}
	}
	// The reviewer's listing reads the same set through the binary.
	js, errOut, code := runSluice(t, "", "logs", "--json", "--kind", "request", path)
	if code != 0 || strings.Count(js, "\n") != n {
		t.Errorf("sluice logs --json over the rotated set: exit %d, %d lines, want %d\n%s", code, strings.Count(js, "\n"), n, errOut)
	}

	t.Run("middle file deleted", func(t *testing.T) {
		active, copies := audCopySet(t, path)
		mid := len(copies) / 2
		if err := os.Remove(copies[mid]); err != nil {
			t.Fatal(err)
		}
		out, code := audVerifyCLI(t, active)
		next := copies[mid+1]
		if code != 1 || !strings.Contains(out, "FAILED") || !strings.Contains(out, "missing_file") || !strings.Contains(out, next+":1:") {
			t.Errorf("verify with %s deleted: exit %d, want 1 naming missing_file at %s:1\n%s", filepath.Base(copies[mid]), code, filepath.Base(next), out)
		}
	})
	t.Run("field edited in a compressed file", func(t *testing.T) {
		active, copies := audCopySet(t, path)
		f := copies[len(copies)/2]
		audEditLine(t, f, 3, func(l string) string { return strings.Replace(l, `"status":`, `"status":1`, 1) })
		out, code := audVerifyCLI(t, active)
		if code != 1 || !strings.Contains(out, f+":3: modified") {
			t.Errorf("verify with %s:3 edited: exit %d, want 1 naming it as modified\n%s", filepath.Base(f), code, out)
		}
	})
	t.Run("field edited in the active file", func(t *testing.T) {
		active, _ := audCopySet(t, path)
		audEditLine(t, active, 2, func(l string) string { return strings.Replace(l, `"tenant":"acme"`, `"tenant":"beta"`, 1) })
		out, code := audVerifyCLI(t, active)
		if code != 1 || !strings.Contains(out, active+":2: modified") {
			t.Errorf("verify with %s:2 edited: exit %d, want 1 naming it as modified\n%s", filepath.Base(active), code, out)
		}
	})
}
