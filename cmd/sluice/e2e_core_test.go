package main

// End-to-end acceptance tests for the proxy core (issue "Proxy core"),
// through the real `sluice serve` binary: allow/deny for every rule kind,
// report mode, authentication, netguard, CONNECT, hostile framing, redirects
// and upstream connection reuse. Every case checks the status, the reason
// (header and JSON body) and exactly one audit record; every test's cleanup
// scans stderr, the audit log and what origins received for the credentials
// it used.

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/audit"
)

// coreWorld is the shared setup of the core tests: one DNS server, origins
// on loopback, credentials for four tenants, and a running sluice.
type coreWorld struct {
	env    *e2eEnv
	dns    *testDNS
	origin *testOrigin // HTTP on 127.0.0.1
	v6     *testOrigin // HTTP on [::1]
	tls    *testOrigin // HTTPS on 127.0.0.1 (exact.test, a.example.test)
	pki    *testPKI
	p      *sluiceProc

	proxyPort, adminPort int // sluice's own ports, chosen before it starts

	acme, beta, reporter, strict testCredential
}

// coreConfig is the policy every core test runs with. Names resolve through
// the test DNS server; acme, beta and reporter may reach 127.0.0.0/8 and
// ::1 (where the origins are), strict may reach no private range at all.
func coreConfig(w *coreWorld) string {
	P, T, S := w.origin.Port, w.tls.Port, w.v6.Port
	return fmt.Sprintf(`version: 1
server:
  read_header_timeout: 1s
  idle_timeout: 10s
  dial_timeout: 3s
  upstream_timeout: 10s
  shutdown_timeout: 5s
  max_header_bytes: 64KiB
  max_header_count: 100
audit:
  on_failure: closed
  fsync: never
identity:
  revoked: [revoked-sbx]
limits:
  auth_failures_per_minute: 10000
tenants:
  - id: acme
    credentials:
      - name: %[4]s
        hash: %[5]s
    allow_private_cidrs: [127.0.0.0/8, "::1/128"]
    allow:
      - id: acme-exact
        host: exact.test
        ports: [%[1]d, %[2]d]
      - id: acme-wild
        host: "*.example.test"
        ports: [%[1]d, %[2]d]
      - id: acme-methods
        host: methods.test
        ports: [%[1]d]
        methods: [GET, HEAD]
      - id: acme-paths
        host: paths.test
        ports: [%[1]d]
        paths: ["/api/**", "/b", "/one/*"]
      - id: acme-corp
        host: "*.corp.test"
        ports: [%[1]d]
      - id: acme-self
        host: self.test
        ports: [%[12]d, %[13]d]
    deny:
      # A deny rule's ports default to [80, 443] like an allow rule's, so
      # it must name the port the wildcard allow opens.
      - id: acme-deny-admin-host
        host: admin.corp.test
        ports: [%[1]d]
      - id: acme-deny-api-admin
        host: paths.test
        ports: [%[1]d]
        paths: ["/api/admin/**"]
  - id: beta
    credentials:
      - name: %[6]s
        hash: %[7]s
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: beta-only
        host: beta.test
        ports: [%[1]d]
  - id: reporter
    mode: report
    credentials:
      - name: %[8]s
        hash: %[9]s
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: reporter-exact
        host: exact.test
        ports: [%[1]d]
  - id: strict
    credentials:
      - name: %[10]s
        hash: %[11]s
    allow:
      - id: strict-guard
        host: "*.guard.test"
        ports: [%[1]d, %[3]d]
`, P, T, S,
		w.acme.Name, w.acme.Hash, w.beta.Name, w.beta.Hash,
		w.reporter.Name, w.reporter.Hash, w.strict.Name, w.strict.Hash,
		w.proxyPort, w.adminPort)
}

// newCoreWorld starts everything the core tests need.
func newCoreWorld(t *testing.T) *coreWorld {
	t.Helper()
	env := newE2EEnv(t)
	w := &coreWorld{env: env, pki: newTestPKI(t, env.Dir)}
	w.dns = startTestDNS(t, map[string][]string{
		"exact.test":       {"127.0.0.1"},
		"sub.exact.test":   {"127.0.0.1"},
		"example.test":     {"127.0.0.1"},
		"a.example.test":   {"127.0.0.1"},
		"a.b.example.test": {"127.0.0.1"},
		"evilexample.test": {"127.0.0.1"},
		"ten.example.test": {"10.0.0.1"},
		"methods.test":     {"127.0.0.1"},
		"paths.test":       {"127.0.0.1"},
		"www.corp.test":    {"127.0.0.1"},
		"admin.corp.test":  {"127.0.0.1"},
		"beta.test":        {"127.0.0.1"},
		"unlisted.test":    {"127.0.0.1"},
		"elsewhere.test":   {"127.0.0.1"},
		"self.test":        {"127.0.0.1"},
		"ten.report.test":  {"10.0.0.1"},
		// strict has no private exceptions: every one of these must be
		// refused by the guard before it dials.
		"loop.guard.test":   {"127.0.0.1"},
		"ten.guard.test":    {"10.0.0.1"},
		"meta.guard.test":   {"169.254.169.254"},
		"six.guard.test":    {"::1"},
		"mapped.guard.test": {"::ffff:127.0.0.1"},
	})
	w.origin = env.Track(startHTTPOrigin(t, "127.0.0.1:0"))
	w.v6 = env.Track(startHTTPOrigin(t, "[::1]:0"))
	w.tls = env.Track(startTLSOrigin(t, "127.0.0.1:0", w.pki, "exact.test", "a.example.test"))
	w.acme = env.StaticCredential("acme", "acme-ci")
	w.beta = env.StaticCredential("beta", "beta-ci")
	w.reporter = env.StaticCredential("reporter", "reporter-ci")
	w.strict = env.StaticCredential("strict", "strict-ci")
	w.proxyPort, w.adminPort = freeLoopbackPort(t), freeLoopbackPort(t)
	w.p = env.StartSluice(coreConfig(w), sluiceOptions{
		Listen: fmt.Sprintf("127.0.0.1:%d", w.proxyPort), Admin: fmt.Sprintf("127.0.0.1:%d", w.adminPort),
		Resolver: w.dns.Addr, TokenKey: env.TokenKeyFile(), UpstreamCA: w.pki.CAFile,
	})
	return w
}

// url is http://host:port path on the plain origin's port.
func (w *coreWorld) url(host, path string) string {
	return fmt.Sprintf("http://%s:%d%s", host, w.origin.Port, path)
}

// originSaw returns the last request the plain origin received.
func (w *coreWorld) originSaw(t *testing.T) seenRequest {
	t.Helper()
	seen := w.origin.Seen()
	if len(seen) == 0 {
		t.Fatal("origin received nothing")
	}
	return seen[len(seen)-1]
}

type ruleCase struct {
	name     string
	method   string
	host     string
	port     int // 0: the plain origin's port
	path     string
	status   int
	reason   string // "" for an allowed request
	rule     string
	recPath  string // the normalised path in the record ("" = path as sent)
	seenPath string // what the origin must receive (allowed cases; "" = path as sent)
}

func TestE2ERuleKinds(t *testing.T) {
	w := newCoreWorld(t)
	P := w.origin.Port
	cases := []ruleCase{
		// Exact host and port.
		{name: "exact host", host: "exact.test", path: "/", status: 200, rule: "acme-exact"},
		{name: "exact host, trailing dot and upper case", host: "EXACT.test.", path: "/x", status: 200, rule: "acme-exact"},
		{name: "exact host does not cover subdomains", host: "sub.exact.test", path: "/", status: 403, reason: "not_allowlisted"},
		{name: "exact host, port not allowed", host: "exact.test", port: w.v6.Port, path: "/", status: 403, reason: "not_allowlisted"},
		// Wildcards.
		{name: "wildcard, one label", host: "a.example.test", path: "/", status: 200, rule: "acme-wild"},
		{name: "wildcard, two labels", host: "a.b.example.test", path: "/", status: 200, rule: "acme-wild"},
		{name: "wildcard does not cover the apex", host: "example.test", path: "/", status: 403, reason: "not_allowlisted"},
		{name: "wildcard is not a suffix match", host: "evilexample.test", path: "/", status: 403, reason: "not_allowlisted"},
		// Methods.
		{name: "method allowed", method: "GET", host: "methods.test", path: "/", status: 200, rule: "acme-methods"},
		{name: "method HEAD allowed", method: "HEAD", host: "methods.test", path: "/", status: 200, rule: "acme-methods"},
		{name: "method not allowed", method: "POST", host: "methods.test", path: "/", status: 403, reason: "not_allowlisted"},
		{name: "method DELETE not allowed", method: "DELETE", host: "methods.test", path: "/", status: 403, reason: "not_allowlisted"},
		// Paths.
		{name: "path under /api/**", host: "paths.test", path: "/api/v1/items", status: 200, rule: "acme-paths"},
		{name: "path /api itself", host: "paths.test", path: "/api", status: 200, rule: "acme-paths"},
		{name: "path /apix is not under /api/**", host: "paths.test", path: "/apix", status: 403, reason: "not_allowlisted"},
		{name: "path exact /b", host: "paths.test", path: "/b", status: 200, rule: "acme-paths"},
		{name: "path /b/c is not /b", host: "paths.test", path: "/b/c", status: 403, reason: "not_allowlisted"},
		{name: "path one segment", host: "paths.test", path: "/one/x", status: 200, rule: "acme-paths"},
		{name: "path two segments under /one/*", host: "paths.test", path: "/one/x/y", status: 403, reason: "not_allowlisted"},
		{name: "dot segments resolve before matching", host: "paths.test", path: "/a/../b", status: 200, rule: "acme-paths", recPath: "/b", seenPath: "/b"},
		{name: "encoded dot segments resolve before matching", host: "paths.test", path: "/a/%2e%2e/b", status: 200, rule: "acme-paths", recPath: "/b", seenPath: "/b"},
		{name: "escape from /api/** with ..", host: "paths.test", path: "/api/../secret", status: 403, reason: "not_allowlisted", recPath: "/secret"},
		{name: "escape from /api/** with %2e%2e", host: "paths.test", path: "/api/%2E%2e/secret", status: 403, reason: "not_allowlisted", recPath: "/secret"},
		{name: "encoded slash is ambiguous", host: "paths.test", path: "/api/admin%2fusers", status: 403, reason: "ambiguous_path", recPath: anyValue},
		{name: "encoded backslash is ambiguous", host: "paths.test", path: "/api/..%5cadmin", status: 403, reason: "ambiguous_path", recPath: anyValue},
		{name: "empty segment is ambiguous", host: "paths.test", path: "/api//admin/x", status: 403, reason: "ambiguous_path", recPath: anyValue},
		// Deny beats allow.
		{name: "deny path beats allow", host: "paths.test", path: "/api/admin/users", status: 403, reason: "denied_by_rule", rule: "acme-deny-api-admin"},
		{name: "deny via dot segments", host: "paths.test", path: "/api/v1/%2e%2e/admin/users", status: 403, reason: "denied_by_rule", rule: "acme-deny-api-admin", recPath: "/api/admin/users"},
		{name: "wildcard allow, sibling", host: "www.corp.test", path: "/", status: 200, rule: "acme-corp"},
		{name: "deny host beats wildcard allow", host: "admin.corp.test", path: "/", status: 403, reason: "denied_by_rule", rule: "acme-deny-admin-host"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			method := c.method
			if method == "" {
				method = http.MethodGet
			}
			port := c.port
			if port == 0 {
				port = P
			}
			u := fmt.Sprintf("http://%s:%d%s", c.host, port, c.path)
			before := w.origin.Requests()
			mark := w.p.AuditMark(t)
			resp, body := w.p.Do(t, w.acme, newRequest(t, method, u))
			host := strings.TrimSuffix(strings.ToLower(c.host), ".")
			recPath := c.recPath
			if recPath == "" {
				recPath = c.path
			}
			if c.reason == "" {
				if resp.StatusCode != c.status {
					t.Fatalf("status %d, want %d: %.300s", resp.StatusCode, c.status, body)
				}
				if resp.Header.Get("X-Sluice-Reason") != "" {
					t.Errorf("allowed response carries X-Sluice-Reason %q", resp.Header.Get("X-Sluice-Reason"))
				}
				if got := w.origin.Requests() - before; got != 1 {
					t.Fatalf("origin served %d requests, want 1", got)
				}
				seen := w.originSaw(t)
				want := c.seenPath
				if want == "" {
					want = c.path
				}
				if seen.RequestURI != want {
					t.Errorf("origin received %q, want %q (the proxy must forward the path it decided on)", seen.RequestURI, want)
				}
				if seen.Method != method {
					t.Errorf("origin received method %s", seen.Method)
				}
				w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: c.rule,
					Tenant: "acme", Host: host, Port: port, Path: recPath, Status: c.status})
				return
			}
			if method == http.MethodHead {
				t.Fatal("test table error: a HEAD denial has no body to check")
			}
			checkDenial(t, c.name, resp, body, c.status, c.reason)
			if got := w.origin.Requests() - before; got != 0 {
				t.Errorf("origin served %d requests for a denied request", got)
			}
			w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: c.reason, Rule: c.rule,
				Tenant: "acme", Host: host, Port: port, Path: recPath, Status: c.status})
		})
	}
}

func TestE2EReportMode(t *testing.T) {
	w := newCoreWorld(t)

	// A host no rule names: enforce would deny, report lets it through.
	mark := w.p.AuditMark(t)
	before := w.origin.Requests()
	resp, body := w.p.Get(t, w.reporter, w.url("unlisted.test", "/report"))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("report mode: status %d, want 200: %.300s", resp.StatusCode, body)
	}
	if w.origin.Requests()-before != 1 {
		t.Fatal("report mode: the origin was not reached")
	}
	rec := w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionWouldDeny, Reason: "not_allowlisted",
		Tenant: "reporter", Host: "unlisted.test", Path: "/report", Status: 200})
	if rec.Mode != "report" {
		t.Errorf("record mode %q, want report", rec.Mode)
	}

	// Report mode relaxes the policy, never the guard: a name that resolves
	// to an address outside the tenant's exceptions is still refused.
	mark = w.p.AuditMark(t)
	resp, body = w.p.Get(t, w.reporter, w.url("ten.report.test", "/"))
	checkDenial(t, "report mode, 10.0.0.1", resp, body, 403, "destination_not_permitted")
	w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "destination_not_permitted",
		Tenant: "reporter", Host: "ten.report.test", Status: 403})

	// An allowlisted host in report mode is a plain allow.
	mark = w.p.AuditMark(t)
	resp, body = w.p.Get(t, w.reporter, w.url("exact.test", "/"))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("report mode, allowed host: status %d: %.300s", resp.StatusCode, body)
	}
	w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "reporter-exact",
		Tenant: "reporter", Host: "exact.test", Status: 200})

	// Report mode never lets a bad destination through: an ambiguous host
	// spelling is refused whatever the mode.
	mark = w.p.AuditMark(t)
	resp, body = w.p.Get(t, w.reporter, fmt.Sprintf("http://2130706433:%d/", w.origin.Port))
	checkDenial(t, "report mode, numeric host", resp, body, 403, "invalid_host")
	w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "invalid_host", Tenant: "reporter", Status: 403})
}

func TestE2EAuthentication(t *testing.T) {
	w := newCoreWorld(t)
	env := w.env

	t.Run("static credential reaches own allowlist only", func(t *testing.T) {
		mark := w.p.AuditMark(t)
		resp, body := w.p.Get(t, w.beta, w.url("beta.test", "/"))
		if resp.StatusCode != 200 {
			t.Fatalf("beta to beta.test: %d %.300s", resp.StatusCode, body)
		}
		w.p.ExpectRecord(t, mark, wantRecord{Decision: "allow", Reason: "allowed", Rule: "beta-only", Tenant: "beta",
			Sandbox: "static:" + w.beta.Name, Host: "beta.test", Status: 200})

		// acme's credential never reaches beta's allowlist, and beta's never acme's.
		mark = w.p.AuditMark(t)
		resp, body = w.p.Get(t, w.acme, w.url("beta.test", "/"))
		checkDenial(t, "acme to beta.test", resp, body, 403, "not_allowlisted")
		w.p.ExpectRecord(t, mark, wantRecord{Decision: "deny", Reason: "not_allowlisted", Tenant: "acme", Host: "beta.test", Status: 403})

		mark = w.p.AuditMark(t)
		resp, body = w.p.Get(t, w.beta, w.url("exact.test", "/"))
		checkDenial(t, "beta to exact.test", resp, body, 403, "not_allowlisted")
		w.p.ExpectRecord(t, mark, wantRecord{Decision: "deny", Reason: "not_allowlisted", Tenant: "beta", Host: "exact.test", Status: 403})

		// acme's secret presented as user beta is not beta's credential.
		swapped := env.Credential("beta", w.acme.Password)
		mark = w.p.AuditMark(t)
		resp, body = w.p.Get(t, swapped, w.url("beta.test", "/"))
		checkDenial(t, "acme's secret as beta", resp, body, 407, "auth_invalid")
		w.p.ExpectRecord(t, mark, wantRecord{Kind: audit.KindAuthFailure, Decision: "deny", Reason: "auth_invalid", Host: anyValue, Status: 407})
	})

	t.Run("minted token", func(t *testing.T) {
		tok := env.MintToken("acme", "sbx-1", time.Hour, time.Time{})
		mark := w.p.AuditMark(t)
		resp, body := w.p.Get(t, tok, w.url("exact.test", "/tok"))
		if resp.StatusCode != 200 {
			t.Fatalf("token: %d %.300s", resp.StatusCode, body)
		}
		w.p.ExpectRecord(t, mark, wantRecord{Decision: "allow", Reason: "allowed", Rule: "acme-exact", Tenant: "acme",
			Sandbox: "sbx-1", Host: "exact.test", Status: 200})
	})

	// Every failure is a 407 with a Proxy-Authenticate challenge and one
	// auth_failure record that says why, never what was presented.
	failures := []struct {
		name    string
		cred    testCredential
		header  string // raw Proxy-Authorization, instead of cred
		reason  string
		message string
	}{
		{name: "missing", reason: "auth_required", message: "no proxy credentials"},
		{name: "not Basic", header: "Bearer " + strings.Repeat("x", 40), reason: "auth_invalid", message: "malformed"},
		{name: "not base64", header: "Basic !!!notbase64!!!", reason: "auth_invalid", message: "malformed"},
		{name: "no colon", header: "Basic " + "YWNtZQ==", reason: "auth_invalid", message: "malformed"},
		{name: "two headers", header: "\x00two", reason: "auth_invalid", message: "malformed"},
		{name: "unknown secret", cred: env.Credential("acme", "sls_"+strings.Repeat("A", 43)), reason: "auth_invalid", message: "unknown"},
		{name: "unknown tenant", cred: env.Credential("nobody", w.acme.Password), reason: "auth_invalid", message: "unknown"},
		{name: "expired token", cred: env.MintToken("acme", "sbx-old", time.Second, time.Now().Add(-time.Hour)), reason: "auth_expired", message: "expired"},
		{name: "revoked sandbox", cred: env.MintToken("acme", "revoked-sbx", time.Hour, time.Time{}), reason: "auth_invalid", message: "revoked"},
		{name: "cross-tenant token", cred: func() testCredential {
			tok := env.MintToken("acme", "sbx-2", time.Hour, time.Time{})
			return env.Credential("beta", tok.Password)
		}(), reason: "auth_invalid", message: "another tenant"},
	}
	for _, f := range failures {
		t.Run("407 "+f.name, func(t *testing.T) {
			before := w.origin.Requests()
			mark := w.p.AuditMark(t)
			req := newRequest(t, http.MethodGet, w.url("exact.test", "/auth"))
			var resp *http.Response
			var body []byte
			if f.header == "\x00two" {
				// Two Proxy-Authorization fields, each valid on its own.
				req.Header["Proxy-Authorization"] = []string{proxyAuthorization(w.acme), proxyAuthorization(w.beta)}
				resp, body = w.p.Do(t, testCredential{}, req)
			} else if f.header != "" {
				req.Header.Set("Proxy-Authorization", f.header)
				env.MarkSecret(strings.TrimPrefix(strings.TrimPrefix(f.header, "Basic "), "Bearer "))
				resp, body = w.p.Do(t, testCredential{}, req)
			} else {
				resp, body = w.p.Do(t, f.cred, req)
			}
			checkDenial(t, f.name, resp, body, http.StatusProxyAuthRequired, f.reason)
			if ch := resp.Header.Get("Proxy-Authenticate"); !strings.HasPrefix(ch, "Basic ") {
				t.Errorf("Proxy-Authenticate %q, want a Basic challenge", ch)
			}
			if w.origin.Requests() != before {
				t.Error("an unauthenticated request reached the origin")
			}
			rec := w.p.ExpectRecord(t, mark, wantRecord{Kind: audit.KindAuthFailure, Decision: "deny", Reason: f.reason,
				Host: anyValue, Status: 407})
			if rec.Tenant != "" || rec.Sandbox != "" {
				t.Errorf("failed authentication recorded tenant %q sandbox %q", rec.Tenant, rec.Sandbox)
			}
			if !strings.Contains(rec.Message, f.message) {
				t.Errorf("record message %q does not say %q", rec.Message, f.message)
			}
		})
	}

	t.Run("CONNECT without credentials", func(t *testing.T) {
		mark := w.p.AuditMark(t)
		conn, resp, body := w.p.Connect(t, testCredential{}, fmt.Sprintf("exact.test:%d", w.tls.Port))
		if conn != nil {
			t.Fatal("CONNECT without credentials was accepted")
		}
		checkDenial(t, "CONNECT without credentials", resp, body, 407, "auth_required")
		if resp.Header.Get("Proxy-Authenticate") == "" {
			t.Error("no Proxy-Authenticate on a CONNECT 407")
		}
		w.p.ExpectRecord(t, mark, wantRecord{Kind: audit.KindAuthFailure, Decision: "deny", Reason: "auth_required", Host: anyValue, Status: 407})
	})

	t.Run("Proxy-Authorization never reaches the origin", func(t *testing.T) {
		for _, s := range w.origin.Seen() {
			for k := range s.Header {
				if strings.HasPrefix(strings.ToLower(k), "proxy-") {
					t.Errorf("origin received header %s", k)
				}
			}
		}
		if len(w.origin.Seen()) < 2 {
			t.Fatalf("origin saw %d requests; the test above should have sent some", len(w.origin.Seen()))
		}
	})
}

func TestE2ENetguard(t *testing.T) {
	w := newCoreWorld(t)
	refused := []struct {
		host   string
		origin *testOrigin // the listener the name would reach, if any
	}{
		{"loop.guard.test", w.origin},
		{"ten.guard.test", nil},
		{"meta.guard.test", nil},
		{"six.guard.test", w.v6},
		{"mapped.guard.test", w.origin},
	}
	for _, c := range refused {
		t.Run(c.host, func(t *testing.T) {
			port := w.origin.Port
			if c.origin != nil {
				port = c.origin.Port
			}
			var accepts int64
			if c.origin != nil {
				accepts = c.origin.Accepts()
			}
			mark := w.p.AuditMark(t)
			resp, body := w.p.Get(t, w.strict, fmt.Sprintf("http://%s:%d/", c.host, port))
			checkDenial(t, c.host, resp, body, http.StatusForbidden, "destination_not_permitted")
			if bytes.Contains(body, []byte("127.0.0.1")) || bytes.Contains(body, []byte("169.254")) || bytes.Contains(body, []byte("10.0.0.1")) {
				t.Errorf("denial body reveals the resolved address: %s", body)
			}
			w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "destination_not_permitted",
				Rule: "strict-guard", Tenant: "strict", Host: c.host, Status: 403})
			if c.origin != nil && c.origin.Accepts() != accepts {
				t.Errorf("the listener at %s accepted %d connections", c.origin.Addr, c.origin.Accepts()-accepts)
			}
		})
	}

	// Even a tenant that may reach loopback cannot send the proxy to itself
	// or to its admin listener (metrics, health).
	for _, port := range []int{w.proxyPort, w.adminPort} {
		t.Run(fmt.Sprintf("own port %d", port), func(t *testing.T) {
			mark := w.p.AuditMark(t)
			resp, body := w.p.Get(t, w.acme, fmt.Sprintf("http://self.test:%d/metrics", port))
			checkDenial(t, "self.test", resp, body, http.StatusForbidden, "destination_not_permitted")
			w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "destination_not_permitted",
				Rule: "acme-self", Tenant: "acme", Host: "self.test", Port: port, Status: 403})
		})
	}

	// A tenant's private exceptions are narrow: acme may reach 127.0.0.0/8,
	// not 10.0.0.0/8.
	t.Run("exception does not widen", func(t *testing.T) {
		mark := w.p.AuditMark(t)
		resp, body := w.p.Get(t, w.acme, w.url("ten.example.test", "/"))
		checkDenial(t, "acme to 10.0.0.1", resp, body, 403, "destination_not_permitted")
		w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "destination_not_permitted",
			Rule: "acme-wild", Tenant: "acme", Host: "ten.example.test", Status: 403})
	})

	// Numeric spellings of an address are refused before any rule or dial,
	// even for a tenant that may reach loopback.
	spellings := []string{"2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::ffff:127.0.0.1]", "0x7f.1", "017700000001"}
	for _, tenant := range []testCredential{w.strict, w.acme} {
		for _, h := range spellings {
			t.Run(tenant.User+" "+h, func(t *testing.T) {
				accepts := w.origin.Accepts()
				mark := w.p.AuditMark(t)
				resp, body := w.p.Get(t, tenant, fmt.Sprintf("http://%s:%d/", h, w.origin.Port))
				checkDenial(t, h, resp, body, http.StatusForbidden, "invalid_host")
				w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "invalid_host",
					Tenant: tenant.User, Host: "", Status: 403})
				if w.origin.Accepts() != accepts {
					t.Errorf("origin accepted a connection for %s", h)
				}
			})
		}
	}

	// A canonical IP literal is an address no rule names: refused by policy.
	t.Run("IP literal not in any rule", func(t *testing.T) {
		accepts := w.origin.Accepts()
		mark := w.p.AuditMark(t)
		resp, body := w.p.Get(t, w.acme, w.url("127.0.0.1", "/"))
		checkDenial(t, "127.0.0.1", resp, body, http.StatusForbidden, "not_allowlisted")
		w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: "not_allowlisted", Tenant: "acme", Host: "127.0.0.1", Status: 403})
		if w.origin.Accepts() != accepts {
			t.Error("origin accepted a connection")
		}
	})
}

func TestE2EConnect(t *testing.T) {
	w := newCoreWorld(t)
	target := fmt.Sprintf("exact.test:%d", w.tls.Port)

	// An accepted CONNECT writes two records: its decision, before the
	// client hears 200 (an open tunnel is always on record), and the
	// tunnel's outcome and bytes when it closes.
	expectTunnel := func(t *testing.T, mark int, tenant, rule, host string, port int, outcome wantRecord) audit.Record {
		t.Helper()
		outcome.Kind, outcome.Tenant, outcome.Rule, outcome.Host, outcome.Port = audit.KindTunnel, tenant, rule, host, port
		recs := w.p.ExpectRecords(t, mark,
			wantRecord{Decision: "allow", Reason: "allowed", Rule: rule, Tenant: tenant, Host: host, Port: port, Status: 200},
			outcome)
		if len(recs) != 2 {
			return audit.Record{}
		}
		if recs[0].Method != http.MethodConnect {
			t.Errorf("decision record method %q, want CONNECT", recs[0].Method)
		}
		if recs[1].ID != recs[0].ID && recs[1].TunnelID != recs[0].ID {
			t.Errorf("tunnel record %s is not linked to its decision record %s", recs[1].ID, recs[0].ID)
		}
		return recs[1]
	}

	t.Run("spliced tunnel", func(t *testing.T) {
		mark := w.p.AuditMark(t)
		conn, resp, body := w.p.Connect(t, w.acme, target)
		if conn == nil {
			t.Fatalf("CONNECT %s: %d %.300s", target, resp.StatusCode, body)
		}
		tc := tls.Client(conn, w.pki.ClientConfig("exact.test"))
		ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
		defer cancel()
		if err := tc.HandshakeContext(ctx); err != nil {
			t.Fatalf("TLS through the tunnel: %v", err)
		}
		if _, err := io.WriteString(tc, "GET /inside HTTP/1.1\r\nHost: exact.test\r\nConnection: close\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		r := readRawResponse(tc, nil)
		if r.Resp == nil || r.Resp.StatusCode != 200 {
			t.Fatalf("request inside the tunnel: %+v", r)
		}
		var echo originEcho
		if err := json.Unmarshal(r.Body, &echo); err != nil || echo.RequestURI != "/inside" {
			t.Errorf("origin echo %q (%v)", r.Body, err)
		}
		tc.Close()
		rec := expectTunnel(t, mark, "acme", "acme-exact", "exact.test", w.tls.Port,
			wantRecord{Decision: "allow", Reason: "allowed", Status: 200})
		if rec.BytesIn == 0 || rec.BytesOut == 0 {
			t.Errorf("tunnel record counts bytes in=%d out=%d", rec.BytesIn, rec.BytesOut)
		}
	})

	t.Run("SNI differs from CONNECT host", func(t *testing.T) {
		hellos := w.tls.Hellos()
		mark := w.p.AuditMark(t)
		conn, resp, body := w.p.Connect(t, w.acme, target)
		if conn == nil {
			t.Fatalf("CONNECT %s: %d %.300s", target, resp.StatusCode, body)
		}
		// a.example.test is allowed too, and the origin has a certificate
		// for it: only the SNI check stands between this and a fronted
		// session.
		tc := tls.Client(conn, w.pki.ClientConfig("a.example.test"))
		ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
		defer cancel()
		if err := tc.HandshakeContext(ctx); err == nil {
			t.Fatal("TLS handshake with a mismatched SNI completed through the tunnel")
		}
		tc.Close()
		expectTunnel(t, mark, "acme", "acme-exact", "exact.test", w.tls.Port,
			wantRecord{Decision: "deny", Reason: "sni_mismatch", Status: 403})
		if got := w.tls.Hellos() - hellos; got != 0 {
			t.Errorf("origin received %d ClientHellos from a refused tunnel", got)
		}
	})

	t.Run("no SNI to a named host", func(t *testing.T) {
		hellos := w.tls.Hellos()
		mark := w.p.AuditMark(t)
		conn, resp, body := w.p.Connect(t, w.acme, target)
		if conn == nil {
			t.Fatalf("CONNECT %s: %d %.300s", target, resp.StatusCode, body)
		}
		cfg := w.pki.ClientConfig("")
		cfg.InsecureSkipVerify = true // no name to verify against; the handshake must not happen at all
		tc := tls.Client(conn, cfg)
		ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
		defer cancel()
		if err := tc.HandshakeContext(ctx); err == nil {
			t.Fatal("TLS handshake without SNI completed through the tunnel")
		}
		tc.Close()
		expectTunnel(t, mark, "acme", "acme-exact", "exact.test", w.tls.Port,
			wantRecord{Decision: "deny", Reason: "sni_missing", Status: 403})
		if got := w.tls.Hellos() - hellos; got != 0 {
			t.Errorf("origin received %d ClientHellos", got)
		}
	})

	refusals := []struct {
		name, target, reason, host string
		port                       int
	}{
		{name: "port not allowed", target: "exact.test:9", reason: "not_allowlisted", host: "exact.test", port: 9},
		{name: "IP literal no rule names", target: fmt.Sprintf("127.0.0.1:%d", w.tls.Port), reason: "not_allowlisted", host: "127.0.0.1", port: w.tls.Port},
		{name: "host not allowed", target: fmt.Sprintf("beta.test:%d", w.tls.Port), reason: "not_allowlisted", host: "beta.test", port: w.tls.Port},
		{name: "numeric host", target: fmt.Sprintf("2130706433:%d", w.tls.Port), reason: "invalid_host", host: "", port: 0},
	}
	for _, c := range refusals {
		t.Run(c.name, func(t *testing.T) {
			accepts := w.tls.Accepts()
			mark := w.p.AuditMark(t)
			conn, resp, body := w.p.Connect(t, w.acme, c.target)
			if conn != nil {
				t.Fatalf("CONNECT %s was accepted", c.target)
			}
			checkDenial(t, c.name, resp, body, http.StatusForbidden, c.reason)
			w.p.ExpectRecord(t, mark, wantRecord{Decision: "deny", Reason: c.reason, Tenant: "acme", Host: c.host, Port: c.port, Status: 403})
			if w.tls.Accepts() != accepts {
				t.Error("the origin accepted a connection for a refused CONNECT")
			}
		})
	}

	t.Run("CONNECT to a guarded address", func(t *testing.T) {
		accepts := w.origin.Accepts()
		defer func() {
			if w.origin.Accepts() != accepts {
				t.Error("the loopback listener accepted a connection for a tenant without exceptions")
			}
		}()
		mark := w.p.AuditMark(t)
		conn, resp, body := w.p.Connect(t, w.strict, fmt.Sprintf("loop.guard.test:%d", w.origin.Port))
		if conn != nil {
			t.Fatal("CONNECT to a loopback address was accepted for a tenant without exceptions")
		}
		checkDenial(t, "CONNECT loop.guard.test", resp, body, http.StatusForbidden, "destination_not_permitted")
		// The guarded dial happens before the decision is recorded and
		// before any 200: the refusal is the one and only record.
		w.p.ExpectRecord(t, mark, wantRecord{Kind: "request", Tenant: "strict",
			Host: "loop.guard.test", Port: w.origin.Port, Rule: "strict-guard",
			Decision: "deny", Reason: "destination_not_permitted", Status: 403})
	})
}

func TestE2EMalformedInput(t *testing.T) {
	w := newCoreWorld(t)
	auth := proxyAuthorization(w.acme)
	target := w.url("exact.test", "/")
	hostHdr := fmt.Sprintf("exact.test:%d", w.origin.Port)

	bigHeader := "X-Big: " + strings.Repeat("a", 1<<20) + "\r\n"
	var many strings.Builder
	for i := 0; i < 10000; i++ {
		fmt.Fprintf(&many, "X-H%d: v\r\n", i)
	}
	good := "\r\nProxy-Authorization: " + auth + "\r\n"
	cases := []struct {
		name    string
		payload string
		status  int // the connection may also just close, but if a response comes it has this status
		reason  string
		tenant  string // "": refused by the framing guard, before identification
	}{
		{"CL and TE", "POST " + target + " HTTP/1.1\r\nHost: " + hostHdr + good +
			"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "bad_request", ""},
		{"two Content-Lengths", "POST " + target + " HTTP/1.1\r\nHost: " + hostHdr + good +
			"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400, "bad_request", ""},
		{"duplicate Host", "GET " + target + " HTTP/1.1\r\nHost: " + hostHdr + "\r\nHost: beta.test" + good + "\r\n", 400, "bad_request", ""},
		{"Host differs from target", "GET " + target + " HTTP/1.1\r\nHost: beta.test" + good + "\r\n", 400, "host_mismatch", ""},
		{"userinfo in target", "GET http://user@exact.test:" + w.origin.PortString() + "/ HTTP/1.1\r\nHost: " + hostHdr + good + "\r\n", 400, "bad_request", ""},
		{"obs-fold", "GET " + target + " HTTP/1.1\r\nHost: " + hostHdr + good + "X-A: a\r\n b\r\n\r\n", 400, "bad_request", ""},
		{"bare LF", "GET " + target + " HTTP/1.1\nHost: " + hostHdr + good + "\r\n", 400, "bad_request", ""},
		{"https in absolute form", "GET https://exact.test:" + w.tls.PortString() + "/ HTTP/1.1\r\nHost: exact.test:" + w.tls.PortString() + good + "\r\n", 400, "bad_request", "acme"},
		{"1 MiB header", "GET " + target + " HTTP/1.1\r\nHost: " + hostHdr + good + bigHeader + "\r\n", 431, "bad_request", ""},
		{"10000 headers", "GET " + target + " HTTP/1.1\r\nHost: " + hostHdr + good + many.String() + "\r\n", 431, "bad_request", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := w.origin.Requests()
			mark := w.p.AuditMark(t)
			r := w.p.RawExchange(t, []byte(c.payload))
			if r.Resp == nil {
				if !r.Closed {
					t.Fatalf("no response and no close: %v", r.Err)
				}
				t.Logf("connection closed without a response (%v)", r.Err)
			} else {
				checkDenial(t, c.name, r.Resp, r.Body, c.status, c.reason)
			}
			if w.origin.Requests() != before {
				t.Error("a malformed request reached the origin")
			}
			// Refused before identification: no tenant, and no host taken
			// from a head that was not trusted enough to parse.
			rec := w.p.ExpectRecord(t, mark, wantRecord{Decision: audit.DecisionDeny, Reason: c.reason, Tenant: c.tenant, Host: anyValue, Status: c.status})
			if c.tenant == "" && rec.Message == "" {
				t.Error("the record does not say what was wrong with the head")
			}
		})
	}

	t.Run("slowloris", func(t *testing.T) {
		const readHeaderTimeout = time.Second // server.read_header_timeout in coreConfig
		mark := w.p.AuditMark(t)
		slow := w.p.DialRaw(t)
		head := "GET " + target + " HTTP/1.1\r\nHost: " + hostHdr + "\r\nProxy-Authorization: " + auth + "\r\nX-Slow: " + strings.Repeat("s", 200) + "\r\n\r\n"
		start := time.Now()
		closed := make(chan time.Duration, 1)
		// Reader: notices when the proxy gives up on the connection.
		go func() {
			buf := make([]byte, 4096)
			for {
				if _, err := slow.Read(buf); err != nil {
					closed <- time.Since(start)
					return
				}
			}
		}()
		// Writer: one byte every 100ms, so the head takes ~30s to arrive;
		// bounded by the head's length and the test's own deadline.
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < len(head); i++ {
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
				if _, err := slow.Write([]byte{head[i]}); err != nil {
					return
				}
			}
		}()
		defer func() { close(stop); wg.Wait() }()

		// Meanwhile, other clients are served.
		time.Sleep(300 * time.Millisecond)
		resp, body := w.p.Get(t, w.acme, w.url("exact.test", "/while-slow"))
		if resp.StatusCode != 200 {
			t.Fatalf("good request during slowloris: %d %.200s", resp.StatusCode, body)
		}

		select {
		case d := <-closed:
			// The deadline is read_header_timeout from the first byte; allow
			// generous slack for a race-instrumented binary on a busy machine.
			if d < readHeaderTimeout-100*time.Millisecond {
				t.Errorf("slow client cut off after %s, before read_header_timeout (%s)", d, readHeaderTimeout)
			}
			if d > readHeaderTimeout+4*time.Second {
				t.Errorf("slow client cut off after %s; read_header_timeout is %s", d, readHeaderTimeout)
			}
			t.Logf("slow client cut off after %s", d.Round(10*time.Millisecond))
		case <-time.After(readHeaderTimeout + 10*time.Second):
			t.Fatal("slow client still connected long after read_header_timeout")
		}
		// The good request has exactly one record; the slow client never
		// completed a request head, so there is nothing to decide or record.
		recs := w.p.WaitRecords(t, mark, 1)
		if len(recs) != 1 || recs[0].Path != "/while-slow" || recs[0].Decision != audit.DecisionAllow {
			t.Errorf("records during slowloris:\n%s", describeRecords(recs))
		}
	})

	t.Run("origin-form request", func(t *testing.T) {
		mark := w.p.AuditMark(t)
		r := w.p.RawExchange(t, []byte("GET / HTTP/1.1\r\nHost: "+hostHdr+"\r\nProxy-Authorization: "+auth+"\r\n\r\n"))
		if r.Resp == nil || r.Resp.StatusCode != 400 || r.Resp.Header.Get("X-Sluice-Reason") != "bad_request" {
			t.Fatalf("origin-form request: %+v", r)
		}
		w.p.ExpectRecord(t, mark, wantRecord{Decision: "deny", Reason: "bad_request", Tenant: "", Host: "", Status: 400})
	})
}

func TestE2ENoRedirects(t *testing.T) {
	w := newCoreWorld(t)
	mark := w.p.AuditMark(t)
	resp, body := w.p.Get(t, w.acme, w.url("exact.test", "/redirect"))
	if resp.StatusCode != http.StatusFound {
		t.Fatalf("status %d, want 302 passed through: %.300s", resp.StatusCode, body)
	}
	if loc := resp.Header.Get("Location"); loc != "http://elsewhere.test/landing" {
		t.Errorf("Location %q", loc)
	}
	for _, s := range w.origin.Seen() {
		if s.RequestURI == "/landing" {
			t.Error("the proxy followed the redirect")
		}
	}
	if n := w.origin.Requests(); n != 1 {
		t.Errorf("origin served %d requests, want 1", n)
	}
	w.p.ExpectRecord(t, mark, wantRecord{Decision: "allow", Reason: "allowed", Rule: "acme-exact", Tenant: "acme",
		Host: "exact.test", Path: "/redirect", Status: 302})
}

func TestE2EHeadersToOrigin(t *testing.T) {
	w := newCoreWorld(t)
	req := newRequest(t, http.MethodGet, w.url("exact.test", "/headers"))
	req.Header.Set("Connection", "X-Hop")
	req.Header.Set("X-Hop", "1")
	req.Header.Set("Keep-Alive", "timeout=5")
	req.Header.Set("Proxy-Connection", "keep-alive")
	req.Header.Set("Te", "trailers")
	req.Header.Set("X-End-To-End", "kept")
	req.Header.Set("User-Agent", "") // send none; the proxy must not invent one
	mark := w.p.AuditMark(t)
	resp, body := w.p.Do(t, w.acme, req)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %.300s", resp.StatusCode, body)
	}
	seen := w.originSaw(t)
	for _, h := range []string{"X-Hop", "Keep-Alive", "Proxy-Connection", "Proxy-Authorization", "Te", "User-Agent"} {
		if v, ok := seen.Header[h]; ok {
			t.Errorf("origin received %s: %q", h, v)
		}
	}
	if seen.Header.Get("X-End-To-End") != "kept" {
		t.Errorf("an end-to-end header was dropped: %v", seen.Header)
	}
	w.p.ExpectRecord(t, mark, wantRecord{Decision: "allow", Reason: "allowed", Rule: "acme-exact", Tenant: "acme",
		Host: "exact.test", Path: "/headers", Status: 200})
}

func TestE2EConnectionCloseKeepsUpstreamPooled(t *testing.T) {
	w := newCoreWorld(t)
	const n = 20
	accepts := w.origin.Accepts()
	mark := w.p.AuditMark(t)
	for i := 0; i < n; i++ {
		// A fresh client connection per request, each saying
		// "Connection: close" (DisableKeepAlives sets it).
		cl := w.p.Client(w.acme, nil)
		cl.Transport.(*http.Transport).DisableKeepAlives = true
		req := newRequest(t, http.MethodGet, w.url("exact.test", fmt.Sprintf("/seq/%d", i)))
		req.Close = true
		resp, err := cl.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
	}
	for _, s := range w.origin.Seen() {
		if s.Header.Get("Connection") != "" {
			t.Errorf("origin received the client's Connection header %q", s.Header.Get("Connection"))
			break
		}
	}
	got := w.origin.Accepts() - accepts
	t.Logf("%d sequential requests with Connection: close → %d origin connections", n, got)
	if got > 2 {
		t.Errorf("origin accepted %d connections for %d sequential requests; the client's Connection: close must not reach the upstream hop", got, n)
	}
	recs := w.p.WaitRecords(t, mark, n)
	if len(recs) != n {
		t.Errorf("want %d records, got %d", n, len(recs))
	}
	for _, r := range recs {
		checkRecord(t, r, wantRecord{Decision: "allow", Reason: "allowed", Rule: "acme-exact", Tenant: "acme", Host: "exact.test", Status: 200})
	}
}
