package audit

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// Count is a labelled count.
type Count struct {
	Key   string `json:"key"`
	Count int    `json:"count"`
}

// TenantSummary is one tenant's traffic.
type TenantSummary struct {
	Tenant    string `json:"tenant"`
	Requests  int    `json:"requests"`
	Tunnels   int    `json:"tunnels"`
	Allowed   int    `json:"allowed"`
	Denied    int    `json:"denied"`
	WouldDeny int    `json:"would_deny"`
	Errors    int    `json:"errors"`
	BytesIn   int64  `json:"bytes_in"`
	BytesOut  int64  `json:"bytes_out"`
}

// SecretUse says where a secret was sent.
type SecretUse struct {
	Secret string  `json:"secret"`
	Uses   int     `json:"uses"`
	Hosts  []Count `json:"hosts"`
}

// Incident is one exfiltration attempt.
type Incident struct {
	Time    time.Time `json:"time"`
	Tenant  string    `json:"tenant"`
	Sandbox string    `json:"sandbox"`
	Host    string    `json:"host"`
	Secrets []string  `json:"secrets"`
}

// Summary is the reviewer's overview of a set of records.
type Summary struct {
	Records         int             `json:"records"`
	From            time.Time       `json:"from"`
	To              time.Time       `json:"to"`
	Tenants         []TenantSummary `json:"tenants"`
	DeniedByReason  []Count         `json:"denied_by_reason"`
	WouldDenyReason []Count         `json:"would_deny_by_reason"`
	TopDenied       []Count         `json:"top_denied_destinations"`
	Secrets         []SecretUse     `json:"secrets"`
	Exfiltration    []Incident      `json:"exfiltration"`
	ExfiltrationAll int             `json:"exfiltration_total"`
	Reflections     []Count         `json:"reflections"` // host → responses scrubbed of an injected secret
	AuthFailures    int             `json:"auth_failures"`
	Launches        int             `json:"launches"`
	Runs            int             `json:"runs"`
	ConfigReloads   int             `json:"config_reloads"`
	AuditGaps       int             `json:"audit_gaps"`
	LostRecords     uint64          `json:"lost_records"`
}

// Summarizer accumulates a Summary one record at a time.
type Summarizer struct {
	s          Summary
	tenants    map[string]*TenantSummary
	denied     map[string]int
	wouldDeny  map[string]int
	dest       map[string]int
	secrets    map[string]map[string]int
	reflection map[string]int
	maxList    int
}

// NewSummarizer returns a Summarizer that keeps the top n of each ranking
// (and at most n exfiltration incidents in detail; all are counted).
func NewSummarizer(n int) *Summarizer {
	if n <= 0 {
		n = 10
	}
	return &Summarizer{
		tenants: map[string]*TenantSummary{}, denied: map[string]int{}, wouldDeny: map[string]int{},
		dest: map[string]int{}, secrets: map[string]map[string]int{}, reflection: map[string]int{}, maxList: n,
	}
}

// Add counts one record. It keeps nothing of r beyond strings it copies.
func (z *Summarizer) Add(r *Record) {
	if r.Kind == KindChain {
		return
	}
	s := &z.s
	s.Records++
	if s.From.IsZero() || r.Time.Before(s.From) {
		s.From = r.Time
	}
	if r.Time.After(s.To) {
		s.To = r.Time
	}
	switch r.Kind {
	case KindAuthFailure:
		s.AuthFailures++
		return
	case KindLaunch:
		s.Launches++
		return
	case KindRun:
		s.Runs++
		return
	case KindConfigReload:
		s.ConfigReloads++
		return
	case KindAuditGap:
		s.AuditGaps++
		s.LostRecords += r.Lost
		return
	case KindRequest, KindTunnel:
	default:
		return
	}
	t := z.tenants[r.Tenant]
	if t == nil {
		t = &TenantSummary{Tenant: r.Tenant}
		z.tenants[r.Tenant] = t
	}
	// A request inside an intercepted tunnel is counted as a request; its
	// bytes are already counted by the tunnel record.
	if r.Kind == KindTunnel {
		t.Tunnels++
		t.BytesIn += r.BytesIn
		t.BytesOut += r.BytesOut
	} else {
		t.Requests++
		if r.TunnelID == "" {
			t.BytesIn += r.BytesIn
			t.BytesOut += r.BytesOut
		}
	}
	switch r.Decision {
	case DecisionAllow:
		t.Allowed++
	case DecisionDeny:
		t.Denied++
		z.denied[r.Reason]++
		z.dest[hostPort(r.Host, r.Port)]++
	case DecisionWouldDeny:
		t.WouldDeny++
		z.wouldDeny[r.Reason]++
	case DecisionError:
		t.Errors++
	}
	if r.Decision == DecisionAllow || r.Decision == DecisionWouldDeny {
		for _, name := range r.Secrets {
			m := z.secrets[name]
			if m == nil {
				m = map[string]int{}
				z.secrets[name] = m
			}
			m[r.Host]++
		}
	}
	if r.ReflectionScrubbed {
		z.reflection[r.Host]++
	}
	if r.Exfiltration {
		s.ExfiltrationAll++
		if len(s.Exfiltration) < z.maxList {
			s.Exfiltration = append(s.Exfiltration, Incident{Time: r.Time, Tenant: r.Tenant, Sandbox: r.Sandbox, Host: r.Host, Secrets: slices.Clone(r.Secrets)})
		}
	}
}

// Result returns the summary with rankings sorted (count descending, then key).
func (z *Summarizer) Result() Summary {
	s := z.s
	s.Tenants = nil
	for _, t := range z.tenants {
		s.Tenants = append(s.Tenants, *t)
	}
	slices.SortFunc(s.Tenants, func(a, b TenantSummary) int { return cmp.Compare(a.Tenant, b.Tenant) })
	s.DeniedByReason = ranked(z.denied, 0)
	s.WouldDenyReason = ranked(z.wouldDeny, 0)
	s.TopDenied = ranked(z.dest, z.maxList)
	s.Reflections = ranked(z.reflection, z.maxList)
	s.Secrets = nil
	for name, hosts := range z.secrets {
		u := SecretUse{Secret: name, Hosts: ranked(hosts, z.maxList)}
		for _, n := range hosts {
			u.Uses += n
		}
		s.Secrets = append(s.Secrets, u)
	}
	slices.SortFunc(s.Secrets, func(a, b SecretUse) int { return cmp.Compare(a.Secret, b.Secret) })
	return s
}

func ranked(m map[string]int, n int) []Count {
	out := make([]Count, 0, len(m))
	for k, v := range m {
		out = append(out, Count{Key: k, Count: v})
	}
	slices.SortFunc(out, func(a, b Count) int {
		if c := cmp.Compare(b.Count, a.Count); c != 0 {
			return c
		}
		return cmp.Compare(a.Key, b.Key)
	})
	if n > 0 && len(out) > n {
		out = out[:n]
	}
	return out
}

// WriteText prints the summary for a person.
func (s *Summary) WriteText(w io.Writer) error {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	if s.Records == 0 {
		p("no records\n")
		_, err := io.WriteString(w, b.String())
		return err
	}
	p("%d records from %s to %s\n", s.Records, s.From.UTC().Format(time.RFC3339), s.To.UTC().Format(time.RFC3339))
	p("\nTraffic per tenant\n")
	p("  %-16s %9s %8s %9s %8s %10s %7s %10s %10s\n", "TENANT", "REQUESTS", "TUNNELS", "ALLOWED", "DENIED", "WOULD_DENY", "ERRORS", "BYTES_IN", "BYTES_OUT")
	for _, t := range s.Tenants {
		p("  %-16s %9d %8d %9d %8d %10d %7d %10s %10s\n", Printable(t.Tenant), t.Requests, t.Tunnels, t.Allowed, t.Denied, t.WouldDeny, t.Errors, humanBytes(t.BytesIn), humanBytes(t.BytesOut))
	}
	counts := func(title string, cs []Count) {
		p("\n%s\n", title)
		if len(cs) == 0 {
			p("  none\n")
		}
		for _, c := range cs {
			p("  %8d  %s\n", c.Count, Printable(c.Key))
		}
	}
	counts("Denials by reason", s.DeniedByReason)
	counts("Would-deny (report mode) by reason", s.WouldDenyReason)
	counts("Top denied destinations", s.TopDenied)
	p("\nSecrets used (injected, by destination)\n")
	if len(s.Secrets) == 0 {
		p("  none\n")
	}
	for _, u := range s.Secrets {
		p("  %s: %d\n", Printable(u.Secret), u.Uses)
		for _, h := range u.Hosts {
			p("    %8d  %s\n", h.Count, Printable(h.Key))
		}
	}
	p("\nExfiltration attempts: %d\n", s.ExfiltrationAll)
	for _, e := range s.Exfiltration {
		p("  %s  tenant=%s sandbox=%s host=%s secrets=%s\n", e.Time.UTC().Format(time.RFC3339), Printable(e.Tenant), Printable(e.Sandbox), Printable(e.Host), Printable(strings.Join(e.Secrets, ",")))
	}
	if len(s.Exfiltration) < s.ExfiltrationAll {
		p("  ... %d more (use `sluice logs --json` and filter on exfiltration)\n", s.ExfiltrationAll-len(s.Exfiltration))
	}
	counts("Responses scrubbed of a reflected secret, by host", s.Reflections)
	p("\nOther: auth failures %d, launches %d, runs %d, config reloads %d, audit gaps %d (%d records lost)\n",
		s.AuthFailures, s.Launches, s.Runs, s.ConfigReloads, s.AuditGaps, s.LostRecords)
	_, err := io.WriteString(w, b.String())
	return err
}
