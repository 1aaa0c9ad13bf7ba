package rules

import (
	"errors"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
)

// baseSecrets occupies lines 1-7; a tenant block starts on line 8.
const baseSecrets = `version: 1
secrets:
  - name: gh
    source: vault
    path: kv/data/gh
    field: token
    hosts: [api.github.com]
`

// withRule puts one allow rule (indented as a list item body) at line 11.
func withRule(rule string) string {
	return baseSecrets + "tenants:\n  - id: acme\n    allow:\n      - " + strings.ReplaceAll(strings.TrimSpace(rule), "\n", "\n        ") + "\n"
}

func compileDoc(t *testing.T, doc string) (*Policy, error) {
	t.Helper()
	cfg, err := Parse([]byte(doc), "c.yaml")
	if err != nil {
		t.Fatalf("Parse: %v\n%s", err, doc)
	}
	return Compile(cfg)
}

func mustCompile(t *testing.T, doc string) *Policy {
	t.Helper()
	p, err := compileDoc(t, doc)
	if err != nil {
		t.Fatalf("Compile: %v\n%s", err, doc)
	}
	return p
}

func TestCompileErrors(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		line int
		path string
		msg  string
	}{
		// tenants
		{"tenant id missing", baseSecrets + "tenants:\n  - mode: enforce\n", 9, "tenants[0].id", "required"},
		{"tenant id upper", baseSecrets + "tenants:\n  - id: Acme\n", 9, "tenants[0].id", "invalid tenant id"},
		{"tenant id dot", baseSecrets + "tenants:\n  - id: a.b\n", 9, "tenants[0].id", "invalid tenant id"},
		{"tenant id leading dash", baseSecrets + "tenants:\n  - id: -a\n", 9, "tenants[0].id", "invalid tenant id"},
		{"tenant id too long", baseSecrets + "tenants:\n  - id: " + strings.Repeat("a", 64) + "\n", 9, "tenants[0].id", "invalid tenant id"},
		{"tenant duplicate", baseSecrets + "tenants:\n  - id: a\n  - id: a\n", 10, "tenants[1].id", "duplicate tenant id"},
		{"mode", baseSecrets + "tenants:\n  - id: a\n    mode: audit\n", 10, "tenants[0].mode", "enforce or report"},
		{"credential hash", baseSecrets + "tenants:\n  - id: a\n    credentials:\n      - name: c\n        hash: md5:abc\n", 12, "tenants[0].credentials[0].hash", "sha256:"},
		{"credential hash upper", baseSecrets + "tenants:\n  - id: a\n    credentials:\n      - name: c\n        hash: sha256:" + strings.Repeat("A", 64) + "\n", 12, "tenants[0].credentials[0].hash", "lower-case"},
		{"credential hash short", baseSecrets + "tenants:\n  - id: a\n    credentials:\n      - name: c\n        hash: sha256:" + strings.Repeat("a", 63) + "\n", 12, "tenants[0].credentials[0].hash", "64"},
		{"credential reused", baseSecrets + "tenants:\n  - id: a\n    credentials:\n      - name: c\n        hash: sha256:" + strings.Repeat("a", 64) + "\n  - id: b\n    credentials:\n      - name: c\n        hash: sha256:" + strings.Repeat("a", 64) + "\n", 16, "tenants[1].credentials[0].hash", "already used at tenants[0].credentials[0]"},
		{"credential name", baseSecrets + "tenants:\n  - id: a\n    credentials:\n      - hash: sha256:" + strings.Repeat("a", 64) + "\n", 11, "tenants[0].credentials[0].name", "required"},
		{"cidr", baseSecrets + "tenants:\n  - id: a\n    allow_private_cidrs: [10.0.0.0/33]\n", 10, "tenants[0].allow_private_cidrs[0]", "invalid CIDR"},
		{"cidr bare ip", baseSecrets + "tenants:\n  - id: a\n    allow_private_cidrs: [10.0.0.1]\n", 10, "tenants[0].allow_private_cidrs[0]", "invalid CIDR"},
		{"cidr mapped", baseSecrets + "tenants:\n  - id: a\n    allow_private_cidrs: [\"::ffff:10.0.0.0/104\"]\n", 10, "tenants[0].allow_private_cidrs[0]", "IPv4-mapped"},
		{"negative limit", baseSecrets + "tenants:\n  - id: a\n    limits:\n      burst: -1\n", 11, "tenants[0].limits.burst", "negative"},
		{"negative rate", baseSecrets + "tenants:\n  - id: a\n    limits:\n      requests_per_second: -0.5\n", 11, "tenants[0].limits.requests_per_second", "non-negative"},
		// hosts
		{"host missing", withRule("ports: [443]"), 11, "tenants[0].allow[0].host", "required"},
		{"host wildcard tld", withRule("host: \"*.com\""), 11, "tenants[0].allow[0].host", "too broad"},
		{"host wildcard middle", withRule("host: \"a.*.example.com\""), 11, "tenants[0].allow[0].host", "'*'"},
		{"host wildcard partial", withRule("host: \"*example.com\""), 11, "tenants[0].allow[0].host", "'*'"},
		{"host bare star", withRule("host: \"*\""), 11, "tenants[0].allow[0].host", "'*'"},
		{"host port", withRule("host: example.com:443"), 11, "tenants[0].allow[0].host", "port"},
		{"host userinfo", withRule("host: u@example.com"), 11, "tenants[0].allow[0].host", "userinfo"},
		{"host numeric", withRule("host: \"2130706433\""), 11, "tenants[0].allow[0].host", "ambiguous"},
		{"host url", withRule("host: https://example.com"), 11, "tenants[0].allow[0].host", "port"},
		{"host underscore", withRule("host: a_b.example.com"), 11, "tenants[0].allow[0].host", "invalid host name"},
		// ports, methods, paths
		{"port zero", withRule("host: x.example\nports: [0]"), 12, "tenants[0].allow[0].ports[0]", "1-65535"},
		{"port high", withRule("host: x.example\nports: [443, 65536]"), 12, "tenants[0].allow[0].ports[1]", "1-65535"},
		{"port negative", withRule("host: x.example\nports: [-1]"), 12, "tenants[0].allow[0].ports[0]", ""},
		{"port duplicate", withRule("host: x.example\nports: [443, 443]"), 12, "tenants[0].allow[0].ports[1]", "duplicate port"},
		{"method lower", withRule("host: x.example\nmethods: [get]"), 12, "tenants[0].allow[0].methods[0]", "upper-case"},
		{"method space", withRule("host: x.example\nmethods: [\"GET POST\"]"), 12, "tenants[0].allow[0].methods[0]", "invalid method"},
		{"method connect", withRule("host: x.example\nmethods: [CONNECT]"), 12, "tenants[0].allow[0].methods[0]", "CONNECT"},
		{"method duplicate", withRule("host: x.example\nmethods: [GET, GET]"), 12, "tenants[0].allow[0].methods[1]", "duplicate"},
		{"path relative", withRule("host: x.example\npaths: [api]"), 12, "tenants[0].allow[0].paths[0]", "start with '/'"},
		{"path dots", withRule("host: x.example\npaths: [/a/../b]"), 12, "tenants[0].allow[0].paths[0]", "normal form"},
		{"path star inside", withRule("host: x.example\npaths: [/a*]"), 12, "tenants[0].allow[0].paths[0]", "whole segment"},
		{"path double star middle", withRule("host: x.example\npaths: [/a/**/b]"), 12, "tenants[0].allow[0].paths[0]", "last segment"},
		{"path encoded slash", withRule("host: x.example\npaths: [/a%2Fb]"), 12, "tenants[0].allow[0].paths[0]", "%2F"},
		{"path lower hex", withRule("host: x.example\npaths: [/a%3ab]"), 12, "tenants[0].allow[0].paths[0]", "/a%3Ab"},
		{"path duplicate", withRule("host: x.example\npaths: [/a, /a]"), 12, "tenants[0].allow[0].paths[1]", "duplicate"},
		// rule ids
		{"rule id invalid", withRule("host: x.example\nid: \"a b\""), 12, "tenants[0].allow[0].id", "invalid rule id"},
		{"rule id duplicate", baseSecrets + "tenants:\n  - id: acme\n    allow:\n      - host: a.example\n        id: r\n    deny:\n      - host: b.example\n        id: r\n", 15, "tenants[0].deny[0].id", "duplicate rule id"},
		{"rule id clashes with default", baseSecrets + "tenants:\n  - id: acme\n    allow:\n      - host: a.example\n      - host: b.example\n        id: acme/allow/0\n", 13, "tenants[0].allow[1].id", "duplicate rule id"},
		// injection
		{"inject header missing", withRule("host: api.github.com\ninject:\n  - value: \"Bearer ${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "required"},
		{"inject header invalid", withRule("host: api.github.com\ninject:\n  - header: \"X Key\"\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "invalid header name"},
		{"inject header colon", withRule("host: api.github.com\ninject:\n  - header: \"X-Key:\"\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "invalid header name"},
		{"inject host header", withRule("host: api.github.com\ninject:\n  - header: host\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "managed by the proxy"},
		{"inject proxy-authorization", withRule("host: api.github.com\ninject:\n  - header: Proxy-Authorization\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "managed by the proxy"},
		{"inject transfer-encoding", withRule("host: api.github.com\ninject:\n  - header: transfer-encoding\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "managed by the proxy"},
		{"inject content-length", withRule("host: api.github.com\ninject:\n  - header: Content-Length\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "managed by the proxy"},
		{"inject connection", withRule("host: api.github.com\ninject:\n  - header: Connection\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "managed by the proxy"},
		{"inject te", withRule("host: api.github.com\ninject:\n  - header: TE\n    value: \"${secret:gh}\""), 13, "tenants[0].allow[0].inject[0].header", "managed by the proxy"},
		{"inject header twice", withRule("host: api.github.com\ninject:\n  - header: Authorization\n    value: \"${secret:gh}\"\n  - header: authorization\n    value: \"${secret:gh}\""), 15, "tenants[0].allow[0].inject[1].header", "twice"},
		{"inject value missing", withRule("host: api.github.com\ninject:\n  - header: Authorization"), 13, "tenants[0].allow[0].inject[0].value", "required"},
		{"inject literal only", withRule("host: api.github.com\ninject:\n  - header: Authorization\n    value: \"Bearer ghp_pasted\""), 14, "tenants[0].allow[0].inject[0].value", "references no secret"},
		{"inject unknown secret", withRule("host: api.github.com\ninject:\n  - header: Authorization\n    value: \"Bearer ${secret:nope}\""), 14, "tenants[0].allow[0].inject[0].value", "unknown secret \"nope\""},
		{"inject unterminated", withRule("host: api.github.com\ninject:\n  - header: Authorization\n    value: \"Bearer ${secret:gh\""), 14, "tenants[0].allow[0].inject[0].value", "unterminated"},
		{"inject other ref", withRule("host: api.github.com\ninject:\n  - header: Authorization\n    value: \"${env:HOME}\""), 14, "tenants[0].allow[0].inject[0].value", "${secret:NAME}"},
		{"inject control char", withRule("host: api.github.com\ninject:\n  - header: Authorization\n    value: \"a\\r\\nX: ${secret:gh}\""), 14, "tenants[0].allow[0].inject[0].value", "control character"},
		{"inject wildcard host", withRule("host: \"*.github.com\"\ninject:\n  - header: Authorization\n    value: \"${secret:gh}\""), 11, "tenants[0].allow[0].host", "exact host"},
		{"inject host not in secret hosts", withRule("host: evil.example\ninject:\n  - header: Authorization\n    value: \"${secret:gh}\""), 11, "tenants[0].allow[0].host", "may not be sent to \"evil.example\""},
		{"inject host lookalike", withRule("host: api.github.com.evil.example\ninject:\n  - header: Authorization\n    value: \"${secret:gh}\""), 11, "tenants[0].allow[0].host", "may not be sent"},
		{"deny injects", baseSecrets + "tenants:\n  - id: acme\n    deny:\n      - host: api.github.com\n        inject:\n          - header: Authorization\n            value: \"${secret:gh}\"\n", 12, "tenants[0].deny[0].inject", "deny rule cannot inject"},
		// secrets
		{"secret name missing", "version: 1\nsecrets:\n  - source: file\n    hosts: [a.example]\n", 3, "secrets[0].name", "required"},
		{"secret name invalid", "version: 1\nsecrets:\n  - name: Git.Hub\n    source: file\n    hosts: [a.example]\n", 3, "secrets[0].name", "invalid secret name"},
		{"secret duplicate", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [a.example]\n  - name: a\n    source: file\n    hosts: [a.example]\n", 6, "secrets[1].name", "duplicate secret name"},
		{"secret source missing", "version: 1\nsecrets:\n  - name: a\n    hosts: [a.example]\n", 3, "secrets[0].source", "required"},
		{"secret source unknown", "version: 1\nsecrets:\n  - name: a\n    source: env\n    hosts: [a.example]\n", 4, "secrets[0].source", "vault or file"},
		{"vault needs path", "version: 1\nsecrets:\n  - name: a\n    source: vault\n    field: f\n    hosts: [a.example]\n", 3, "secrets[0].path", "required"},
		{"vault needs field", "version: 1\nsecrets:\n  - name: a\n    source: vault\n    path: kv/data/a\n    hosts: [a.example]\n", 3, "secrets[0].field", "required"},
		{"vault with key", "version: 1\nsecrets:\n  - name: a\n    source: vault\n    path: p\n    field: f\n    key: k\n    hosts: [a.example]\n", 7, "secrets[0].key", "only for source file"},
		{"file with path", "version: 1\nsecrets:\n  - name: a\n    source: file\n    path: p\n    hosts: [a.example]\n", 5, "secrets[0].path", "only for source vault"},
		{"secret hosts missing", "version: 1\nsecrets:\n  - name: a\n    source: file\n", 3, "secrets[0].hosts", "required"},
		{"secret host wildcard", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [\"*.example.com\"]\n", 5, "secrets[0].hosts[0]", "exact"},
		{"secret host invalid", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [\"a..b\"]\n", 5, "secrets[0].hosts[0]", "invalid host"},
		{"placeholder short", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [a.example]\n    placeholder: SHORT\n", 6, "secrets[0].placeholder", "at least 16"},
		{"placeholder space", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [a.example]\n    placeholder: \"SLUICE SECRET AAAA\"\n", 6, "secrets[0].placeholder", "printable ASCII"},
		{"placeholder duplicate", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [a.example]\n    placeholder: SLUICE_SECRET_AAAA\n  - name: b\n    source: file\n    hosts: [a.example]\n    placeholder: SLUICE_SECRET_AAAA\n", 10, "secrets[1].placeholder", "same placeholder"},
		{"placeholder substring", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [a.example]\n    placeholder: SLUICE_SECRET_AAAA_LONG\n  - name: b\n    source: file\n    hosts: [a.example]\n    placeholder: SLUICE_SECRET_AAAA\n", 10, "secrets[1].placeholder", "overlaps"},
		{"secret negative staleness", "version: 1\nsecrets:\n  - name: a\n    source: file\n    hosts: [a.example]\n    limits: {burst: -3}\n", 6, "secrets[0].limits.burst", "negative"},
		// server sections
		{"audit on_failure", "version: 1\naudit:\n  on_failure: maybe\n", 3, "audit.on_failure", "closed, open"},
		{"audit fsync", "version: 1\naudit:\n  fsync: sometimes\n", 3, "audit.fsync", "always"},
		{"vault auth", "version: 1\nbroker:\n  vault:\n    auth: kubernetes\n", 4, "broker.vault.auth", "token, approle"},
		{"negative queue", "version: 1\naudit:\n  queue_size: -1\n", 3, "audit.queue_size", "negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := compileDoc(t, tt.doc)
			if err == nil {
				t.Fatalf("Compile succeeded (%d tenants); want an error at %s", len(p.Tenants()), tt.path)
			}
			var es Errors
			if !errors.As(err, &es) {
				t.Fatalf("error %T; want Errors", err)
			}
			if !hasErr(es, tt.line, tt.path, tt.msg) {
				t.Errorf("want error at line %d, path %q, containing %q; got:\n%v", tt.line, tt.path, tt.msg, es)
			}
			if !strings.HasPrefix(es[0].Error(), "c.yaml:") {
				t.Errorf("error %q lacks the source name", es[0])
			}
		})
	}
}

func TestCompileNeverEchoesSensitiveValues(t *testing.T) {
	const pasted = "ghp_0123456789abcdefPASTED"
	doc := baseSecrets + "tenants:\n  - id: acme\n    credentials:\n      - name: c\n        hash: \"" + pasted + "\"\n" +
		"    allow:\n      - host: api.github.com\n        inject:\n          - header: Authorization\n            value: \"token " + pasted + "\"\n"
	_, err := compileDoc(t, doc)
	if err == nil {
		t.Fatal("want errors")
	}
	if strings.Contains(err.Error(), pasted) || strings.Contains(err.Error(), "PASTED") {
		t.Errorf("error echoes a sensitive value:\n%v", err)
	}
}

func TestCompileCollectsAllErrors(t *testing.T) {
	doc := baseSecrets + "tenants:\n  - id: Bad\n    mode: x\n    allow:\n      - host: \"*.com\"\n        ports: [0]\n        methods: [get]\n"
	_, err := compileDoc(t, doc)
	var es Errors
	if !errors.As(err, &es) || len(es) != 5 {
		t.Fatalf("got %v; want 5 errors", err)
	}
}

func TestCompileWithoutParse(t *testing.T) {
	// A Config built in code has no lines; errors still name paths.
	_, err := Compile(&Config{Version: 1, Tenants: []TenantSpec{{ID: "a", Allow: []RuleSpec{{Host: "x.example", Ports: []int{70000}}}}}})
	var es Errors
	if !errors.As(err, &es) || len(es) != 1 || es[0].Path != "tenants[0].allow[0].ports[0]" || es[0].Line != 0 {
		t.Fatalf("got %#v", err)
	}
	if got := es[0].Error(); got != "tenants[0].allow[0].ports[0]: port must be 1-65535, got 70000" {
		t.Errorf("formatted: %q", got)
	}
	if _, err := Compile(&Config{Version: 2}); err == nil {
		t.Error("version 2 compiled")
	}
	if _, err := Compile(nil); err == nil {
		t.Error("nil config compiled")
	}
	if _, err := Compile(&Config{Version: 1, Server: ServerConfig{IdleTimeout: -1}}); err == nil {
		t.Error("negative duration compiled")
	}
}

func TestCompileResult(t *testing.T) {
	data, err := os.ReadFile("../examples/quickstart/sluice.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := Parse(data, "sluice.yaml")
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Tenants()) != 1 || p.RuleCount() != 4 || len(p.Secrets()) != 1 {
		t.Errorf("tenants %d rules %d secrets %d", len(p.Tenants()), p.RuleCount(), len(p.Secrets()))
	}
	tn, ok := p.Tenant("demo")
	if !ok || tn.Report || len(tn.Allow) != 3 || len(tn.Deny) != 1 {
		t.Fatalf("tenant: %+v", tn)
	}
	r := tn.Allow[0]
	if r.ID != "demo/allow/0" || r.Host != "api.github.com" || r.IsWildcard || !slices.Equal(r.Ports, []int{443}) ||
		!slices.Equal(r.Secrets, []string{"github"}) || len(r.Injections) != 1 {
		t.Errorf("rule 0: %+v", r)
	}
	in := r.Injections[0]
	if in.Header != "Authorization" || len(in.Parts) != 2 || in.Parts[0] != (TemplatePart{Literal: "Bearer "}) || in.Parts[1] != (TemplatePart{Secret: "github"}) {
		t.Errorf("injection: %+v", in)
	}
	if w := tn.Allow[1]; !w.IsWildcard || w.Host != "*.pythonhosted.org" {
		t.Errorf("wildcard rule: %+v", w)
	}
	if d := tn.Deny[0]; d.ID != "demo/deny/0" || !d.Deny || len(d.Ports) != 0 {
		t.Errorf("deny rule: %+v", d)
	}
	s, ok := p.Secret("github")
	if !ok || s.Key != "github" || !slices.Equal(s.Hosts, []string{"api.github.com"}) {
		t.Errorf("secret: %+v", s)
	}
	ph := p.Placeholders()
	if len(ph) != 1 || ph[0].Secret != "github" || ph[0].Value != "SLUICE_SECRET_github_0000" {
		t.Errorf("placeholders: %+v", ph)
	}
	if !strings.HasPrefix(p.Version(), "sha256:") || len(p.Version()) != 71 {
		t.Errorf("version %q", p.Version())
	}
	// The policy is a private copy: changing the Config afterwards changes nothing.
	cfg.Tenants[0].Allow[0].Ports[0] = 8443
	cfg.Tenants[0].ID = "other"
	if p.Config().Tenants[0].ID != "demo" || tn.Allow[0].Ports[0] != 443 {
		t.Error("policy shares memory with the Config it was compiled from")
	}
	// Same content, same version; different content, different version.
	p2, err := Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p2.Version() == p.Version() {
		t.Error("changed config kept the version")
	}
	cfg2, _ := Parse(append([]byte("# a comment changes nothing\n"), data...), "x")
	p3, err := Compile(cfg2)
	if err != nil || p3.Version() != p.Version() {
		t.Errorf("same content, version %q vs %q (%v)", p3.Version(), p.Version(), err)
	}
}

func TestCompileDefaultsAndNormalisation(t *testing.T) {
	p := mustCompile(t, baseSecrets+`tenants:
  - id: acme
    mode: report
    allow_private_cidrs: [10.1.2.3/8, "fd00::1/8"]
    allow:
      - host: API.GitHub.com.
        id: custom-id
        inject:
          - header: x-api-key
            value: "${secret:gh}"
          - header: authorization
            value: "token ${secret:gh} and ${secret:gh}"
      - host: "[2001:DB8::1]"
        ports: [8443]
`)
	tn, _ := p.Tenant("acme")
	if !tn.Report {
		t.Error("report mode lost")
	}
	if want := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}; !slices.Equal(tn.AllowCIDRs, want) {
		t.Errorf("cidrs %v; want %v", tn.AllowCIDRs, want)
	}
	r := tn.Allow[0]
	if r.ID != "custom-id" || r.Host != "api.github.com" || r.Injections[0].Header != "X-Api-Key" || r.Injections[1].Header != "Authorization" {
		t.Errorf("rule: %+v", r)
	}
	if parts := r.Injections[1].Parts; len(parts) != 4 || parts[2].Literal != " and " || !slices.Equal(r.Injections[1].Secrets, []string{"gh"}) {
		t.Errorf("parts %+v", r.Injections[1])
	}
	if ip := tn.Allow[1]; !ip.IsIP || ip.Host != "2001:db8::1" || ip.ID != "acme/allow/1" {
		t.Errorf("ip rule: %+v", ip)
	}
}
