package audit

import (
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Filter selects records for the reviewer. Empty fields match everything.
type Filter struct {
	Tenant   string
	Sandbox  string
	Kind     Kind // empty: every kind except chain headers
	Decision Decision
	Reason   string
	Host     string // exact, or a glob where * matches any run of characters ("*.github.com")
	Secret   string // records that used this secret
	Since    time.Time
	Until    time.Time
}

// Match reports whether r passes the filter.
func (f *Filter) Match(r *Record) bool {
	if f.Kind == "" {
		if r.Kind == KindChain {
			return false
		}
	} else if r.Kind != f.Kind {
		return false
	}
	switch {
	case f.Tenant != "" && r.Tenant != f.Tenant,
		f.Sandbox != "" && r.Sandbox != f.Sandbox,
		f.Decision != "" && r.Decision != f.Decision,
		f.Reason != "" && r.Reason != f.Reason,
		f.Secret != "" && !slices.Contains(r.Secrets, f.Secret),
		!f.Since.IsZero() && r.Time.Before(f.Since),
		!f.Until.IsZero() && !r.Time.Before(f.Until):
		return false
	}
	if f.Host != "" && !globMatch(strings.ToLower(f.Host), strings.ToLower(r.Host)) {
		return false
	}
	return true
}

// ParseTimeBound reads --since/--until: a duration before now ("2h", "90m")
// or an RFC 3339 time.
func ParseTimeBound(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("audit: time %q: a duration must not be negative", s)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("audit: time %q: want a duration like 2h or an RFC 3339 time", s)
	}
	return t, nil
}

// globMatch matches s against a pattern where * matches any run of
// characters (including dots); there are no other metacharacters.
func globMatch(pattern, s string) bool {
	px, sx := 0, 0
	nextP, nextS := -1, -1
	for px < len(pattern) || sx < len(s) {
		if px < len(pattern) {
			if c := pattern[px]; c == '*' {
				nextP, nextS = px, sx+1
				px++
				continue
			} else if sx < len(s) && s[sx] == c {
				px++
				sx++
				continue
			}
		}
		if nextP >= 0 && nextS <= len(s) {
			px, sx = nextP+1, nextS
			nextS++
			continue
		}
		return false
	}
	return true
}

// Printable makes a record string safe for a terminal: control characters
// (escape sequences), C1 controls and bidirectional overrides are replaced,
// because record values come from sandboxes and may be hostile.
func Printable(s string) string {
	clean := true
	for _, r := range s {
		if unsafeRune(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if unsafeRune(r) {
			r = utf8.RuneError
		}
		b.WriteRune(r)
	}
	return b.String()
}

func unsafeRune(r rune) bool {
	return r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || (r >= 0x202a && r <= 0x202e) ||
		(r >= 0x2066 && r <= 0x2069) || r == 0x200e || r == 0x200f || r == 0x061c || (unicode.Is(unicode.Cf, r) && r != 0x200d)
}
