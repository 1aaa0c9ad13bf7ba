package rules

import "strings"

// Query is one thing to decide: a request, or a CONNECT to host:port.
// Host must come from NormalizeHost (with its isIP result) and Path from
// NormalizePath; Decide does not normalise, it only refuses what is plainly
// not normalised.
type Query struct {
	Tenant  string
	Host    string
	IsIP    bool
	Port    int
	Method  string // empty for Connect
	Path    string // empty for Connect
	Connect bool
}

// Decision is the policy's answer to a Query.
type Decision struct {
	Allowed   bool    // may proceed (true also for a would-deny in report mode)
	WouldDeny bool    // report mode only: enforce would have denied
	Reason    Reason  // why; in report mode, the reason enforce would have given
	Rule      *Rule   // the deciding rule, nil if none
	Tenant    *Tenant // nil for an unknown tenant
	Intercept bool    // Connect only: the tunnel must be intercepted to enforce this policy
}

// matchMode says how much of a rule a query must satisfy.
type matchMode uint8

const (
	matchFull        matchMode = iota // host, port, methods and paths
	matchHostPort                     // host and port only (CONNECT)
	matchDenyConnect                  // host and port of a deny rule with no method or path condition
)

// Decide answers a query. It does not allocate, costs one map lookup for the
// tenant and O(labels) map lookups for the host, and is safe for concurrent use.
//
// Unknown tenants are denied (never report mode). Input that is plainly not
// normalised (empty host, port out of range, a path not starting with "/") is
// denied in every mode. Otherwise deny rules are consulted first (explicit
// deny beats allow), then allow rules in config order, first match wins, and
// nothing matching means not_allowlisted. A Connect query is decided on host
// and port: denied by a deny rule without method or path conditions, allowed
// if an allow rule matches, and Intercept is set when any matching rule has
// methods, paths, injections or inspect, so that every request in the tunnel
// is decided again; tunnels to a host that a secret's placeholder may be
// swapped for are always intercepted. IP-literal queries match only rules for
// that exact IP.
//
// A deny rule's method and path conditions match leniently (ASCII case
// folded, ";params" and one trailing slash ignored), because some upstream
// servers treat those spellings as the same resource; allow rules match
// exactly. Either way the error is towards denying.
func (p *Policy) Decide(q Query) Decision {
	t := p.tenants[q.Tenant]
	if t == nil {
		return Decision{Reason: ReasonUnknownTenant}
	}
	if q.Host == "" {
		return Decision{Reason: ReasonInvalidHost, Tenant: t}
	}
	if q.Port < 1 || q.Port > 65535 {
		return Decision{Reason: ReasonBadRequest, Tenant: t}
	}
	if q.Connect {
		d := t.decideConnect(&q)
		if d.Allowed && !d.Intercept && !d.WouldDeny {
			if _, ok := p.placeholderHosts[q.Host]; ok {
				d.Intercept = true
			}
		}
		return d
	}
	if q.Path == "" || q.Path[0] != '/' {
		return Decision{Reason: ReasonAmbiguousPath, Tenant: t}
	}
	if r := t.deny.first(&q, matchFull); r != nil {
		return t.denied(r, ReasonDeniedByRule)
	}
	if r := t.allow.first(&q, matchFull); r != nil {
		return Decision{Allowed: true, Reason: ReasonAllowed, Rule: r, Tenant: t}
	}
	return t.denied(nil, ReasonNotAllowlisted)
}

func (t *Tenant) decideConnect(q *Query) Decision {
	intercept := t.allow.needsIntercept(q) || t.deny.needsIntercept(q)
	if r := t.deny.first(q, matchDenyConnect); r != nil {
		d := t.denied(r, ReasonDeniedByRule)
		d.Intercept = d.Allowed && intercept
		return d
	}
	if r := t.allow.first(q, matchHostPort); r != nil {
		return Decision{Allowed: true, Reason: ReasonAllowed, Rule: r, Tenant: t, Intercept: intercept}
	}
	d := t.denied(nil, ReasonNotAllowlisted)
	d.Intercept = d.Allowed && intercept
	return d
}

// denied turns a deny into a would-deny for a tenant in report mode.
func (t *Tenant) denied(r *Rule, reason Reason) Decision {
	if t.Report {
		return Decision{Allowed: true, WouldDeny: true, Reason: reason, Rule: r, Tenant: t}
	}
	return Decision{Reason: reason, Rule: r, Tenant: t}
}

// first returns the earliest rule (in config order) that matches, looking at
// the exact host and then every proper suffix for wildcards. Rules in each
// bucket are in config order, so a bucket is scanned only up to the best
// match found so far.
func (ix *ruleIndex) first(q *Query, mode matchMode) *Rule {
	best := firstIn(ix.exact[q.Host], q, mode, nil)
	if q.IsIP {
		return best
	}
	h := q.Host
	for i := 0; i < len(h); i++ {
		if h[i] == '.' {
			if rs, ok := ix.wild[h[i+1:]]; ok {
				best = firstIn(rs, q, mode, best)
			}
		}
	}
	return best
}

func firstIn(rs []*Rule, q *Query, mode matchMode, best *Rule) *Rule {
	for _, r := range rs {
		if best != nil && r.order >= best.order {
			break
		}
		if r.matches(q, mode) {
			return r
		}
	}
	return best
}

// needsIntercept reports whether any rule matching host and port needs to
// see the requests inside a tunnel.
func (ix *ruleIndex) needsIntercept(q *Query) bool {
	if anyIntercept(ix.exact[q.Host], q) {
		return true
	}
	if q.IsIP {
		return false
	}
	h := q.Host
	for i := 0; i < len(h); i++ {
		if h[i] == '.' {
			if rs, ok := ix.wild[h[i+1:]]; ok && anyIntercept(rs, q) {
				return true
			}
		}
	}
	return false
}

func anyIntercept(rs []*Rule, q *Query) bool {
	for _, r := range rs {
		if r.intercept && r.matches(q, matchHostPort) {
			return true
		}
	}
	return false
}

func (r *Rule) matches(q *Query, mode matchMode) bool {
	if r.IsIP != q.IsIP || !r.hasPort(q.Port) {
		return false
	}
	switch mode {
	case matchHostPort:
		return true
	case matchDenyConnect:
		return len(r.Methods) == 0 && len(r.patterns) == 0
	}
	if len(r.Methods) > 0 && !r.hasMethod(q.Method, r.Deny) {
		return false
	}
	if len(r.patterns) == 0 {
		return true
	}
	for i := range r.patterns {
		if r.patterns[i].match(q.Path, r.Deny) {
			return true
		}
	}
	return false
}

func (r *Rule) hasPort(p int) bool {
	if len(r.Ports) == 0 {
		return true // only deny rules have no ports: every port
	}
	for _, x := range r.Ports {
		if x == p {
			return true
		}
	}
	return false
}

// hasMethod compares exactly for allow rules; deny rules fold case, since
// some servers treat "delete" as DELETE and a deny must not be dodged.
func (r *Rule) hasMethod(m string, fold bool) bool {
	for _, x := range r.Methods {
		if x == m || fold && strings.EqualFold(x, m) {
			return true
		}
	}
	return false
}
