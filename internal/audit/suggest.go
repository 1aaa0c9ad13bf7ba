package audit

import (
	"cmp"
	"fmt"
	"io"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Suggester drafts an allowlist for one tenant from what its sandboxes did:
// allowed records and report-mode would_deny records whose only problem was
// that no rule allowed them. Values come from sandboxes, so only well-formed
// host names, IP literals, ports and method tokens are ever emitted.
type Suggester struct {
	tenant      string
	minWildcard int
	hosts       map[string]*hostSeen
	denied      map[string]bool // hosts an explicit deny rule matched
	records     int
	skipped     int
	from, to    time.Time
}

type hostSeen struct {
	ports       map[int]bool
	methods     map[string]bool
	anyMethod   bool // seen through a spliced tunnel: methods are not visible
	allowed     int
	wouldDeny   int
	isIP        bool
	requestSeen bool
}

// SuggestedRule is one drafted allow rule.
type SuggestedRule struct {
	Host      string   `json:"host"`
	Ports     []int    `json:"ports"`
	Methods   []string `json:"methods,omitempty"` // empty: any method
	Covers    []string `json:"covers,omitempty"`  // for a wildcard: the hosts seen under it
	Allowed   int      `json:"allowed"`
	WouldDeny int      `json:"would_deny"`
	AnyMethod bool     `json:"any_method"` // methods unknown (spliced tunnels)
}

// Suggestion is the draft.
type Suggestion struct {
	Tenant  string          `json:"tenant"`
	Records int             `json:"records"`
	Skipped int             `json:"skipped"` // records with a host, port or method that is not well-formed
	From    time.Time       `json:"from"`
	To      time.Time       `json:"to"`
	Rules   []SuggestedRule `json:"rules"`
	Denied  []string        `json:"denied"` // hosts an explicit deny rule matched: never suggested
}

// NewSuggester drafts rules for tenant. Hosts are grouped into a wildcard only
// when at least minWildcard (default 3, minimum 2) sibling subdomains were seen.
func NewSuggester(tenant string, minWildcard int) *Suggester {
	if minWildcard <= 0 {
		minWildcard = 3
	}
	minWildcard = max(minWildcard, 2)
	return &Suggester{tenant: tenant, minWildcard: minWildcard, hosts: map[string]*hostSeen{}, denied: map[string]bool{}}
}

var (
	labelRE  = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	methodRE = regexp.MustCompile(`^[A-Z]{1,16}$`)
)

// validHost accepts lower-case LDH host names and IP literals only.
func validHost(h string) (string, bool, bool) {
	if a, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil && a.Zone() == "" {
		return a.Unmap().String(), true, true
	}
	if len(h) == 0 || len(h) > 253 || !strings.Contains(h, ".") {
		return "", false, false
	}
	for _, l := range strings.Split(h, ".") {
		if !labelRE.MatchString(l) {
			return "", false, false
		}
	}
	return h, false, true
}

// Add considers one record.
func (g *Suggester) Add(r *Record) {
	if r.Tenant != g.tenant || (r.Kind != KindRequest && r.Kind != KindTunnel) || r.Exfiltration {
		return
	}
	switch {
	case r.Decision == DecisionAllow:
	case r.Decision == DecisionWouldDeny && r.Reason == "not_allowlisted":
	case (r.Decision == DecisionDeny || r.Decision == DecisionWouldDeny) && r.Reason == "denied_by_rule":
		if h, _, ok := validHost(strings.ToLower(r.Host)); ok {
			g.denied[h] = true
		}
		return
	default:
		return
	}
	host, isIP, ok := validHost(strings.ToLower(r.Host))
	port := r.Port
	if port == 0 {
		switch r.Scheme {
		case "http":
			port = 80
		case "https":
			port = 443
		}
	}
	method := r.Method
	okMethod := r.Kind == KindTunnel || methodRE.MatchString(method)
	if !ok || port < 1 || port > 65535 || !okMethod {
		g.skipped++
		return
	}
	g.records++
	if g.from.IsZero() || r.Time.Before(g.from) {
		g.from = r.Time
	}
	if r.Time.After(g.to) {
		g.to = r.Time
	}
	s := g.hosts[host]
	if s == nil {
		s = &hostSeen{ports: map[int]bool{}, methods: map[string]bool{}, isIP: isIP}
		g.hosts[host] = s
	}
	s.ports[port] = true
	if r.Decision == DecisionAllow {
		s.allowed++
	} else {
		s.wouldDeny++
	}
	switch {
	case r.Kind == KindTunnel && !r.Intercepted:
		s.anyMethod = true // the requests inside a spliced tunnel are not visible
	case r.Kind == KindRequest:
		s.requestSeen = true
		s.methods[method] = true
	}
}

// Result returns the draft, wildcard groups first where they apply, then
// hosts in name order.
func (g *Suggester) Result() Suggestion {
	out := Suggestion{Tenant: g.tenant, Records: g.records, Skipped: g.skipped, From: g.from, To: g.to}
	for h := range g.denied {
		out.Denied = append(out.Denied, h)
	}
	slices.Sort(out.Denied)

	// Group sibling subdomains under their parent when clearly common.
	byParent := map[string][]string{}
	for h, s := range g.hosts {
		if s.isIP || g.denied[h] {
			continue
		}
		if p, ok := wildcardParent(h); ok {
			byParent[p] = append(byParent[p], h)
		}
	}
	grouped := map[string]bool{}
	for parent, hs := range byParent {
		if len(hs) < g.minWildcard || g.deniedUnder(parent) {
			continue
		}
		slices.Sort(hs)
		r := SuggestedRule{Host: "*." + parent, Covers: hs}
		seen := []*hostSeen{}
		for _, h := range hs {
			grouped[h] = true
			seen = append(seen, g.hosts[h])
		}
		fill(&r, seen...)
		out.Rules = append(out.Rules, r)
	}
	for h, s := range g.hosts {
		if grouped[h] {
			continue
		}
		r := SuggestedRule{Host: h}
		fill(&r, s)
		out.Rules = append(out.Rules, r)
	}
	slices.SortFunc(out.Rules, func(a, b SuggestedRule) int { return cmp.Compare(sortKey(a.Host), sortKey(b.Host)) })
	return out
}

func (g *Suggester) deniedUnder(parent string) bool {
	for h := range g.denied {
		if strings.HasSuffix(h, "."+parent) {
			return true
		}
	}
	return false
}

// sortKey orders host names by their labels from the right, so related hosts
// sit together.
func sortKey(h string) string {
	h = strings.TrimPrefix(h, "*.")
	l := strings.Split(h, ".")
	slices.Reverse(l)
	return strings.Join(l, ".")
}

func fill(r *SuggestedRule, seen ...*hostSeen) {
	ports := map[int]bool{}
	methods := map[string]bool{}
	for _, s := range seen {
		for p := range s.ports {
			ports[p] = true
		}
		for m := range s.methods {
			methods[m] = true
		}
		r.AnyMethod = r.AnyMethod || s.anyMethod || !s.requestSeen
		r.Allowed += s.allowed
		r.WouldDeny += s.wouldDeny
	}
	for p := range ports {
		r.Ports = append(r.Ports, p)
	}
	slices.Sort(r.Ports)
	if !r.AnyMethod {
		for m := range methods {
			r.Methods = append(r.Methods, m)
		}
		slices.Sort(r.Methods)
	}
}

// Second-level labels under which a two-label parent is a public suffix
// (co.uk, com.au, ...): never wildcard those.
var publicSecondLevel = map[string]bool{"co": true, "com": true, "net": true, "org": true, "gov": true, "edu": true, "ac": true, "or": true, "ne": true, "go": true}

func wildcardParent(h string) (string, bool) {
	i := strings.IndexByte(h, '.')
	if i < 0 {
		return "", false
	}
	parent := h[i+1:]
	labels := strings.Split(parent, ".")
	if len(labels) < 2 {
		return "", false
	}
	if len(labels) == 2 && len(labels[1]) == 2 && publicSecondLevel[labels[0]] {
		return "", false
	}
	return parent, true
}

// WriteYAML prints the draft as an `allow:` block that can be pasted under
// the tenant in the config file. Every string is quoted; comments carry only
// validated host names and numbers.
func (s *Suggestion) WriteYAML(w io.Writer) error {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	p("# Draft allowlist for tenant %s, generated by `sluice rules suggest`\n", strconv.Quote(Printable(s.Tenant)))
	if s.Records > 0 {
		p("# from %d records between %s and %s.\n", s.Records, s.From.UTC().Format(time.RFC3339), s.To.UTC().Format(time.RFC3339))
	} else {
		p("# from 0 records: nothing to suggest.\n")
	}
	p("# Review every entry before pasting it under the tenant. Paths are not\n")
	p("# suggested: add `paths:` to narrow a rule.\n")
	if s.Skipped > 0 {
		p("# skipped (host, port or method not well-formed): %d records\n", s.Skipped)
	}
	for _, h := range s.Denied {
		p("# not suggested: %s matched an explicit deny rule\n", h)
	}
	if len(s.Rules) == 0 {
		p("allow: []\n")
	} else {
		p("allow:\n")
	}
	for _, r := range s.Rules {
		p("  # observed: allowed %d, would_deny %d\n", r.Allowed, r.WouldDeny)
		if len(r.Covers) > 0 {
			p("  # wildcard: %d sibling hosts were seen: %s\n", len(r.Covers), strings.Join(r.Covers, ", "))
			p("  # (*.%s matches subdomains only; list the hosts instead if that is too broad)\n", strings.TrimPrefix(r.Host, "*."))
		}
		if r.AnyMethod {
			p("  # methods not listed: some traffic was only visible as CONNECT tunnels\n")
		}
		p("  - host: %s\n", strconv.Quote(r.Host))
		ports := make([]string, len(r.Ports))
		for i, n := range r.Ports {
			ports[i] = strconv.Itoa(n)
		}
		p("    ports: [%s]\n", strings.Join(ports, ", "))
		if len(r.Methods) > 0 {
			ms := make([]string, len(r.Methods))
			for i, m := range r.Methods {
				ms[i] = strconv.Quote(m)
			}
			p("    methods: [%s]\n", strings.Join(ms, ", "))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}
