package rules

import (
	"fmt"
	"sync"
	"testing"
)

const (
	benchTenants = 10_000
	benchRules   = 50 // per tenant: 45 allow, 5 deny
)

// buildPolicy makes tenants × 50 rules: exact, wildcard, port, method and
// path rules, and five wildcard deny rules per tenant.
func buildPolicy(tenants int) (*Policy, error) {
	cfg := &Config{Version: 1}
	for n := range tenants {
		t := TenantSpec{ID: fmt.Sprintf("t%d", n)}
		for i := range benchRules - 5 {
			r := RuleSpec{}
			switch i % 5 {
			case 0:
				r.Host, r.Ports = fmt.Sprintf("svc%d.t%d.example.com", i, n), []int{443}
			case 1:
				r.Host = fmt.Sprintf("*.w%d.t%d.example.net", i, n)
			case 2:
				r.Host, r.Ports = fmt.Sprintf("api%d.example.org", i), []int{8443, 9443}
			case 3:
				r.Host, r.Methods = fmt.Sprintf("m%d.example.io", i), []string{"GET", "POST"}
			case 4:
				r.Host, r.Methods = fmt.Sprintf("p%d.example.dev", i), []string{"GET"}
				r.Paths = []string{fmt.Sprintf("/api/v%d/**", i), fmt.Sprintf("/v%d/*/items", i)}
			}
			t.Allow = append(t.Allow, r)
		}
		for i := range 5 {
			t.Deny = append(t.Deny, RuleSpec{Host: fmt.Sprintf("*.blocked%d.example.com", i)})
		}
		cfg.Tenants = append(cfg.Tenants, t)
	}
	return Compile(cfg)
}

var benchPolicy = sync.OnceValues(func() (*Policy, error) { return buildPolicy(benchTenants) })

func BenchmarkDecide(b *testing.B) {
	p, err := benchPolicy()
	if err != nil {
		b.Fatal(err)
	}
	last := benchRules - 6 // index of the last allow rule (a path rule)
	cases := []struct {
		name string
		q    Query
		rule string
	}{
		{"first", Query{Tenant: "t5000", Host: "svc0.t5000.example.com", Port: 443, Method: "GET", Path: "/"}, "t5000/allow/0"},
		{"last", Query{Tenant: "t9999", Host: fmt.Sprintf("p%d.example.dev", last), Port: 443, Method: "GET", Path: fmt.Sprintf("/v%d/x/items", last)}, fmt.Sprintf("t9999/allow/%d", last)},
		{"wildcard-deep", Query{Tenant: "t1", Host: "a.b.c.w1.t1.example.net", Port: 443, Method: "GET", Path: "/x"}, "t1/allow/1"},
		{"none", Query{Tenant: "t42", Host: "nothing.here.example.com", Port: 443, Method: "GET", Path: "/a/b"}, ""},
		{"deny", Query{Tenant: "t42", Host: "x.blocked3.example.com", Port: 443, Method: "GET", Path: "/"}, "t42/deny/3"},
		{"connect", Query{Tenant: "t7", Host: "p4.example.dev", Port: 443, Connect: true}, "t7/allow/4"},
	}
	for _, c := range cases {
		if got := ruleID(p.Decide(c.q).Rule); got != c.rule {
			b.Fatalf("%s: rule %q; want %q", c.name, got, c.rule)
		}
		if n := testing.AllocsPerRun(100, func() { p.Decide(c.q) }); n != 0 {
			b.Fatalf("%s: Decide allocates %.1f times", c.name, n)
		}
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				p.Decide(c.q)
			}
		})
	}
}

// The benchmark's policy shape at a tenth of its size (it takes seconds and
// hundreds of MB at full size): Decide stays allocation-free.
func TestLargePolicyDoesNotAllocate(t *testing.T) {
	const tenants = 1000
	p, err := buildPolicy(tenants)
	if err != nil {
		t.Fatal(err)
	}
	if p.RuleCount() != tenants*benchRules || len(p.Tenants()) != tenants {
		t.Fatalf("rules %d", p.RuleCount())
	}
	q := Query{Tenant: "t999", Host: "a.b.w11.t999.example.net", Port: 80, Method: "PUT", Path: "/x/y"}
	if d := p.Decide(q); !d.Allowed || d.Rule.ID != "t999/allow/11" {
		t.Fatalf("decision %+v", d)
	}
	if n := testing.AllocsPerRun(1000, func() { p.Decide(q) }); n != 0 {
		t.Errorf("Decide allocates %.1f times", n)
	}
}
