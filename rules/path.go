package rules

import (
	"errors"
	"fmt"
	"strings"
)

// NormalizePath returns the canonical form of a request path, the only form
// the policy matches. Its input is the escaped path of the request target
// (URL.EscapedPath(); empty means "/").
//
// Percent-escapes of unreserved characters (ALPHA DIGIT - . _ ~) are decoded,
// every other escape keeps its encoding with upper-case hex, characters that
// may not appear raw in a path are percent-encoded, and dot segments are
// removed (RFC 3986 5.2.4) after %2e has been decoded, so "/a/%2E%2e/b" is
// "/b". The proxy should forward the normalised path, so the upstream sees
// exactly what was decided.
//
// Refused as ambiguous (servers disagree on their meaning, and a disagreement
// is a way around a deny rule): an encoded slash (%2F), a backslash raw or
// encoded (%5C), NUL raw or encoded, any other control character, invalid
// escapes, a path not starting with "/", a segment that is a dot segment with
// ";parameters" ("/..;/", which Tomcat resolves as ".."), and an empty segment
// ("//"): nginx merges slashes by default while most frameworks do not, so
// "/api//admin" could reach what a deny rule for "/api/admin/**" protects.
// A trailing slash is kept: "/a/" and "/a" are different paths.
func NormalizePath(p string) (string, error) {
	if p == "" {
		return "/", nil
	}
	if p[0] != '/' {
		return "", errors.New("path must start with '/'")
	}
	var b strings.Builder
	b.Grow(len(p))
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '%':
			if i+2 >= len(p) || !isHex(p[i+1]) || !isHex(p[i+2]) {
				return "", errors.New("invalid percent-escape in path")
			}
			v := unhex(p[i+1])<<4 | unhex(p[i+2])
			i += 2
			switch {
			case v == '/':
				return "", errors.New("encoded '/' (%2F) in path")
			case v == '\\':
				return "", errors.New("encoded '\\' (%5C) in path")
			case v == 0:
				return "", errors.New("encoded NUL (%00) in path")
			case v < 0x20 || v == 0x7f:
				return "", fmt.Errorf("encoded control character (%%%02X) in path", v)
			case isUnreserved(v):
				b.WriteByte(v)
			default:
				writeEscape(&b, v)
			}
		case c == '\\':
			return "", errors.New("'\\' in path")
		case c == 0:
			return "", errors.New("NUL in path")
		case c < 0x20 || c == 0x7f:
			return "", errors.New("control character in path")
		case c == '/' || isPchar(c):
			b.WriteByte(c)
		default:
			writeEscape(&b, c)
		}
	}
	out, err := removeDotSegments(b.String())
	if err != nil {
		return "", err
	}
	return out, nil
}

// removeDotSegments applies RFC 3986 5.2.4 to a path that starts with "/" and
// refuses the segment shapes that servers read differently.
func removeDotSegments(p string) (string, error) {
	segs := strings.Split(p[1:], "/")
	out := make([]string, 0, len(segs))
	for i, s := range segs {
		last := i == len(segs)-1
		switch s {
		case ".":
			if last {
				out = append(out, "")
			}
			continue
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
			if last {
				out = append(out, "")
			}
			continue
		case "":
			if !last {
				return "", errors.New("empty path segment ('//') in path")
			}
		}
		if base, _, ok := strings.Cut(s, ";"); ok && (base == "." || base == "..") {
			return "", errors.New("dot segment with parameters (e.g. '..;') in path")
		}
		out = append(out, s)
	}
	return "/" + strings.Join(out, "/"), nil
}

func unhex(c byte) byte {
	switch {
	case c >= '0' && c <= '9':
		return c - '0'
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10
	default:
		return c - 'A' + 10
	}
}

func writeEscape(b *strings.Builder, c byte) {
	const hexDigits = "0123456789ABCDEF"
	b.WriteByte('%')
	b.WriteByte(hexDigits[c>>4])
	b.WriteByte(hexDigits[c&15])
}

func isUnreserved(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}

// isPchar reports the characters RFC 3986 allows raw in a path segment,
// apart from '%' which the caller handles.
func isPchar(c byte) bool {
	if isUnreserved(c) {
		return true
	}
	switch c {
	case '!', '$', '&', '\'', '(', ')', '*', '+', ',', ';', '=', ':', '@':
		return true
	}
	return false
}

// pathPattern is a compiled rule path: literal segments, "*" for exactly one
// non-empty segment, and a final "**" for any number of segments (including
// none, so "/api/**" matches "/api", "/api/" and "/api/a/b", never "/apix").
type pathPattern struct {
	raw  string
	segs []string // without the trailing "**"
	tail bool     // ends in "**"
}

func compilePathPattern(p string) (pathPattern, error) {
	if p == "" || p[0] != '/' {
		return pathPattern{}, errors.New("path pattern must start with '/'")
	}
	segs := strings.Split(p[1:], "/")
	pp := pathPattern{raw: p}
	for i, s := range segs {
		switch {
		case s == "**":
			if i != len(segs)-1 {
				return pathPattern{}, errors.New("'**' is allowed only as the last segment")
			}
			pp.tail = true
			continue
		case s == "*":
		case strings.Contains(s, "*"):
			return pathPattern{}, errors.New("'*' must be a whole segment (\"/a/*/b\" or \"/a/**\")")
		}
		pp.segs = append(pp.segs, s)
	}
	// Literal parts must already be in normal form, or they could never match
	// a normalised request path.
	probe := strings.ReplaceAll(p, "*", "x")
	n, err := NormalizePath(probe)
	if err != nil {
		return pathPattern{}, fmt.Errorf("invalid path pattern: %v", err)
	}
	if n != probe {
		if !strings.Contains(p, "*") {
			return pathPattern{}, fmt.Errorf("path pattern is not in normal form; write %q", n)
		}
		return pathPattern{}, errors.New("path pattern is not in normal form (dot segments, or escapes that normalise differently)")
	}
	return pp, nil
}

// match walks the path segment by segment without allocating. path must be
// normalised (it starts with '/').
//
// lenient is for deny rules: servers disagree on whether "/Admin", "/admin/"
// and "/admin;jsessionid=x" are "/admin", and a deny must not be dodged by
// such a spelling. So a lenient match folds ASCII case, ignores ";params" in
// a segment and ignores one trailing slash. Allow rules match exactly, which
// can only make them deny more.
func (pp *pathPattern) match(path string, lenient bool) bool {
	if !lenient {
		return pp.matchSegs(path, false)
	}
	if pp.matchSegs(path, true) {
		return true
	}
	if len(path) > 1 && path[len(path)-1] == '/' {
		return pp.matchSegs(path[:len(path)-1], true)
	}
	return false
}

func (pp *pathPattern) matchSegs(path string, lenient bool) bool {
	rest := path[1:]
	for i, want := range pp.segs {
		seg, more := rest, false
		if j := strings.IndexByte(rest, '/'); j >= 0 {
			seg, rest, more = rest[:j], rest[j+1:], true
		}
		if want == "*" {
			if seg == "" {
				return false
			}
		} else if !segEqual(seg, want, lenient) {
			return false
		}
		if !more {
			// The path ends here: it matches if the pattern ends here too
			// ("**" may stand for no segment at all).
			return i == len(pp.segs)-1
		}
	}
	// The path goes on past the pattern's literal segments.
	return pp.tail
}

func segEqual(seg, want string, lenient bool) bool {
	if seg == want {
		return true
	}
	if !lenient {
		return false
	}
	if strings.EqualFold(seg, want) {
		return true
	}
	if j := strings.IndexByte(seg, ';'); j >= 0 {
		return strings.EqualFold(seg[:j], want)
	}
	return false
}
