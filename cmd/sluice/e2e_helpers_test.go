package main

// Helpers for end-to-end tests that drive the real `sluice serve` binary
// (built once by TestMain into sluiceBin) from the outside, the way a sandbox
// and an operator see it: a loopback DNS server, loopback origins that count
// what reaches them, credentials, clients through the proxy, a raw-TCP client
// for hostile input, and an audit reader. Every address these helpers dial or
// listen on is 127.0.0.1 or [::1]; other addresses only ever appear as DNS
// answers that the proxy must refuse before dialling.
//
// Typical use:
//
//	env := newE2EEnv(t)                       // temp dir; leak scan at cleanup
//	dns := startTestDNS(t, map[string][]string{"api.test": {"127.0.0.1"}})
//	origin := startHTTPOrigin(t, "127.0.0.1:0")
//	cred := env.StaticCredential("acme", "ci")
//	p := env.StartSluice(configYAML, sluiceOptions{Resolver: dns.Addr})
//	mark := p.AuditMark(t)
//	resp := p.Get(t, cred, "http://api.test:"+origin.PortString()+"/")
//	rec := p.ExpectRecord(t, mark, wantRecord{Decision: "allow", ...})
//
// Cleanup stops every sluice process with SIGTERM (it must exit 0), checks
// its audit file with `sluice logs verify`, and then scans its stderr, its audit files and every header an origin received for
// every credential, token and key the environment handed out.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
)

// e2eTimeout bounds every single wait in these helpers: process start, a
// request, an audit poll. It is generous because the binary under test runs
// with the race detector on a shared machine.
const e2eTimeout = 20 * time.Second

// ---------------------------------------------------------------------------
// Environment: temp dir, credentials, processes, leak scan.

// e2eEnv is one test's world. Everything it hands out that must stay secret
// (static credentials, tokens, the token key) is remembered, and at cleanup
// every sluice process's stderr and audit files and every header an origin
// saw are scanned for it.
type e2eEnv struct {
	t   *testing.T
	Dir string

	mu       sync.Mutex
	secrets  []string // needles that must appear nowhere we scan
	procs    []*sluiceProc
	origins  []*testOrigin
	keyPath  string
	tokenKey identity.Key
}

func newE2EEnv(t *testing.T) *e2eEnv {
	t.Helper()
	e := &e2eEnv{t: t, Dir: t.TempDir()}
	// Registered first, so it runs last: after origins have stopped and after
	// anything the test registered itself.
	t.Cleanup(e.cleanup)
	return e
}

// Path returns name inside the environment's directory.
func (e *e2eEnv) Path(name string) string { return filepath.Join(e.Dir, name) }

// MarkSecret adds a value that must never appear in logs, audit records or
// origin-side headers.
func (e *e2eEnv) MarkSecret(s string) {
	if s == "" {
		return
	}
	e.mu.Lock()
	e.secrets = append(e.secrets, s)
	e.mu.Unlock()
}

// testCredential is what a sandbox presents in its proxy URL.
type testCredential struct {
	User     string // tenant id
	Password string // static secret or minted token
	Hash     string // static credentials: the config's hash
	Name     string // static credentials: the config's credential name
}

// StaticCredential generates a fresh static credential for tenant. Put
// Hash (and Name) in the tenant's `credentials` in the config.
func (e *e2eEnv) StaticCredential(tenant, name string) testCredential {
	e.t.Helper()
	secret, err := identity.NewSecret()
	if err != nil {
		e.t.Fatal(err)
	}
	hash, err := identity.HashSecret(secret)
	if err != nil {
		e.t.Fatal(err)
	}
	c := testCredential{User: tenant, Password: secret, Hash: hash, Name: name}
	e.markCredential(c)
	return c
}

// Credential returns an arbitrary user/password pair (for refused
// credentials) and marks it secret like any other.
func (e *e2eEnv) Credential(user, password string) testCredential {
	c := testCredential{User: user, Password: password}
	e.markCredential(c)
	return c
}

func (e *e2eEnv) markCredential(c testCredential) {
	e.MarkSecret(c.Password)
	// A logged Proxy-Authorization header would show the base64 form.
	e.MarkSecret(base64.StdEncoding.EncodeToString([]byte(c.User + ":" + c.Password)))
}

// TokenKeyFile returns the path of the environment's token key file,
// generating it on first use. Pass it as sluiceOptions.TokenKey (or
// identity.token_key_file in the config).
func (e *e2eEnv) TokenKeyFile() string {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.keyPath != "" {
		return e.keyPath
	}
	path := filepath.Join(e.Dir, "token.key")
	if err := identity.GenerateKeyFile(path); err != nil {
		e.t.Fatal(err)
	}
	k, err := identity.LoadKeyFile(path)
	if err != nil {
		e.t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		e.t.Fatal(err)
	}
	e.secrets = append(e.secrets, hex.EncodeToString(raw), base64.StdEncoding.EncodeToString(raw),
		base64.RawURLEncoding.EncodeToString(raw))
	e.keyPath, e.tokenKey = path, k
	return path
}

// MintToken mints a sandbox token with the environment's key, issued at
// issued (zero: now) and valid for ttl.
func (e *e2eEnv) MintToken(tenant, sandbox string, ttl time.Duration, issued time.Time) testCredential {
	e.t.Helper()
	e.TokenKeyFile()
	if issued.IsZero() {
		issued = time.Now()
	}
	e.mu.Lock()
	key := e.tokenKey
	e.mu.Unlock()
	tok, err := identity.Mint(key, tenant, sandbox, ttl, issued)
	if err != nil {
		e.t.Fatal(err)
	}
	c := testCredential{User: tenant, Password: tok}
	e.markCredential(c)
	return c
}

// cleanup stops every process and scans everything for secrets.
func (e *e2eEnv) cleanup() {
	t := e.t
	e.mu.Lock()
	procs := append([]*sluiceProc(nil), e.procs...)
	origins := append([]*testOrigin(nil), e.origins...)
	secrets := append([]string(nil), e.secrets...)
	e.mu.Unlock()
	for _, p := range procs {
		p.Stop(t)
		// What a real run wrote must verify as a hash chain.
		if _, err := os.Stat(p.AuditPath); err == nil {
			if out, errOut, code := runSluice(t, "", "logs", "verify", p.AuditPath); code != 0 {
				t.Errorf("sluice logs verify %s: exit %d\n%s%s", filepath.Base(p.AuditPath), code, out, errOut)
			}
		}
	}
	hay := processOutputs(t, procs)
	for _, o := range origins {
		for _, r := range o.Seen() {
			var b bytes.Buffer
			_ = r.Header.Write(&b)
			b.WriteString(r.RequestURI)
			hay = append(hay, haystack{"request seen by origin " + o.Addr, b.Bytes()})
		}
	}
	for _, s := range secrets {
		for _, h := range hay {
			if bytes.Contains(h.data, []byte(s)) {
				// Name where, never what: the test log is a log too.
				t.Errorf("leak scan: a credential, token or key (length %d) appears in %s", len(s), h.name)
			}
		}
	}
	if len(secrets) > 0 && len(hay) > 0 {
		t.Logf("leak scan: %d secret values checked against %d outputs", len(secrets), len(hay))
	}
}

// haystack is one output a leak scan searches.
type haystack struct {
	name string
	data []byte
}

// processOutputs is everything the stopped processes wrote that a secret
// must never reach: their stderr and every audit file, rotated ones included.
func processOutputs(t *testing.T, procs []*sluiceProc) []haystack {
	t.Helper()
	var hay []haystack
	for _, p := range procs {
		hay = append(hay, haystack{"stderr of sluice (" + p.ProxyAddr + ")", []byte(p.Stderr())})
		files, _ := filepath.Glob(p.AuditPath + "*")
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Errorf("leak scan: reading %s: %v", f, err)
				continue
			}
			hay = append(hay, haystack{"audit file " + filepath.Base(f), b})
		}
	}
	return hay
}

// ---------------------------------------------------------------------------
// A sluice process.

// sluiceOptions are the flags a test passes to `sluice serve` besides the
// config, listen and admin addresses and the audit path.
type sluiceOptions struct {
	Listen     string   // --listen; default 127.0.0.1:0 (see freeLoopbackPort)
	Admin      string   // --admin; default 127.0.0.1:0
	Resolver   string   // --resolver ip:port (a startTestDNS server)
	TokenKey   string   // --token-key path (env.TokenKeyFile())
	UpstreamCA string   // --upstream-ca path (testPKI.CAFile)
	Args       []string // anything else
}

// sluiceProc is a running `sluice serve`.
type sluiceProc struct {
	ProxyAddr  string // host:port of the proxy listener
	AdminAddr  string // host:port of the admin listener
	AuditPath  string
	ConfigPath string

	cmd      *exec.Cmd
	stderr   *lockedBuffer
	waitDone chan struct{}
	waitErr  error
	stopOnce sync.Once
}

// StartSluice writes config to a fresh file in the environment and runs
// `sluice serve` on it with loopback listeners on free ports, a fresh audit
// file, and HTTP_PROXY/HTTPS_PROXY poisoned (pointing at a closed loopback
// port) to show the proxy ignores them for its own upstream traffic. It
// returns once the process logs "sluice serving".
func (e *e2eEnv) StartSluice(config string, o sluiceOptions) *sluiceProc {
	t := e.t
	t.Helper()
	e.mu.Lock()
	n := len(e.procs)
	e.mu.Unlock()
	p := &sluiceProc{
		ConfigPath: filepath.Join(e.Dir, fmt.Sprintf("sluice-%d.yaml", n)),
		AuditPath:  filepath.Join(e.Dir, fmt.Sprintf("audit-%d.jsonl", n)),
		stderr:     &lockedBuffer{},
		waitDone:   make(chan struct{}),
	}
	if err := os.WriteFile(p.ConfigPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	listen, admin := o.Listen, o.Admin
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	if admin == "" {
		admin = "127.0.0.1:0"
	}
	args := []string{"serve", "--config", p.ConfigPath, "--listen", listen, "--admin", admin, "--audit", p.AuditPath}
	if o.Resolver != "" {
		args = append(args, "--resolver", o.Resolver)
	}
	if o.TokenKey != "" {
		args = append(args, "--token-key", o.TokenKey)
	}
	if o.UpstreamCA != "" {
		args = append(args, "--upstream-ca", o.UpstreamCA)
	}
	args = append(args, o.Args...)
	cmd := exec.Command(sluiceBin, args...)
	cmd.Dir = e.Dir
	cmd.Env = append(filteredEnv(), "HTTP_PROXY=http://127.0.0.1:9", "HTTPS_PROXY=http://127.0.0.1:9",
		"http_proxy=http://127.0.0.1:9", "https_proxy=http://127.0.0.1:9", "NO_PROXY=", "no_proxy=")
	cmd.Stdout = io.Discard
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = pw
	if err := cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		t.Fatalf("starting sluice: %v", err)
	}
	pw.Close()
	p.cmd = cmd
	e.mu.Lock()
	e.procs = append(e.procs, p)
	e.mu.Unlock()

	serving := make(chan map[string]any, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		sent := false
		for sc.Scan() {
			line := sc.Bytes()
			p.stderr.Write(append(append([]byte(nil), line...), '\n'))
			if !sent && bytes.Contains(line, []byte(`"msg":"sluice serving"`)) {
				var m map[string]any
				if json.Unmarshal(line, &m) == nil {
					serving <- m
					sent = true
				}
			}
		}
		_, _ = io.Copy(p.stderr, pr) // a final over-long line, if any
		pr.Close()
	}()
	go func() {
		p.waitErr = cmd.Wait()
		close(p.waitDone)
	}()

	select {
	case m := <-serving:
		p.ProxyAddr, _ = m["listen"].(string)
		p.AdminAddr, _ = m["admin"].(string)
		if p.ProxyAddr == "" || p.AdminAddr == "" {
			t.Fatalf("sluice serving line has no listen/admin address:\n%s", p.Stderr())
		}
	case <-p.waitDone:
		t.Fatalf("sluice exited before serving (%v):\n%s", p.waitErr, p.Stderr())
	case <-time.After(e2eTimeout):
		t.Fatalf("sluice did not log \"sluice serving\" within %s:\n%s", e2eTimeout, p.Stderr())
	}
	return p
}

// filteredEnv is the test's environment without proxy variables, so the
// helpers decide exactly which ones the process sees.
func filteredEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch strings.ToUpper(k) {
		case "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY":
			continue
		}
		if strings.HasPrefix(k, "SLUICE_") {
			continue
		}
		out = append(out, kv)
	}
	return out
}

// Stop sends SIGTERM and requires a clean exit (status 0) within the bound.
// It is called by the environment's cleanup; calling it earlier is fine.
func (p *sluiceProc) Stop(t *testing.T) {
	t.Helper()
	p.stopOnce.Do(func() {
		select {
		case <-p.waitDone:
			t.Errorf("sluice exited on its own before Stop (%v):\n%s", p.waitErr, tail(p.Stderr(), 4000))
			return
		default:
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.waitDone:
			if p.waitErr != nil {
				t.Errorf("sluice did not exit cleanly on SIGTERM: %v\n%s", p.waitErr, tail(p.Stderr(), 4000))
			}
		case <-time.After(e2eTimeout):
			_ = p.cmd.Process.Kill()
			<-p.waitDone
			t.Errorf("sluice did not stop within %s of SIGTERM", e2eTimeout)
		}
	})
}

// Stderr is everything the process has written to stderr so far.
func (p *sluiceProc) Stderr() string { return p.stderr.String() }

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// ProxyURL is the proxy's URL with c in its userinfo (no userinfo for a
// zero credential).
func (p *sluiceProc) ProxyURL(c testCredential) *url.URL {
	u := &url.URL{Scheme: "http", Host: p.ProxyAddr}
	if c.User != "" || c.Password != "" {
		u.User = url.UserPassword(c.User, c.Password)
	}
	return u
}

// Client returns an HTTP client that goes through the proxy with c, never
// follows redirects (a test must see what the proxy returned) and gives up
// after e2eTimeout. tlsCfg, if not nil, is used for https:// URLs (which
// the client tunnels with CONNECT).
func (p *sluiceProc) Client(c testCredential, tlsCfg *tls.Config) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			Proxy:             http.ProxyURL(p.ProxyURL(c)),
			TLSClientConfig:   tlsCfg,
			ForceAttemptHTTP2: false,
			MaxIdleConns:      4,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Timeout:       e2eTimeout,
	}
}

// Do sends req through the proxy with c on a fresh connection and returns
// the response with its body read (and closed).
func (p *sluiceProc) Do(t *testing.T, c testCredential, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	cl := p.Client(c, nil)
	defer cl.CloseIdleConnections()
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatalf("%s %s through sluice: %v", req.Method, req.URL, err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("%s %s through sluice: reading body: %v", req.Method, req.URL, err)
	}
	return resp, body
}

// Get is Do for a GET of rawURL.
func (p *sluiceProc) Get(t *testing.T, c testCredential, rawURL string) (*http.Response, []byte) {
	t.Helper()
	return p.Do(t, c, newRequest(t, http.MethodGet, rawURL))
}

func newRequest(t *testing.T, method, rawURL string) *http.Request {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(ctx, method, rawURL, nil)
	if err != nil {
		t.Fatalf("request %s %s: %v", method, rawURL, err)
	}
	return req
}

// ---------------------------------------------------------------------------
// Denials.

// denial is sluice's JSON refusal body.
type denial struct {
	Error     string `json:"error"`
	Reason    string `json:"reason"`
	Host      string `json:"host"`
	Rule      string `json:"rule"`
	RequestID string `json:"request_id"`
}

// checkDenial asserts a refusal: status, the X-Sluice-Reason header and the
// JSON body's reason agree.
func checkDenial(t *testing.T, what string, resp *http.Response, body []byte, status int, reason string) denial {
	t.Helper()
	var d denial
	if resp.StatusCode != status {
		t.Errorf("%s: status %d, want %d (body %.300q)", what, resp.StatusCode, status, body)
	}
	if got := resp.Header.Get("X-Sluice-Reason"); got != reason {
		t.Errorf("%s: X-Sluice-Reason %q, want %q", what, got, reason)
	}
	if err := json.Unmarshal(body, &d); err != nil {
		t.Errorf("%s: denial body is not JSON: %v (%.300q)", what, err, body)
		return d
	}
	if d.Reason != reason {
		t.Errorf("%s: body reason %q, want %q", what, d.Reason, reason)
	}
	if d.RequestID == "" || d.RequestID != resp.Header.Get("X-Sluice-Request-Id") {
		t.Errorf("%s: request id %q in body vs %q in header", what, d.RequestID, resp.Header.Get("X-Sluice-Request-Id"))
	}
	return d
}

// ---------------------------------------------------------------------------
// Audit.

// Records returns every record in the process's audit file except the
// chain headers, in file order. A torn last line is ignored (it is being
// written); any other undecodable line fails the test.
func (p *sluiceProc) Records(t *testing.T) []audit.Record {
	t.Helper()
	data, err := os.ReadFile(p.AuditPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatalf("reading audit file: %v", err)
	}
	var out []audit.Record
	for len(data) > 0 {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			break // torn tail: still being written
		}
		line := data[:i]
		data = data[i+1:]
		var r audit.Record
		if err := json.Unmarshal(line, &r); err != nil {
			t.Fatalf("audit line is not a record: %v: %.200q", err, line)
		}
		if r.Kind == audit.KindChain {
			continue
		}
		out = append(out, r)
	}
	return out
}

// AuditMark is the number of records so far; pass it to WaitRecords or
// ExpectRecord to look only at what comes after.
func (p *sluiceProc) AuditMark(t *testing.T) int {
	t.Helper()
	return len(p.Records(t))
}

// WaitRecords polls (bounded) until at least n records exist after mark and
// returns all records after mark.
func (p *sluiceProc) WaitRecords(t *testing.T, mark, n int) []audit.Record {
	t.Helper()
	deadline := time.Now().Add(e2eTimeout)
	for {
		recs := p.Records(t)
		if len(recs)-mark >= n {
			return recs[mark:]
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for %d audit records after #%d, have %d", e2eTimeout, n, mark, len(recs)-mark)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// wantRecord is what a test expects of one audit record. Empty fields are
// not checked except Tenant, Rule and Host, which are compared always (use
// anyValue to skip one).
type wantRecord struct {
	Kind     audit.Kind // default: request
	Decision audit.Decision
	Reason   string
	Rule     string
	Tenant   string
	Sandbox  string // checked if set
	Host     string
	Port     int    // checked if set
	Path     string // checked if set
	Status   int
}

// anyValue skips the comparison of a string field of wantRecord.
const anyValue = "\x00any"

// ExpectRecord waits for the records after mark and requires exactly one,
// matching want. The proxy writes a request's record before the response
// completes, so when the client holds the whole response the record is
// there; the wait covers tunnels, whose records are written at close.
func (p *sluiceProc) ExpectRecord(t *testing.T, mark int, want wantRecord) audit.Record {
	t.Helper()
	recs := p.WaitRecords(t, mark, 1)
	if len(recs) != 1 {
		t.Errorf("want exactly one audit record, got %d:\n%s", len(recs), describeRecords(recs))
		if len(recs) == 0 {
			return audit.Record{}
		}
	}
	r := recs[0]
	checkRecord(t, r, want)
	return r
}

// ExpectRecords is ExpectRecord for a case that writes several records,
// in order: exactly len(wants) after mark.
func (p *sluiceProc) ExpectRecords(t *testing.T, mark int, wants ...wantRecord) []audit.Record {
	t.Helper()
	recs := p.WaitRecords(t, mark, len(wants))
	if len(recs) != len(wants) {
		t.Errorf("want exactly %d audit records, got %d:\n%s", len(wants), len(recs), describeRecords(recs))
	}
	for i := range min(len(recs), len(wants)) {
		checkRecord(t, recs[i], wants[i])
	}
	return recs
}

func checkRecord(t *testing.T, r audit.Record, want wantRecord) {
	t.Helper()
	kind := want.Kind
	if kind == "" {
		kind = audit.KindRequest
	}
	var diffs []string
	cmp := func(field, got, w string) {
		if w != anyValue && got != w {
			diffs = append(diffs, fmt.Sprintf("%s=%q want %q", field, got, w))
		}
	}
	cmp("kind", string(r.Kind), string(kind))
	cmp("decision", string(r.Decision), string(want.Decision))
	cmp("reason", r.Reason, want.Reason)
	cmp("rule", r.Rule, want.Rule)
	cmp("tenant", r.Tenant, want.Tenant)
	cmp("host", r.Host, want.Host)
	if want.Sandbox != "" {
		cmp("sandbox", r.Sandbox, want.Sandbox)
	}
	if want.Path != "" {
		cmp("path", r.Path, want.Path)
	}
	if want.Port != 0 && r.Port != want.Port {
		diffs = append(diffs, fmt.Sprintf("port=%d want %d", r.Port, want.Port))
	}
	if r.Status != want.Status {
		diffs = append(diffs, fmt.Sprintf("status=%d want %d", r.Status, want.Status))
	}
	if r.V != audit.SchemaVersion || r.ID == "" || r.Time.IsZero() || r.Hash == "" {
		diffs = append(diffs, fmt.Sprintf("envelope v=%d id=%q time=%v hash=%q", r.V, r.ID, r.Time, r.Hash))
	}
	if len(diffs) > 0 {
		t.Errorf("audit record %s: %s", r.ID, strings.Join(diffs, ", "))
	}
}

func describeRecords(recs []audit.Record) string {
	var b strings.Builder
	for _, r := range recs {
		fmt.Fprintf(&b, "  %s %s %s tenant=%s host=%s:%d path=%s rule=%s reason=%s status=%d msg=%q\n",
			r.ID, r.Kind, r.Decision, r.Tenant, r.Host, r.Port, r.Path, r.Rule, r.Reason, r.Status, r.Message)
	}
	return b.String()
}

// ---------------------------------------------------------------------------
// DNS.

// testDNS is a loopback DNS server (UDP and TCP on the same port) that
// answers A and AAAA queries from a map; other names are NXDOMAIN.
type testDNS struct {
	Addr    string // 127.0.0.1:port, for --resolver
	mu      sync.Mutex
	answers map[string][]netip.Addr
	queries atomic.Int64
}

// startTestDNS starts the server with answers: name → addresses (IPv4
// addresses answer A queries, IPv6 ones AAAA; "::ffff:a.b.c.d" is an AAAA
// answer carrying a mapped IPv4 address).
func startTestDNS(t *testing.T, answers map[string][]string) *testDNS {
	t.Helper()
	d := &testDNS{answers: make(map[string][]netip.Addr)}
	for name, addrs := range answers {
		d.Set(t, name, addrs...)
	}
	var udp net.PacketConn
	var tcp net.Listener
	for attempt := 0; ; attempt++ {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", pc.LocalAddr().String())
		if err == nil {
			udp, tcp = pc, ln
			break
		}
		pc.Close()
		if attempt == 20 {
			t.Fatalf("no port free for both UDP and TCP: %v", err)
		}
	}
	d.Addr = udp.LocalAddr().String()
	h := dns.HandlerFunc(d.serve)
	us := &dns.Server{PacketConn: udp, Handler: h}
	ts := &dns.Server{Listener: tcp, Handler: h}
	go func() { _ = us.ActivateAndServe() }()
	go func() { _ = ts.ActivateAndServe() }()
	t.Cleanup(func() {
		_ = us.Shutdown()
		_ = ts.Shutdown()
	})
	return d
}

// Set replaces the answers for name.
func (d *testDNS) Set(t *testing.T, name string, addrs ...string) {
	t.Helper()
	var as []netip.Addr
	for _, s := range addrs {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Fatalf("testDNS: %v", err)
		}
		as = append(as, a)
	}
	d.mu.Lock()
	d.answers[dns.Fqdn(strings.ToLower(name))] = as
	d.mu.Unlock()
}

// Queries is the number of questions answered so far.
func (d *testDNS) Queries() int64 { return d.queries.Load() }

func (d *testDNS) serve(w dns.ResponseWriter, q *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(q)
	m.Authoritative = true
	if len(q.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		_ = w.WriteMsg(m)
		return
	}
	d.queries.Add(1)
	qn := q.Question[0]
	name := strings.ToLower(qn.Name)
	d.mu.Lock()
	addrs, ok := d.answers[name]
	d.mu.Unlock()
	if !ok {
		m.Rcode = dns.RcodeNameError
		_ = w.WriteMsg(m)
		return
	}
	hdr := dns.RR_Header{Name: qn.Name, Class: dns.ClassINET, Ttl: 1}
	for _, a := range addrs {
		switch {
		case qn.Qtype == dns.TypeA && a.Is4():
			hdr.Rrtype = dns.TypeA
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IP(a.AsSlice())})
		case qn.Qtype == dns.TypeAAAA && a.Is6():
			hdr.Rrtype = dns.TypeAAAA
			b := a.As16()
			m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: net.IP(b[:])})
		}
	}
	_ = w.WriteMsg(m)
}

// ---------------------------------------------------------------------------
// Origins.

// testOrigin is an HTTP or HTTPS server on loopback that counts accepted
// TCP connections, TLS ClientHellos and requests, and keeps a copy of every
// request head it received. Its handler:
//
//	/redirect      302 to http://elsewhere.test/landing
//	anything else  200 with a JSON echo (originEcho) of the request
type testOrigin struct {
	Addr string // host:port
	Port int

	accepts  atomic.Int64
	hellos   atomic.Int64
	requests atomic.Int64
	mu       sync.Mutex
	seen     []seenRequest
	srv      *http.Server
}

// seenRequest is one request as the origin received it.
type seenRequest struct {
	Method     string
	Host       string
	RequestURI string
	Header     http.Header
}

// originEcho is the origin's 200 body.
type originEcho struct {
	Method     string      `json:"method"`
	Host       string      `json:"host"`
	RequestURI string      `json:"request_uri"`
	Header     http.Header `json:"header"`
}

// startHTTPOrigin starts a plain HTTP origin on addr ("127.0.0.1:0" or
// "[::1]:0").
func startHTTPOrigin(t *testing.T, addr string) *testOrigin {
	t.Helper()
	return startOrigin(t, addr, nil)
}

// startTLSOrigin starts an HTTPS origin on addr with a leaf for names from
// pki; it counts ClientHellos separately from TCP accepts.
func startTLSOrigin(t *testing.T, addr string, pki *testPKI, names ...string) *testOrigin {
	t.Helper()
	return startOrigin(t, addr, pki.ServerConfig(t, names...))
}

func startOrigin(t *testing.T, addr string, tlsCfg *tls.Config) *testOrigin {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("origin listen %s: %v", addr, err)
	}
	o := &testOrigin{Addr: ln.Addr().String(), Port: ln.Addr().(*net.TCPAddr).Port}
	var l net.Listener = &countingListener{Listener: ln, n: &o.accepts}
	if tlsCfg != nil {
		cfg := tlsCfg.Clone()
		base := tlsCfg
		cfg.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
			o.hellos.Add(1)
			return base, nil
		}
		l = tls.NewListener(l, cfg)
	}
	// ErrorLog discards: a refused tunnel leaves the origin a connection
	// that closes before its handshake, which is expected here.
	o.srv = &http.Server{Handler: http.HandlerFunc(o.serve), ReadHeaderTimeout: 10 * time.Second, ErrorLog: log.New(io.Discard, "", 0)}
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

// Track registers the origin with env so that what it saw is part of the
// leak scan. (Origins are independent of an environment otherwise.)
func (e *e2eEnv) Track(o *testOrigin) *testOrigin {
	e.mu.Lock()
	e.origins = append(e.origins, o)
	e.mu.Unlock()
	return o
}

func (o *testOrigin) serve(w http.ResponseWriter, r *http.Request) {
	o.requests.Add(1)
	o.mu.Lock()
	o.seen = append(o.seen, seenRequest{Method: r.Method, Host: r.Host, RequestURI: r.RequestURI, Header: r.Header.Clone()})
	o.mu.Unlock()
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
	if r.URL.Path == "/redirect" {
		w.Header().Set("Location", "http://elsewhere.test/landing")
		w.WriteHeader(http.StatusFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(originEcho{Method: r.Method, Host: r.Host, RequestURI: r.RequestURI, Header: r.Header})
}

// PortString is the origin's port as a string.
func (o *testOrigin) PortString() string { return strconv.Itoa(o.Port) }

// Accepts is the number of TCP connections accepted so far.
func (o *testOrigin) Accepts() int64 { return o.accepts.Load() }

// Hellos is the number of TLS ClientHellos received so far (TLS origins).
func (o *testOrigin) Hellos() int64 { return o.hellos.Load() }

// Requests is the number of HTTP requests served so far.
func (o *testOrigin) Requests() int64 { return o.requests.Load() }

// Seen returns a copy of every request head received so far.
func (o *testOrigin) Seen() []seenRequest {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]seenRequest(nil), o.seen...)
}

// countingListener counts accepted connections.
type countingListener struct {
	net.Listener
	n *atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// freeLoopbackPort returns a TCP port on 127.0.0.1 that was free a moment
// ago, for a config that must name sluice's own port before it starts.
func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startCountingListener accepts TCP connections on addr, counts them and
// closes them at once; for asserting that nothing connects.
func startCountingListener(t *testing.T, addr string) (*net.TCPAddr, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	var n atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln.Addr().(*net.TCPAddr), &n
}

// ---------------------------------------------------------------------------
// Test PKI for HTTPS origins.

// testPKI is a throwaway CA for origins; CAFile is its PEM certificate (for
// --upstream-ca) and Pool trusts it (for clients that tunnel end to end).
type testPKI struct {
	CAFile string
	Pool   *x509.CertPool
	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
}

func newTestPKI(t *testing.T, dir string) *testPKI {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "sluice e2e origin CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "origin-ca.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testPKI{CAFile: path, Pool: pool, cert: cert, key: key}
}

// ServerConfig returns a TLS server config with a leaf for names (DNS names
// or IP literals) signed by the CA.
func (p *testPKI) ServerConfig(t *testing.T, names ...string) *tls.Config {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "sluice e2e origin"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.cert, &key.PublicKey, p.key)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		MinVersion:   tls.VersionTLS12,
		NextProtos:   []string{"http/1.1"},
	}
}

// ClientConfig trusts the CA and names serverName in the ClientHello.
func (p *testPKI) ClientConfig(serverName string) *tls.Config {
	return &tls.Config{RootCAs: p.Pool, ServerName: serverName, MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}
}

// ---------------------------------------------------------------------------
// Raw TCP.

// proxyAuthorization is the Proxy-Authorization value for c.
func proxyAuthorization(c testCredential) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(c.User+":"+c.Password))
}

// DialRaw opens a plain TCP connection to the proxy with an overall
// deadline of e2eTimeout; it is closed at cleanup.
func (p *sluiceProc) DialRaw(t *testing.T) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", p.ProxyAddr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial sluice: %v", err)
	}
	_ = c.SetDeadline(time.Now().Add(e2eTimeout))
	t.Cleanup(func() { c.Close() })
	return c
}

// rawResult is what a raw exchange produced: a parsed response, or the
// connection ending without one.
type rawResult struct {
	Resp   *http.Response
	Body   []byte
	Err    error // reading the response failed (closed, reset)
	Closed bool  // the proxy closed the connection (EOF or reset) without a full response
}

// RawExchange writes payload on a fresh connection (concurrently with
// reading, since the proxy may answer and close before taking all of it)
// and reads one response.
func (p *sluiceProc) RawExchange(t *testing.T, payload []byte) rawResult {
	t.Helper()
	c := p.DialRaw(t)
	go func() { _, _ = c.Write(payload) }()
	return readRawResponse(c, nil)
}

func readRawResponse(c net.Conn, req *http.Request) rawResult {
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		return rawResult{Err: err, Closed: isClosedErr(err)}
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	return rawResult{Resp: resp, Body: body, Err: err}
}

func isClosedErr(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed)
}

// Connect sends a CONNECT for target with c and reads the proxy's answer.
// On 200 the returned connection is the tunnel; otherwise it is closed.
func (p *sluiceProc) Connect(t *testing.T, c testCredential, target string) (net.Conn, *http.Response, []byte) {
	t.Helper()
	conn := p.DialRaw(t)
	var b strings.Builder
	fmt.Fprintf(&b, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n", target, target)
	if c.User != "" || c.Password != "" {
		fmt.Fprintf(&b, "Proxy-Authorization: %s\r\n", proxyAuthorization(c))
	}
	b.WriteString("\r\n")
	if _, err := io.WriteString(conn, b.String()); err != nil {
		t.Fatalf("CONNECT %s: %v", target, err)
	}
	// Read the head byte-exact: after a 200 the tunnel's bytes follow, and a
	// buffered reader must not swallow them.
	br := bufio.NewReaderSize(&oneByteReader{conn}, 16)
	req := &http.Request{Method: http.MethodConnect}
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		t.Fatalf("CONNECT %s: reading response: %v", target, err)
	}
	if resp.StatusCode == http.StatusOK {
		return conn, resp, nil
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	conn.Close()
	return nil, resp, body
}

// oneByteReader reads one byte at a time so bufio never reads past a
// response head.
type oneByteReader struct{ r io.Reader }

func (o *oneByteReader) Read(p []byte) (int, error) {
	if len(p) > 1 {
		p = p[:1]
	}
	return o.r.Read(p)
}

// lockedBuffer is a bytes.Buffer safe for one writer and many readers.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
