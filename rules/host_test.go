package rules

import (
	"strings"
	"testing"
)

func TestNormalizeHost(t *testing.T) {
	long63 := strings.Repeat("a", 63)
	tests := []struct {
		in     string
		want   string
		isIP   bool
		errHas string // non-empty: must fail with this in the message
	}{
		// names
		{in: "example.com", want: "example.com"},
		{in: "API.GitHub.COM", want: "api.github.com"},
		{in: "example.com.", want: "example.com"},
		{in: "localhost", want: "localhost"},
		{in: "r3---sn-abc.googlevideo.com", want: "r3---sn-abc.googlevideo.com"},
		{in: "bücher.example", want: "xn--bcher-kva.example"},
		{in: "BÜCHER.example", want: "xn--bcher-kva.example"},
		{in: "xn--bcher-kva.example", want: "xn--bcher-kva.example"},
		{in: "ｅｘａｍｐｌｅ.com", want: "example.com"},         // full-width maps to ASCII
		{in: "example\u3002com", want: "example.com"},    // ideographic full stop is a dot
		{in: "123.example.com", want: "123.example.com"}, // numeric labels fine when not last
		{in: "a.0x1f.example", want: "a.0x1f.example"},
		{in: "1a", want: "1a"},
		{in: long63 + ".com", want: long63 + ".com"},
		{in: "", errHas: "empty"},
		{in: ".", errHas: "empty"},
		{in: "example.com..", errHas: "invalid host name"},
		{in: "a..b", errHas: "invalid host name"},
		{in: ".example.com", errHas: "invalid host name"},
		{in: strings.Repeat("a", 64) + ".com", errHas: "invalid host name"},
		{in: strings.Repeat("abcdefghi.", 26) + "com", errHas: "invalid host name"},
		{in: "under_score.example.com", errHas: "invalid host name"},
		{in: "-lead.example.com", errHas: "'-'"},
		{in: "trail-.example.com", errHas: "'-'"},
		{in: "exa mple.com", errHas: "invalid host name"},
		{in: "example.com/path", errHas: "invalid host name"},
		{in: "exa\x00mple.com", errHas: "invalid host name"},
		{in: "xn--zz.example", errHas: "invalid host name"}, // bad punycode
		{in: "user@example.com", errHas: "userinfo"},
		{in: "user:pass@example.com", errHas: "userinfo"},
		{in: "example.com:443", errHas: "port"},
		{in: "example.com%2e", errHas: "'%'"},
		// IPv4
		{in: "127.0.0.1", want: "127.0.0.1", isIP: true},
		{in: "93.184.216.34", want: "93.184.216.34", isIP: true},
		{in: "10.0.0.1", want: "10.0.0.1", isIP: true}, // netguard decides reachability, not the name check
		{in: "2130706433", errHas: "ambiguous"},
		{in: "0x7f000001", errHas: "ambiguous"},
		{in: "0X7F000001", errHas: "ambiguous"},
		{in: "0177.0.0.1", errHas: "ambiguous"},
		{in: "127.1", errHas: "ambiguous"},
		{in: "127.0.1", errHas: "ambiguous"},
		{in: "127.000.000.001", errHas: "ambiguous"},
		{in: "1.2.3.4.5", errHas: "ambiguous"},
		{in: "256.1.1.1", errHas: "ambiguous"},
		{in: "example.0x7f", errHas: "ambiguous"},
		{in: "example.0x", errHas: "ambiguous"},
		{in: "example.123", errHas: "ambiguous"},
		{in: "１２７.０.０.１", errHas: "ambiguous"}, // full-width digits: a non-canonical spelling of an address
		{in: "127.0.0.1:80", errHas: "port"},
		// IPv6
		{in: "::1", want: "::1", isIP: true},
		{in: "[::1]", want: "::1", isIP: true},
		{in: "[2001:DB8::1]", want: "2001:db8::1", isIP: true},
		{in: "2001:0db8:0000:0000:0000:0000:0000:0001", want: "2001:db8::1", isIP: true},
		{in: "[::1]:443", errHas: "port"},
		{in: "[::1", errHas: "unterminated"},
		{in: "::ffff:127.0.0.1", errHas: "IPv4-mapped"},
		{in: "[::ffff:7f00:1]", errHas: "IPv4-mapped"},
		{in: "fe80::1%eth0", errHas: "'%'"},
		{in: "[fe80::1%25eth0]", errHas: "'%'"},
		{in: "[127.0.0.1]", errHas: "invalid IPv6"},
		{in: "1:2:3", errHas: "invalid IPv6"},
	}
	for _, tt := range tests {
		got, isIP, err := NormalizeHost(tt.in)
		if tt.errHas != "" {
			if err == nil {
				t.Errorf("NormalizeHost(%q) = %q, %v; want error containing %q", tt.in, got, isIP, tt.errHas)
			} else if !strings.Contains(err.Error(), tt.errHas) {
				t.Errorf("NormalizeHost(%q) error %q; want it to contain %q", tt.in, err, tt.errHas)
			}
			continue
		}
		if err != nil || got != tt.want || isIP != tt.isIP {
			t.Errorf("NormalizeHost(%q) = %q, %v, %v; want %q, %v", tt.in, got, isIP, err, tt.want, tt.isIP)
		}
	}
}

// A normalised host must be a fixed point, or the proxy and the policy could
// disagree after a second pass.
func TestNormalizeHostIdempotent(t *testing.T) {
	for _, in := range []string{"Example.COM.", "bücher.example", "[2001:DB8::1]", "127.0.0.1", "ｅｘａｍｐｌｅ.com"} {
		once, _, err := NormalizeHost(in)
		if err != nil {
			t.Fatalf("NormalizeHost(%q): %v", in, err)
		}
		twice, _, err := NormalizeHost(once)
		if err != nil || twice != once {
			t.Errorf("NormalizeHost(%q) = %q, then %q, %v", in, once, twice, err)
		}
	}
}

func TestNormalizeRuleHost(t *testing.T) {
	tests := []struct {
		in       string
		want     string
		wildcard bool
		ok       bool
	}{
		{"*.example.com", "*.example.com", true, true},
		{"*.EXAMPLE.com.", "*.example.com", true, true},
		{"*.a.b.example.com", "*.a.b.example.com", true, true},
		{"*.com", "", false, false},
		{"*", "", false, false},
		{"*.", "", false, false},
		{"**.example.com", "", false, false},
		{"a.*.example.com", "", false, false},
		{"*example.com", "", false, false},
		{"ex*ample.com", "", false, false},
		{"*.*.example.com", "", false, false},
		{"*.127.0.0.1", "", false, false},
		{"example.com", "example.com", false, true},
	}
	for _, tt := range tests {
		got, wild, _, err := normalizeRuleHost(tt.in)
		if (err == nil) != tt.ok || got != tt.want || wild != tt.wildcard {
			t.Errorf("normalizeRuleHost(%q) = %q, %v, %v; want %q, %v, ok=%v", tt.in, got, wild, err, tt.want, tt.wildcard, tt.ok)
		}
	}
}

func TestParseAuthority(t *testing.T) {
	tests := []struct {
		in   string
		def  int
		host string
		isIP bool
		port int
		ok   bool
	}{
		{"example.com", 80, "example.com", false, 80, true},
		{"Example.COM:8443", 80, "example.com", false, 8443, true},
		{"example.com.:443", 0, "example.com", false, 443, true},
		{"127.0.0.1:3128", 0, "127.0.0.1", true, 3128, true},
		{"[::1]:443", 0, "::1", true, 443, true},
		{"[2001:DB8::1]", 443, "2001:db8::1", true, 443, true},
		{"example.com", 0, "", false, 0, false}, // CONNECT needs a port
		{"", 80, "", false, 0, false},
		{"example.com:", 80, "", false, 0, false},
		{"example.com:0", 80, "", false, 0, false},
		{"example.com:0443", 80, "", false, 0, false},
		{"example.com:+443", 80, "", false, 0, false},
		{"example.com:65536", 80, "", false, 0, false},
		{"example.com:http", 80, "", false, 0, false},
		{"::1", 80, "", false, 0, false},
		{"2001:db8::1:443", 80, "", false, 0, false},
		{"user@example.com:443", 80, "", false, 0, false},
		{"2130706433:80", 80, "", false, 0, false},
		{"[::ffff:127.0.0.1]:80", 80, "", false, 0, false},
	}
	for _, tt := range tests {
		host, isIP, port, err := ParseAuthority(tt.in, tt.def)
		if (err == nil) != tt.ok || host != tt.host || isIP != tt.isIP || port != tt.port {
			t.Errorf("ParseAuthority(%q, %d) = %q, %v, %d, %v; want %q, %v, %d, ok=%v", tt.in, tt.def, host, isIP, port, err, tt.host, tt.isIP, tt.port, tt.ok)
		}
	}
}
