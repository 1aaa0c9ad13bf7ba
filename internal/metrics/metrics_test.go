package metrics

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/rules"
)

func scrape(t *testing.T, m *Metrics) string {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

// Tenant labels only ever carry configured tenants: anything else a client
// names is counted as "unknown", so label cardinality is bounded by the config.
func TestTenantLabelsAreBoundedByTheConfig(t *testing.T) {
	m := New(Sources{AuditQueueDepth: func() int { return 7 }, AuditLost: func() uint64 { return 3 }, ActiveConnections: func() int64 { return 2 }})
	m.SetTenants([]string{"acme"})
	m.Decision("acme", "allow", rules.ReasonAllowed, 0.001)
	m.Decision("acme", "deny", rules.ReasonNotAllowlisted, 0.001)
	m.Decision("attacker-chosen-1", "deny", rules.ReasonUnknownTenant, 0.001)
	m.Decision("attacker-chosen-2", "deny", rules.ReasonUnknownTenant, 0.001)
	m.Bytes("acme", 100, 2000)
	m.Refused("acme", "rate")
	m.TunnelOpened()
	m.TunnelOpened()
	m.TunnelClosed()
	m.Reload("ok")
	m.SecretAges(map[string]time.Duration{"github": 90 * time.Second})

	out := scrape(t, m)
	for _, want := range []string{
		`sluice_requests_total{decision="allow",reason="allowed",tenant="acme"} 1`,
		`sluice_requests_total{decision="deny",reason="not_allowlisted",tenant="acme"} 1`,
		`sluice_requests_total{decision="deny",reason="unknown_tenant",tenant="unknown"} 2`,
		`sluice_bytes_total{direction="egress",tenant="acme"} 100`,
		`sluice_bytes_total{direction="ingress",tenant="acme"} 2000`,
		`sluice_limit_refusals_total{limit="rate",tenant="acme"} 1`,
		`sluice_tunnels_active 1`,
		`sluice_config_reloads_total{result="ok"} 1`,
		`sluice_secret_age_seconds{secret="github"} 90`,
		`sluice_audit_queue_depth 7`,
		`sluice_audit_lost_total 3`,
		`sluice_connections_active 2`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
	if strings.Contains(out, "attacker-chosen") {
		t.Error("a tenant name no config declared became a label value")
	}

	// A reload that drops a tenant stops its label from growing.
	m.SetTenants([]string{"other"})
	m.Decision("acme", "allow", rules.ReasonAllowed, 0.001)
	if out := scrape(t, m); !strings.Contains(out, `sluice_requests_total{decision="allow",reason="allowed",tenant="unknown"} 1`) {
		t.Error("a removed tenant is still labelled by name")
	}
	// Secrets that are gone are dropped from the age gauge.
	m.SecretAges(map[string]time.Duration{})
	if out := scrape(t, m); strings.Contains(out, `secret="github"`) {
		t.Error("a removed secret still has an age")
	}
}
