package rules

import (
	"fmt"
	"sync"
	"testing"
)

const decideDoc = `version: 1
secrets:
  - name: gh
    source: file
    hosts: [api.github.com]
tenants:
  - id: acme
    allow:
      - host: api.github.com
        ports: [443]
        methods: [GET]
        paths: ["/repos/acme/**"]
        inject: [{header: Authorization, value: "Bearer ${secret:gh}"}]
      - host: "*.example.com"
      - host: files.example.com
      - host: plain.example.org
        ports: [443]
      - host: 93.184.216.34
        ports: [443]
      - host: inspect.example.org
        inspect: true
      - host: "[2001:db8::1]"
    deny:
      - host: secret.example.com
      - host: "*.example.com"
        methods: [DELETE]
      - host: plain.example.org
        paths: ["/admin/**"]
  - id: beta
    mode: report
    allow:
      - host: pypi.org
      - host: "*.pythonhosted.org"
    deny:
      - host: files.pythonhosted.org
  - id: gamma
    allow:
      - host: x.test.org
        methods: [GET]
      - host: "*.test.org"
      - host: "*.a.test.org"
        ports: [8443]
`

func TestDecide(t *testing.T) {
	p := mustCompile(t, decideDoc)
	get := func(tenant, host string, port int, path string) Query {
		return Query{Tenant: tenant, Host: host, Port: port, Method: "GET", Path: path}
	}
	tests := []struct {
		name      string
		q         Query
		allowed   bool
		wouldDeny bool
		reason    Reason
		rule      string
	}{
		{"exact host, method, path", get("acme", "api.github.com", 443, "/repos/acme/x"), true, false, ReasonAllowed, "acme/allow/0"},
		{"path prefix itself", get("acme", "api.github.com", 443, "/repos/acme"), true, false, ReasonAllowed, "acme/allow/0"},
		{"path lookalike", get("acme", "api.github.com", 443, "/repos/acmex/y"), false, false, ReasonNotAllowlisted, ""},
		{"other path", get("acme", "api.github.com", 443, "/repos/other/x"), false, false, ReasonNotAllowlisted, ""},
		{"other method", Query{Tenant: "acme", Host: "api.github.com", Port: 443, Method: "POST", Path: "/repos/acme/x"}, false, false, ReasonNotAllowlisted, ""},
		{"method is case-sensitive", Query{Tenant: "acme", Host: "api.github.com", Port: 443, Method: "get", Path: "/repos/acme/x"}, false, false, ReasonNotAllowlisted, ""},
		{"other port", get("acme", "api.github.com", 80, "/repos/acme/x"), false, false, ReasonNotAllowlisted, ""},
		{"wildcard one label", get("acme", "a.example.com", 443, "/"), true, false, ReasonAllowed, "acme/allow/1"},
		{"wildcard two labels", get("acme", "a.b.example.com", 80, "/"), true, false, ReasonAllowed, "acme/allow/1"},
		{"wildcard default ports", get("acme", "a.example.com", 8080, "/"), false, false, ReasonNotAllowlisted, ""},
		{"wildcard never apex", get("acme", "example.com", 443, "/"), false, false, ReasonNotAllowlisted, ""},
		{"wildcard lookalike", get("acme", "evilexample.com", 443, "/"), false, false, ReasonNotAllowlisted, ""},
		{"wildcard as prefix", get("acme", "a.example.com.evil.org", 443, "/"), false, false, ReasonNotAllowlisted, ""},
		{"first match wins over later exact", get("acme", "files.example.com", 443, "/"), true, false, ReasonAllowed, "acme/allow/1"},
		{"deny beats wildcard allow", get("acme", "secret.example.com", 443, "/"), false, false, ReasonDeniedByRule, "acme/deny/0"},
		{"conditional deny by method", Query{Tenant: "acme", Host: "x.example.com", Port: 443, Method: "DELETE", Path: "/"}, false, false, ReasonDeniedByRule, "acme/deny/1"},
		{"conditional deny other method", Query{Tenant: "acme", Host: "x.example.com", Port: 443, Method: "PUT", Path: "/"}, true, false, ReasonAllowed, "acme/allow/1"},
		{"conditional deny by path", get("acme", "plain.example.org", 443, "/admin/users"), false, false, ReasonDeniedByRule, "acme/deny/2"},
		{"conditional deny path prefix itself", get("acme", "plain.example.org", 443, "/admin"), false, false, ReasonDeniedByRule, "acme/deny/2"},
		{"conditional deny other path", get("acme", "plain.example.org", 443, "/adminx"), true, false, ReasonAllowed, "acme/allow/3"},
		{"deny path folds case", get("acme", "plain.example.org", 443, "/ADMIN/users"), false, false, ReasonDeniedByRule, "acme/deny/2"},
		{"deny path ignores params", get("acme", "plain.example.org", 443, "/admin;jsessionid=1/users"), false, false, ReasonDeniedByRule, "acme/deny/2"},
		{"deny method folds case", Query{Tenant: "acme", Host: "x.example.com", Port: 443, Method: "delete", Path: "/"}, false, false, ReasonDeniedByRule, "acme/deny/1"},
		{"allow path is exact", get("acme", "api.github.com", 443, "/REPOS/acme/x"), false, false, ReasonNotAllowlisted, ""},
		{"ip literal", Query{Tenant: "acme", Host: "93.184.216.34", IsIP: true, Port: 443, Method: "GET", Path: "/"}, true, false, ReasonAllowed, "acme/allow/4"},
		{"ip literal needs IsIP", get("acme", "93.184.216.34", 443, "/"), false, false, ReasonNotAllowlisted, ""},
		{"other ip", Query{Tenant: "acme", Host: "93.184.216.35", IsIP: true, Port: 443, Method: "GET", Path: "/"}, false, false, ReasonNotAllowlisted, ""},
		{"ipv6 literal", Query{Tenant: "acme", Host: "2001:db8::1", IsIP: true, Port: 443, Method: "GET", Path: "/"}, true, false, ReasonAllowed, "acme/allow/6"},
		{"unknown tenant", get("nobody", "api.github.com", 443, "/repos/acme/x"), false, false, ReasonUnknownTenant, ""},
		{"empty tenant", get("", "api.github.com", 443, "/repos/acme/x"), false, false, ReasonUnknownTenant, ""},
		{"other tenant's rules", get("acme", "pypi.org", 443, "/"), false, false, ReasonNotAllowlisted, ""},
		{"empty host", get("acme", "", 443, "/"), false, false, ReasonInvalidHost, ""},
		{"port zero", get("acme", "a.example.com", 0, "/"), false, false, ReasonBadRequest, ""},
		{"port too high", get("acme", "a.example.com", 65536, "/"), false, false, ReasonBadRequest, ""},
		{"empty path", get("acme", "a.example.com", 443, ""), false, false, ReasonAmbiguousPath, ""},
		{"relative path", get("acme", "a.example.com", 443, "x"), false, false, ReasonAmbiguousPath, ""},
		// report mode
		{"report allowed", get("beta", "pypi.org", 443, "/simple/"), true, false, ReasonAllowed, "beta/allow/0"},
		{"report would deny by rule", get("beta", "files.pythonhosted.org", 443, "/x"), true, true, ReasonDeniedByRule, "beta/deny/0"},
		{"report would deny not listed", get("beta", "api.github.com", 443, "/repos/acme/x"), true, true, ReasonNotAllowlisted, ""},
		{"report still refuses bad input", get("beta", "", 443, "/"), false, false, ReasonInvalidHost, ""},
		// first match wins, across exact and wildcard buckets
		{"first exact conditional", get("gamma", "x.test.org", 443, "/"), true, false, ReasonAllowed, "gamma/allow/0"},
		{"falls through to wildcard", Query{Tenant: "gamma", Host: "x.test.org", Port: 443, Method: "POST", Path: "/"}, true, false, ReasonAllowed, "gamma/allow/1"},
		{"earlier broader wildcard wins", get("gamma", "b.a.test.org", 443, "/"), true, false, ReasonAllowed, "gamma/allow/1"},
		{"later narrower wildcard by port", get("gamma", "b.a.test.org", 8443, "/"), true, false, ReasonAllowed, "gamma/allow/2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := p.Decide(tt.q)
			if d.Allowed != tt.allowed || d.WouldDeny != tt.wouldDeny || d.Reason != tt.reason || ruleID(d.Rule) != tt.rule {
				t.Errorf("Decide(%+v) = allowed %v, wouldDeny %v, %s, rule %q; want %v, %v, %s, %q",
					tt.q, d.Allowed, d.WouldDeny, d.Reason, ruleID(d.Rule), tt.allowed, tt.wouldDeny, tt.reason, tt.rule)
			}
			if d.Intercept {
				t.Error("Intercept set on a non-CONNECT decision")
			}
			if tt.reason == ReasonUnknownTenant {
				if d.Tenant != nil {
					t.Error("unknown tenant has a Tenant")
				}
			} else if d.Tenant == nil || d.Tenant.ID != tt.q.Tenant {
				t.Errorf("decision tenant %v; want %s", d.Tenant, tt.q.Tenant)
			}
			if d.Rule != nil && d.Rule.Tenant != tt.q.Tenant {
				t.Errorf("rule %s of tenant %s answered for %s", d.Rule.ID, d.Rule.Tenant, tt.q.Tenant)
			}
		})
	}
}

func TestDecideConnect(t *testing.T) {
	p := mustCompile(t, decideDoc)
	conn := func(tenant, host string, port int) Query {
		return Query{Tenant: tenant, Host: host, Port: port, Connect: true}
	}
	tests := []struct {
		name      string
		q         Query
		allowed   bool
		wouldDeny bool
		intercept bool
		reason    Reason
		rule      string
	}{
		{"inject and conditions intercept", conn("acme", "api.github.com", 443), true, false, true, ReasonAllowed, "acme/allow/0"},
		{"wrong port", conn("acme", "api.github.com", 80), false, false, false, ReasonNotAllowlisted, ""},
		{"conditional deny forces intercept", conn("acme", "a.example.com", 443), true, false, true, ReasonAllowed, "acme/allow/1"},
		{"unconditional deny", conn("acme", "secret.example.com", 443), false, false, false, ReasonDeniedByRule, "acme/deny/0"},
		{"path deny forces intercept", conn("acme", "plain.example.org", 443), true, false, true, ReasonAllowed, "acme/allow/3"},
		{"conditional deny alone does not allow", conn("acme", "plain.example.org", 80), false, false, false, ReasonNotAllowlisted, ""},
		{"inspect", conn("acme", "inspect.example.org", 443), true, false, true, ReasonAllowed, "acme/allow/5"},
		{"ip splices", Query{Tenant: "acme", Host: "93.184.216.34", IsIP: true, Port: 443, Connect: true}, true, false, false, ReasonAllowed, "acme/allow/4"},
		{"ipv6 splices", Query{Tenant: "acme", Host: "2001:db8::1", IsIP: true, Port: 443, Connect: true}, true, false, false, ReasonAllowed, "acme/allow/6"},
		{"apex not covered", conn("acme", "example.com", 443), false, false, false, ReasonNotAllowlisted, ""},
		{"plain rule splices", conn("beta", "pypi.org", 443), true, false, false, ReasonAllowed, "beta/allow/0"},
		{"wildcard splices", conn("beta", "a.pythonhosted.org", 443), true, false, false, ReasonAllowed, "beta/allow/1"},
		{"report would deny", conn("beta", "files.pythonhosted.org", 443), true, true, false, ReasonDeniedByRule, "beta/deny/0"},
		{"report not listed", conn("beta", "api.github.com", 443), true, true, false, ReasonNotAllowlisted, ""},
		{"method-only rule intercepts", conn("gamma", "x.test.org", 443), true, false, true, ReasonAllowed, "gamma/allow/0"},
		{"sibling splices", conn("gamma", "y.test.org", 443), true, false, false, ReasonAllowed, "gamma/allow/1"},
		{"unknown tenant", conn("zeta", "pypi.org", 443), false, false, false, ReasonUnknownTenant, ""},
		{"bad port", conn("beta", "pypi.org", 0), false, false, false, ReasonBadRequest, ""},
		{"connect ignores method and path", Query{Tenant: "acme", Host: "api.github.com", Port: 443, Method: "POST", Path: "/nope", Connect: true}, true, false, true, ReasonAllowed, "acme/allow/0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := p.Decide(tt.q)
			if d.Allowed != tt.allowed || d.WouldDeny != tt.wouldDeny || d.Intercept != tt.intercept || d.Reason != tt.reason || ruleID(d.Rule) != tt.rule {
				t.Errorf("Decide(%+v) = allowed %v, wouldDeny %v, intercept %v, %s, rule %q; want %v, %v, %v, %s, %q",
					tt.q, d.Allowed, d.WouldDeny, d.Intercept, d.Reason, ruleID(d.Rule), tt.allowed, tt.wouldDeny, tt.intercept, tt.reason, tt.rule)
			}
		})
	}
}

// Deny beats allow whatever the order in the file, and an allow listed
// before a deny for the same host does not win.
func TestDecideDenyBeatsAllowRegardlessOfOrder(t *testing.T) {
	p := mustCompile(t, "version: 1\ntenants:\n  - id: a\n    deny:\n      - host: x.example\n    allow:\n      - host: x.example\n      - host: \"*.x.example\"\n")
	for _, q := range []Query{
		{Tenant: "a", Host: "x.example", Port: 443, Method: "GET", Path: "/"},
		{Tenant: "a", Host: "x.example", Port: 443, Connect: true},
	} {
		if d := p.Decide(q); d.Allowed || d.Reason != ReasonDeniedByRule {
			t.Errorf("%+v: %+v", q, d)
		}
	}
}

// Tenants with identical hosts keep separate answers.
func TestDecideTenantIsolation(t *testing.T) {
	var doc = "version: 1\ntenants:\n"
	for i := range 20 {
		doc += fmt.Sprintf("  - id: t%d\n    allow:\n      - host: only%d.example\n        paths: [/t%d/**]\n", i, i, i)
	}
	p := mustCompile(t, doc)
	for i := range 20 {
		for j := range 20 {
			q := Query{Tenant: fmt.Sprintf("t%d", i), Host: fmt.Sprintf("only%d.example", j), Port: 443, Method: "GET", Path: fmt.Sprintf("/t%d/x", j)}
			d := p.Decide(q)
			if d.Allowed != (i == j) {
				t.Fatalf("%+v: allowed %v", q, d.Allowed)
			}
			if d.Allowed && d.Rule.Tenant != q.Tenant {
				t.Fatalf("rule of %s answered for %s", d.Rule.Tenant, q.Tenant)
			}
		}
	}
}

func TestDecideDoesNotAllocate(t *testing.T) {
	p := mustCompile(t, decideDoc)
	queries := []Query{
		{Tenant: "acme", Host: "api.github.com", Port: 443, Method: "GET", Path: "/repos/acme/x"},
		{Tenant: "acme", Host: "a.b.example.com", Port: 443, Method: "DELETE", Path: "/x"},
		{Tenant: "acme", Host: "plain.example.org", Port: 443, Connect: true},
		{Tenant: "acme", Host: "93.184.216.34", IsIP: true, Port: 443, Method: "GET", Path: "/"},
		{Tenant: "beta", Host: "files.pythonhosted.org", Port: 443, Method: "GET", Path: "/"},
		{Tenant: "gamma", Host: "deep.b.a.test.org", Port: 8443, Method: "GET", Path: "/a/b/c"},
		{Tenant: "nobody", Host: "x", Port: 1, Method: "GET", Path: "/"},
	}
	var sink Decision
	for _, q := range queries {
		if n := testing.AllocsPerRun(200, func() { sink = p.Decide(q) }); n != 0 {
			t.Errorf("Decide(%+v) allocates %.1f times", q, n)
		}
	}
	_ = sink
}

func TestDecideConcurrent(t *testing.T) {
	p := mustCompile(t, decideDoc)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				q := Query{Tenant: "acme", Host: "a.example.com", Port: 443, Method: "GET", Path: "/"}
				if (g+i)%2 == 0 {
					q.Connect, q.Method, q.Path = true, "", ""
				}
				if d := p.Decide(q); !d.Allowed {
					t.Errorf("denied: %+v", d)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func ruleID(r *Rule) string {
	if r == nil {
		return ""
	}
	return r.ID
}

// A deny rule without ports covers every port: denying a host must not be
// dodged through a port that a wildcard allow opens.
func TestDenyWithoutPortsCoversEveryPort(t *testing.T) {
	cfg, err := Parse([]byte(`version: 1
tenants:
  - id: t
    allow:
      - host: "*.corp.test"
        ports: [443, 8443]
    deny:
      - host: admin.corp.test
`), "t.yaml")
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, port := range []int{443, 8443} {
		d := p.Decide(Query{Tenant: "t", Host: "admin.corp.test", Port: port, Connect: true})
		if d.Allowed || d.Reason != ReasonDeniedByRule {
			t.Errorf("port %d: %+v", port, d)
		}
	}
	if d := p.Decide(Query{Tenant: "t", Host: "www.corp.test", Port: 8443, Connect: true}); !d.Allowed {
		t.Errorf("www:8443 refused: %+v", d)
	}
}

// A placeholder can only be swapped in a tunnel sluice can see into: a
// CONNECT to a placeholder secret's host is intercepted even when its rule
// needs nothing inside.
func TestPlaceholderHostsAreIntercepted(t *testing.T) {
	cfg, err := Parse([]byte(`version: 1
secrets:
  - name: gh
    source: file
    hosts: [api.github.com]
    placeholder: SLUICE_PLACEHOLDER_gh_0123456789
tenants:
  - id: t
    allow:
      - host: api.github.com
      - host: pypi.org
`), "t.yaml")
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if d := p.Decide(Query{Tenant: "t", Host: "api.github.com", Port: 443, Connect: true}); !d.Allowed || !d.Intercept {
		t.Errorf("placeholder host: %+v", d)
	}
	if d := p.Decide(Query{Tenant: "t", Host: "pypi.org", Port: 443, Connect: true}); !d.Allowed || d.Intercept {
		t.Errorf("other host: %+v", d)
	}
}
