package rules

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"net/netip"
	"net/textproto"
	"reflect"
	"regexp"
	"slices"
	"strings"
)

// Policy is a compiled, immutable configuration: safe for concurrent use, and
// replaced as a whole on reload. Values reached through it (tenants, rules,
// secret specs) are shared and must be treated as read-only.
type Policy struct {
	cfg          *Config
	version      string
	tenants      map[string]*Tenant
	tenantList   []*Tenant
	secrets      map[string]*SecretSpec
	secretList   []SecretSpec
	placeholders []Placeholder
	// placeholderHosts are the hosts some secret's placeholder may be
	// swapped for: tunnels to them are always intercepted, since a swap
	// (or a placeholder bound elsewhere) cannot be seen in a spliced one.
	placeholderHosts map[string]struct{}
	rules            int
}

// Tenant is one tenant's compiled policy.
type Tenant struct {
	ID          string
	Report      bool           // report mode: would-deny decisions are allowed and flagged
	AllowCIDRs  []netip.Prefix // private ranges netguard may let this tenant reach (masked)
	Credentials []CredentialSpec
	Limits      *TenantLimits // nil when unset
	Allow       []*Rule       // in config order
	Deny        []*Rule       // in config order

	allow, deny ruleIndex
}

// Rule is one compiled allow or deny rule.
type Rule struct {
	ID             string
	Tenant         string
	Deny           bool
	Host           string // normalised; "*.example.com" for a wildcard
	IsWildcard     bool
	IsIP           bool
	Ports          []int    // allow rules default to [80, 443]; empty on a deny rule means every port
	Methods        []string // empty: any method
	Paths          []string // as given; empty: any path
	Inspect        bool
	Injections     []Injection
	InjectOverHTTP bool
	Secrets        []string // every secret name the rule injects, sorted, unique
	Limits         *RateSpec

	order     int
	patterns  []pathPattern
	intercept bool // a CONNECT matching this rule must be intercepted
}

// Injection sets one header from a template.
type Injection struct {
	Header  string         // canonical MIME header name
	Parts   []TemplatePart // concatenated in order
	Secrets []string       // names referenced, in order of first use
}

// TemplatePart is either literal text or a reference to a secret's value.
type TemplatePart struct {
	Literal string
	Secret  string // when non-empty, the part is this secret's value
}

// Placeholder is a harmless stand-in a sandbox may hold for a secret; the
// proxy swaps it for the value only in requests to Hosts.
type Placeholder struct {
	Secret string
	Value  string
	Hosts  []string
}

// ruleIndex finds the rules that may match a host in O(labels): exact hosts
// and IP literals by the whole name, wildcards by the suffix after "*.".
type ruleIndex struct {
	exact map[string][]*Rule
	wild  map[string][]*Rule
}

// Config returns the configuration the policy was compiled from (a private
// copy, read-only).
func (p *Policy) Config() *Config { return p.cfg }

// Version is a content hash of the configuration ("sha256:<hex>"), for logs and
// audit records: two policies with the same version decide identically.
func (p *Policy) Version() string { return p.version }

// Tenant returns the compiled tenant with the given id.
func (p *Policy) Tenant(id string) (*Tenant, bool) {
	t, ok := p.tenants[id]
	return t, ok
}

// Tenants returns every tenant in config order (a new slice).
func (p *Policy) Tenants() []*Tenant { return slices.Clone(p.tenantList) }

// Secret returns the declared secret with the given name (read-only). For
// source "file", Key is defaulted to the name.
func (p *Policy) Secret(name string) (*SecretSpec, bool) {
	s, ok := p.secrets[name]
	return s, ok
}

// Secrets returns every declared secret in config order (a new slice).
func (p *Policy) Secrets() []SecretSpec { return slices.Clone(p.secretList) }

// Placeholders returns every secret placeholder (a new slice).
func (p *Policy) Placeholders() []Placeholder { return slices.Clone(p.placeholders) }

// RuleCount is the number of allow and deny rules over all tenants.
func (p *Policy) RuleCount() int { return p.rules }

var (
	idPattern     = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)
	ruleIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_./:-]{0,127}$`)
	hashPattern   = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
	methodPattern = regexp.MustCompile(`^[A-Z][A-Z0-9_-]{0,31}$`)
)

// forbiddenInject are headers the proxy owns: hop-by-hop headers, framing and
// routing. Injecting them would let config break the connection's framing or
// leak proxy credentials.
var forbiddenInject = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true,
	"Proxy-Authorization": true, "Proxy-Connection": true, "Te": true,
	"Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
	"Host": true, "Content-Length": true,
}

// Compile validates a configuration and compiles it into a Policy. Every
// problem is reported (as Errors) with its key path, and its line when the
// Config came from Parse. A configuration that does not compile must never
// replace a running policy.
func Compile(cfg *Config) (*Policy, error) {
	if cfg == nil {
		return nil, Errors{{Msg: "no configuration"}}
	}
	cp, version, err := cloneConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("rules: copy config: %w", err)
	}
	el := &errList{source: cfg.source, lines: cfg.lines}
	c := &compiler{el: el, hashes: map[string]string{}, p: &Policy{
		cfg:     cp,
		tenants: map[string]*Tenant{},
		secrets: map[string]*SecretSpec{},
	}}
	if cp.Version != 1 {
		el.add("version", "unsupported version %d; this sluice reads version 1", cp.Version)
	}
	checkNonNegative(reflect.ValueOf(cp).Elem(), new([]pathPart), el)
	c.server(cp)
	c.secrets(cp.Secrets)
	for i := range cp.Tenants {
		c.tenant(&cp.Tenants[i], fmt.Sprintf("tenants[%d]", i))
	}
	if err := el.err(); err != nil {
		return nil, err
	}
	c.p.version = version
	return c.p, nil
}

// cloneConfig returns a private deep copy of cfg (so later changes by the
// caller cannot reach the policy) and a hash of its content.
func cloneConfig(cfg *Config) (*Config, string, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, "", err
	}
	cp := &Config{}
	if err := json.Unmarshal(b, cp); err != nil {
		return nil, "", err
	}
	cp.source, cp.lines = cfg.source, cfg.lines
	h := sha256.Sum256(b)
	return cp, "sha256:" + hex.EncodeToString(h[:]), nil
}

type compiler struct {
	el     *errList
	p      *Policy
	hashes map[string]string // credential hash -> path of first use
}

func (c *compiler) server(cfg *Config) {
	oneOf := func(path, v string, allowed ...string) {
		if v != "" && !slices.Contains(allowed, v) {
			c.el.add(path, "must be one of %s, got %q", strings.Join(allowed, ", "), v)
		}
	}
	oneOf("audit.on_failure", cfg.Audit.OnFailure, "closed", "open")
	oneOf("audit.fsync", cfg.Audit.Fsync, "always", "interval", "never")
	oneOf("broker.vault.auth", cfg.Broker.Vault.Auth, "token", "approle")
}

// checkNonNegative refuses negative (or non-finite) numbers anywhere in the
// config: counts, limits, durations and sizes have no negative meaning. The
// key path is kept as a stack and rendered only for an error; building every
// path eagerly dominated the cost of compiling large configs.
func checkNonNegative(v reflect.Value, at *[]pathPart, el *errList) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			checkNonNegative(v.Elem(), at, el)
		}
	case reflect.Struct:
		t := v.Type()
		for i := 0; i < t.NumField(); i++ {
			if f := t.Field(i); f.IsExported() {
				*at = append(*at, pathPart{key: f.Tag.Get("mapstructure")})
				checkNonNegative(v.Field(i), at, el)
				*at = (*at)[:len(*at)-1]
			}
		}
	case reflect.Slice:
		for i := 0; i < v.Len(); i++ {
			*at = append(*at, pathPart{idx: i})
			checkNonNegative(v.Index(i), at, el)
			*at = (*at)[:len(*at)-1]
		}
	case reflect.Int, reflect.Int64:
		if v.Int() < 0 {
			el.add(renderPath(*at), "must not be negative")
		}
	case reflect.Float64:
		if f := v.Float(); f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
			el.add(renderPath(*at), "must be a finite, non-negative number")
		}
	}
}

// pathPart is one step of a key path: a key, or a list index when key is empty.
type pathPart struct {
	key string
	idx int
}

func renderPath(parts []pathPart) string {
	var b strings.Builder
	for _, p := range parts {
		if p.key == "" {
			fmt.Fprintf(&b, "[%d]", p.idx)
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.WriteString(p.key)
	}
	return b.String()
}

func (c *compiler) secrets(specs []SecretSpec) {
	seenPH := map[string]string{}
	seenName := map[string]bool{}
	for i := range specs {
		s := specs[i]
		path := fmt.Sprintf("secrets[%d]", i)
		switch {
		case s.Name == "":
			c.el.add(path+".name", "required")
		case !idPattern.MatchString(s.Name):
			c.el.add(path+".name", "invalid secret name %q: want [a-z0-9][a-z0-9_-]*", s.Name)
		case seenName[s.Name]:
			c.el.add(path+".name", "duplicate secret name %q", s.Name)
		}
		seenName[s.Name] = true
		switch s.Source {
		case "vault":
			if s.Path == "" {
				c.el.add(path+".path", "required for source vault (the KV v2 path)")
			}
			if s.Field == "" {
				c.el.add(path+".field", "required for source vault")
			}
			if s.Key != "" {
				c.el.add(path+".key", "only for source file")
			}
		case "file":
			if s.Path != "" {
				c.el.add(path+".path", "only for source vault (the file is broker.file.path)")
			}
			if s.Field != "" {
				c.el.add(path+".field", "only for source vault")
			}
			if s.Key == "" {
				s.Key = s.Name
			}
		case "":
			c.el.add(path+".source", "required: vault or file")
		default:
			c.el.add(path+".source", "must be vault or file, got %q", s.Source)
		}
		if len(s.Hosts) == 0 {
			c.el.add(path+".hosts", "required: the exact hosts this secret may ever be sent to")
		}
		hosts := make([]string, 0, len(s.Hosts))
		for j, h := range s.Hosts {
			hp := fmt.Sprintf("%s.hosts[%d]", path, j)
			if strings.Contains(h, "*") {
				c.el.add(hp, "a secret's hosts must be exact, not wildcards (%q)", h)
				continue
			}
			n, _, err := NormalizeHost(h)
			if err != nil {
				c.el.add(hp, "%v", err)
				continue
			}
			if slices.Contains(hosts, n) {
				c.el.add(hp, "duplicate host %q", n)
				continue
			}
			hosts = append(hosts, n)
		}
		s.Hosts = hosts
		if s.Placeholder != "" {
			pp := path + ".placeholder"
			switch {
			case len(s.Placeholder) < 16:
				c.el.add(pp, "must be at least 16 characters, so it cannot occur by chance")
			case !visibleASCII(s.Placeholder):
				c.el.add(pp, "must be printable ASCII without spaces")
			default:
				for other, name := range seenPH {
					if other == s.Placeholder {
						c.el.add(pp, "same placeholder as secret %q", name)
					} else if strings.Contains(other, s.Placeholder) || strings.Contains(s.Placeholder, other) {
						c.el.add(pp, "placeholder overlaps secret %q's (one contains the other)", name)
					}
				}
				seenPH[s.Placeholder] = s.Name
				c.p.placeholders = append(c.p.placeholders, Placeholder{Secret: s.Name, Value: s.Placeholder, Hosts: hosts})
				if c.p.placeholderHosts == nil {
					c.p.placeholderHosts = make(map[string]struct{})
				}
				for _, h := range hosts {
					c.p.placeholderHosts[h] = struct{}{}
				}
			}
		}
		c.p.secretList = append(c.p.secretList, s)
	}
	// Index after the slice is final, so the pointers stay valid.
	for i := range c.p.secretList {
		if s := &c.p.secretList[i]; s.Name != "" && c.p.secrets[s.Name] == nil {
			c.p.secrets[s.Name] = s
		}
	}
}

func visibleASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] > '~' {
			return false
		}
	}
	return true
}

func (c *compiler) tenant(ts *TenantSpec, path string) {
	t := &Tenant{ID: ts.ID, Limits: ts.Limits}
	switch {
	case ts.ID == "":
		c.el.add(path+".id", "required")
	case !idPattern.MatchString(ts.ID):
		c.el.add(path+".id", "invalid tenant id %q: want [a-z0-9][a-z0-9_-]* (at most 63 characters)", ts.ID)
	case c.p.tenants[ts.ID] != nil:
		c.el.add(path+".id", "duplicate tenant id %q", ts.ID)
	}
	switch ts.Mode {
	case "", "enforce":
	case "report":
		t.Report = true
	default:
		c.el.add(path+".mode", "must be enforce or report, got %q", ts.Mode)
	}
	credNames := map[string]bool{}
	for i, cr := range ts.Credentials {
		cp := fmt.Sprintf("%s.credentials[%d]", path, i)
		switch {
		case cr.Name == "":
			c.el.add(cp+".name", "required")
		case !idPattern.MatchString(cr.Name):
			c.el.add(cp+".name", "invalid credential name %q: want [a-z0-9][a-z0-9_-]*", cr.Name)
		case credNames[cr.Name]:
			c.el.add(cp+".name", "duplicate credential name %q", cr.Name)
		}
		credNames[cr.Name] = true
		if !hashPattern.MatchString(cr.Hash) {
			// Never echo the value: it may be a credential pasted by mistake.
			c.el.add(cp+".hash", "want \"sha256:\" followed by 64 lower-case hex digits (see `sluice token hash`)")
		} else if first, dup := c.hashes[cr.Hash]; dup {
			// One credential must open exactly one door.
			c.el.add(cp+".hash", "the same credential is already used at %s", first)
		} else {
			c.hashes[cr.Hash] = cp
		}
		t.Credentials = append(t.Credentials, cr)
	}
	for i, s := range ts.AllowCIDRs {
		cp := fmt.Sprintf("%s.allow_private_cidrs[%d]", path, i)
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			c.el.add(cp, "invalid CIDR %q", s)
			continue
		}
		if pfx.Addr().Zone() != "" {
			c.el.add(cp, "zones are not allowed in CIDRs")
			continue
		}
		if pfx.Addr().Is4In6() {
			c.el.add(cp, "IPv4-mapped IPv6 prefix %q: write the IPv4 prefix", s)
			continue
		}
		t.AllowCIDRs = append(t.AllowCIDRs, pfx.Masked())
	}
	ids := map[string]string{}
	t.allow = ruleIndex{exact: map[string][]*Rule{}, wild: map[string][]*Rule{}}
	t.deny = ruleIndex{exact: map[string][]*Rule{}, wild: map[string][]*Rule{}}
	for i := range ts.Allow {
		if r := c.rule(ts.ID, &ts.Allow[i], false, i, fmt.Sprintf("%s.allow[%d]", path, i), ids); r != nil {
			t.Allow = append(t.Allow, r)
			t.allow.add(r)
		}
	}
	for i := range ts.Deny {
		if r := c.rule(ts.ID, &ts.Deny[i], true, i, fmt.Sprintf("%s.deny[%d]", path, i), ids); r != nil {
			t.Deny = append(t.Deny, r)
			t.deny.add(r)
		}
	}
	c.p.rules += len(ts.Allow) + len(ts.Deny)
	if ts.ID != "" && c.p.tenants[ts.ID] == nil {
		c.p.tenants[ts.ID] = t
		c.p.tenantList = append(c.p.tenantList, t)
	}
}

func (ix *ruleIndex) add(r *Rule) {
	if r.IsWildcard {
		k := strings.TrimPrefix(r.Host, "*.")
		ix.wild[k] = append(ix.wild[k], r)
	} else {
		ix.exact[r.Host] = append(ix.exact[r.Host], r)
	}
}

func (c *compiler) rule(tenant string, rs *RuleSpec, deny bool, n int, path string, ids map[string]string) *Rule {
	kind := "allow"
	if deny {
		kind = "deny"
	}
	r := &Rule{
		ID: rs.ID, Tenant: tenant, Deny: deny, Inspect: rs.Inspect,
		InjectOverHTTP: rs.InjectOverHTTP, Limits: rs.Limits, order: n,
		Methods: slices.Clone(rs.Methods), Paths: slices.Clone(rs.Paths),
	}
	bad := false
	fail := func(p, format string, args ...any) {
		bad = true
		c.el.add(p, format, args...)
	}
	if r.ID == "" {
		r.ID = fmt.Sprintf("%s/%s/%d", tenant, kind, n)
	} else if !ruleIDPattern.MatchString(r.ID) {
		fail(path+".id", "invalid rule id %q: want letters, digits and _ . / : - (at most 128)", r.ID)
	}
	if prev, dup := ids[r.ID]; dup {
		fail(path+".id", "duplicate rule id %q (also %s)", r.ID, prev)
	} else {
		ids[r.ID] = path
	}

	if rs.Host == "" {
		fail(path+".host", "required")
	} else if h, wild, ip, err := normalizeRuleHost(rs.Host); err != nil {
		fail(path+".host", "%v", err)
	} else {
		r.Host, r.IsWildcard, r.IsIP = h, wild, ip
	}

	r.Ports = slices.Clone(rs.Ports)
	if len(r.Ports) == 0 && !deny {
		// Allow rules open the web ports unless told otherwise; a deny
		// rule without ports covers every port, so that denying a host
		// cannot be dodged through a port some wildcard allow opens.
		r.Ports = []int{80, 443}
	}
	elem := func(key string, i int) string { return fmt.Sprintf("%s.%s[%d]", path, key, i) }
	for i, p := range rs.Ports {
		if p < 1 || p > 65535 {
			fail(elem("ports", i), "port must be 1-65535, got %d", p)
		} else if slices.Index(rs.Ports, p) != i {
			fail(elem("ports", i), "duplicate port %d", p)
		}
	}
	for i, m := range rs.Methods {
		switch {
		case !methodPattern.MatchString(m):
			fail(elem("methods", i), "invalid method %q: want an upper-case token such as GET", m)
		case m == "CONNECT":
			fail(elem("methods", i), "CONNECT is decided by host and port alone; leave it out of methods")
		case slices.Index(rs.Methods, m) != i:
			fail(elem("methods", i), "duplicate method %q", m)
		}
	}
	for i, p := range rs.Paths {
		pat, err := compilePathPattern(p)
		if err != nil {
			fail(elem("paths", i), "%v", err)
			continue
		}
		if slices.Index(rs.Paths, p) != i {
			fail(elem("paths", i), "duplicate path %q", p)
		}
		r.patterns = append(r.patterns, pat)
	}

	if deny && len(rs.Inject) > 0 {
		fail(path+".inject", "a deny rule cannot inject")
	}
	if deny && rs.InjectOverHTTP {
		fail(path+".inject_over_http", "a deny rule cannot inject")
	}
	headers := map[string]bool{}
	for i, inj := range rs.Inject {
		ip := fmt.Sprintf("%s.inject[%d]", path, i)
		in, ok := c.injection(inj, ip)
		if !ok {
			bad = true
			continue
		}
		if headers[in.Header] {
			fail(ip+".header", "header %q is injected twice", in.Header)
		}
		headers[in.Header] = true
		r.Injections = append(r.Injections, in)
		for _, s := range in.Secrets {
			if !slices.Contains(r.Secrets, s) {
				r.Secrets = append(r.Secrets, s)
			}
		}
	}
	slices.Sort(r.Secrets)
	if len(r.Secrets) > 0 && r.Host != "" {
		if r.IsWildcard {
			fail(path+".host", "a rule that injects secrets needs an exact host, not a wildcard")
		} else {
			for _, s := range r.Secrets {
				if spec := c.p.secrets[s]; spec != nil && !slices.Contains(spec.Hosts, r.Host) {
					fail(path+".host", "secret %q may not be sent to %q (not in its hosts)", s, r.Host)
				}
			}
		}
	}
	r.intercept = len(r.Methods) > 0 || len(r.Paths) > 0 || len(r.Injections) > 0 || r.Inspect
	if bad {
		return nil
	}
	return r
}

func (c *compiler) injection(in InjectSpec, path string) (Injection, bool) {
	ok := true
	out := Injection{}
	switch {
	case in.Header == "":
		c.el.add(path+".header", "required")
		ok = false
	case !isToken(in.Header):
		c.el.add(path+".header", "invalid header name %q", in.Header)
		ok = false
	default:
		out.Header = textproto.CanonicalMIMEHeaderKey(in.Header)
		if forbiddenInject[out.Header] {
			c.el.add(path+".header", "header %q is managed by the proxy and cannot be injected", out.Header)
			ok = false
		}
	}
	parts, err := parseTemplate(in.Value)
	if err != nil {
		c.el.add(path+".value", "%v", err)
		return out, false
	}
	for _, p := range parts {
		if p.Secret == "" {
			continue
		}
		if c.p.secrets[p.Secret] == nil {
			c.el.add(path+".value", "unknown secret %q", p.Secret)
			ok = false
		}
		if !slices.Contains(out.Secrets, p.Secret) {
			out.Secrets = append(out.Secrets, p.Secret)
		}
	}
	out.Parts = parts
	return out, ok
}

// parseTemplate splits "Bearer ${secret:name}" into parts. The messages never
// quote the value: a literal part may be a credential pasted by mistake.
func parseTemplate(v string) ([]TemplatePart, error) {
	if v == "" {
		return nil, fmt.Errorf("required: a template such as \"Bearer ${secret:name}\"")
	}
	var parts []TemplatePart
	hasSecret := false
	rest := v
	for rest != "" {
		i := strings.Index(rest, "${")
		if i < 0 {
			parts = append(parts, TemplatePart{Literal: rest})
			break
		}
		if i > 0 {
			parts = append(parts, TemplatePart{Literal: rest[:i]})
		}
		rest = rest[i:]
		end := strings.IndexByte(rest, '}')
		if end < 0 {
			return nil, fmt.Errorf("unterminated \"${\" in template")
		}
		ref := rest[2:end]
		name, found := strings.CutPrefix(ref, "secret:")
		if !found {
			return nil, fmt.Errorf("\"${...}\" must be \"${secret:NAME}\"")
		}
		if !idPattern.MatchString(name) {
			return nil, fmt.Errorf("invalid secret name in template: want [a-z0-9][a-z0-9_-]*")
		}
		parts = append(parts, TemplatePart{Secret: name})
		hasSecret = true
		rest = rest[end+1:]
	}
	for _, p := range parts {
		for i := 0; i < len(p.Literal); i++ {
			if c := p.Literal[i]; (c < ' ' && c != '\t') || c == 0x7f {
				return nil, fmt.Errorf("control character in template")
			}
		}
	}
	if !hasSecret {
		return nil, fmt.Errorf("template references no secret: literal credentials do not belong in the config; use ${secret:NAME}")
	}
	return parts, nil
}

func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if isUnreserved(c) {
			continue
		}
		switch c {
		case '!', '#', '$', '%', '&', '\'', '*', '+', '^', '`', '|':
			continue
		}
		return false
	}
	return s != ""
}
