package rules

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"golang.org/x/net/idna"
)

// hostProfile is UTS #46 lookup processing with STD3 ASCII rules (so "_" and
// other non-LDH characters are refused: they are not valid in host names a
// certificate can cover, and no rule needs them), Bidi and ContextJ checks,
// and DNS length limits. CheckHyphens is off, as in browsers, because real
// CDN host names such as "r3---sn-abc.googlevideo.com" have "--" at positions
// 3-4; leading and trailing hyphens are still refused below.
// The profile is immutable and safe for concurrent use.
var hostProfile = idna.New(
	idna.MapForLookup(),
	idna.BidiRule(),
	idna.CheckJoiners(true),
	idna.CheckHyphens(false),
	idna.Transitional(false),
	idna.VerifyDNSLength(true),
)

// NormalizeHost returns the canonical form of a destination host and whether
// it is an IP literal. The proxy and the policy compare hosts only in this
// form, and the proxy must dial and check SNI against the returned host, never
// the original spelling.
//
// Names are lower-cased, lose one trailing dot, and are converted to ASCII
// (IDNA, strict lookup rules). Canonical dotted-quad IPv4 and IPv6 (brackets
// optional, returned without them, in canonical form) are IP literals.
// Refused: empty names and labels, over-long names, userinfo, ports, zones,
// IPv4-mapped IPv6, and every other numeric spelling that some resolver or
// URL parser would read as an address (2130706433, 0x7f000001, 0177.0.0.1,
// 127.1, any name whose last label is all digits or 0x-hex), because the
// policy would see a name where the network sees an address.
func NormalizeHost(h string) (host string, isIP bool, err error) {
	if h == "" {
		return "", false, errors.New("empty host")
	}
	if len(h) > 1024 {
		return "", false, errors.New("host is too long")
	}
	if strings.ContainsAny(h, "@") {
		return "", false, errors.New("host must not contain userinfo")
	}
	if strings.ContainsAny(h, "%") {
		return "", false, errors.New("host must not contain '%' (zones and escapes are refused)")
	}
	if strings.HasPrefix(h, "[") {
		end := strings.IndexByte(h, ']')
		if end < 0 {
			return "", false, errors.New("unterminated '[' in host")
		}
		if end != len(h)-1 {
			return "", false, errors.New("host must not contain a port")
		}
		return normalizeIPv6(h[1:end])
	}
	if strings.Contains(h, ":") {
		if strings.Count(h, ":") == 1 {
			return "", false, errors.New("host must not contain a port")
		}
		return normalizeIPv6(h)
	}
	if strings.HasSuffix(h, ".") {
		h = h[:len(h)-1]
		if h == "" {
			return "", false, errors.New("empty host")
		}
	}
	if a, err := netip.ParseAddr(h); err == nil && a.Is4() && a.String() == h {
		return h, true, nil
	}
	ascii, err := hostProfile.ToASCII(h)
	if err != nil {
		return "", false, fmt.Errorf("invalid host name: %s", idnaReason(err))
	}
	if ascii == "" {
		return "", false, errors.New("empty host")
	}
	for label := range strings.SplitSeq(ascii, ".") {
		if label == "" {
			return "", false, errors.New("invalid host name: empty label")
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return "", false, errors.New("invalid host name: a label starts or ends with '-'")
		}
	}
	last := ascii[strings.LastIndexByte(ascii, '.')+1:]
	if numericLabel(last) {
		// Whatever the spelling, the result would be read as an address.
		return "", false, fmt.Errorf("ambiguous host %q: a numeric spelling that resolvers may read as an IP address; write a canonical dotted-quad IPv4 address", h)
	}
	return ascii, false, nil
}

func normalizeIPv6(s string) (string, bool, error) {
	a, err := netip.ParseAddr(s)
	if err != nil || !a.Is6() {
		return "", false, fmt.Errorf("invalid IPv6 address %q", s)
	}
	if a.Zone() != "" {
		return "", false, errors.New("IPv6 zones are refused")
	}
	if a.Is4In6() {
		return "", false, fmt.Errorf("IPv4-mapped IPv6 address %q is refused; write the IPv4 address", s)
	}
	return a.String(), true, nil
}

// numericLabel reports whether a final label would make a WHATWG URL parser or
// inet_aton treat the whole name as an IPv4 number: all decimal digits, or
// "0x" followed by hex digits (possibly none).
func numericLabel(l string) bool {
	if strings.HasPrefix(l, "0x") {
		for i := 2; i < len(l); i++ {
			if !isHex(l[i]) {
				return false
			}
		}
		return true
	}
	for i := 0; i < len(l); i++ {
		if l[i] < '0' || l[i] > '9' {
			return false
		}
	}
	return l != ""
}

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

// idnaReason strips the input echo from idna errors; the caller names the host.
func idnaReason(err error) string {
	s := err.Error()
	if i := strings.Index(s, ": "); i >= 0 && strings.HasPrefix(s, "idna:") {
		return strings.TrimSpace(s[i+2:])
	}
	return s
}

// normalizeRuleHost validates a host written in a rule: an exact name, an IP
// literal, or "*.<name>" with at least two labels after the wildcard.
func normalizeRuleHost(h string) (host string, wildcard, isIP bool, err error) {
	if rest, ok := strings.CutPrefix(h, "*."); ok {
		if strings.Contains(rest, "*") {
			return "", false, false, errors.New("'*' is allowed only as the whole first label (\"*.example.com\")")
		}
		n, ip, err := NormalizeHost(rest)
		if err != nil {
			return "", false, false, err
		}
		if ip {
			return "", false, false, errors.New("a wildcard cannot cover an IP address")
		}
		if !strings.Contains(n, ".") {
			return "", false, false, fmt.Errorf("wildcard %q is too broad: it needs at least two labels after \"*.\"", h)
		}
		return "*." + n, true, false, nil
	}
	if strings.Contains(h, "*") {
		return "", false, false, errors.New("'*' is allowed only as the whole first label (\"*.example.com\")")
	}
	n, ip, err := NormalizeHost(h)
	return n, false, ip, err
}

// ParseAuthority splits a request authority ("host", "host:port", "[v6]",
// "[v6]:port") and normalises its host, with the proxy's rules: a port, when
// present, is decimal 1-65535 without sign or leading zero; defaultPort 0
// makes the port required (CONNECT); an unbracketed IPv6 literal is refused
// because its last group would read as a port.
func ParseAuthority(authority string, defaultPort int) (host string, isIP bool, port int, err error) {
	if authority == "" {
		return "", false, 0, errors.New("empty authority")
	}
	h, portStr, splitErr := net.SplitHostPort(authority)
	switch {
	case splitErr == nil:
		if portStr == "" || portStr[0] == '0' || len(portStr) > 5 {
			return "", false, 0, fmt.Errorf("invalid port %q", portStr)
		}
		for i := 0; i < len(portStr); i++ {
			if portStr[i] < '0' || portStr[i] > '9' {
				return "", false, 0, fmt.Errorf("invalid port %q", portStr)
			}
		}
		port, _ = strconv.Atoi(portStr)
		if port > 65535 {
			return "", false, 0, fmt.Errorf("invalid port %q", portStr)
		}
		if strings.Contains(h, ":") {
			h = "[" + h + "]" // NormalizeHost wants brackets or a bare literal; keep one spelling
		}
	case defaultPort == 0:
		return "", false, 0, errors.New("want host:port")
	case strings.Contains(authority, ":") && !strings.HasPrefix(authority, "["):
		return "", false, 0, errors.New("an IPv6 literal must be in brackets")
	default:
		h, port = authority, defaultPort
	}
	host, isIP, err = NormalizeHost(h)
	if err != nil {
		return "", false, 0, err
	}
	return host, isIP, port, nil
}
