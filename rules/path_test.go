package rules

import (
	"strings"
	"testing"
)

func TestNormalizePath(t *testing.T) {
	tests := []struct {
		in, want string
		errHas   string
	}{
		{in: "", want: "/"},
		{in: "/", want: "/"},
		{in: "/a/b", want: "/a/b"},
		{in: "/a/b/", want: "/a/b/"},
		{in: "/a/../b", want: "/b"},
		{in: "/a/./b", want: "/a/b"},
		{in: "/a/b/..", want: "/a/"},
		{in: "/a/b/.", want: "/a/b/"},
		{in: "/..", want: "/"},
		{in: "/../../etc/passwd", want: "/etc/passwd"},
		{in: "/api/%2e%2e/admin", want: "/admin"},
		{in: "/api/%2E%2e/admin", want: "/admin"},
		{in: "/api/%2E%2e/", want: "/"},
		{in: "/api/.%2e/x", want: "/x"},
		{in: "/api/%2e/x", want: "/api/x"},
		{in: "/%7euser/%41bc", want: "/~user/Abc"},
		{in: "/a%3ab", want: "/a%3Ab"},
		{in: "/a%3Ab", want: "/a%3Ab"},
		{in: "/caf%c3%a9", want: "/caf%C3%A9"},
		{in: "/a b", want: "/a%20b"},
		{in: "/a\"b<c>", want: "/a%22b%3Cc%3E"},
		{in: "/q?x", want: "/q%3Fx"},
		{in: "/%25", want: "/%25"},
		{in: "/%252e%252e/x", want: "/%252e%252e/x"}, // double encoding stays encoded: one decode upstream gives a literal %2e
		{in: "/a;b=c/d", want: "/a;b=c/d"},
		{in: "/repos/acme/x:y@z", want: "/repos/acme/x:y@z"},
		{in: "/a%2fb", errHas: "%2F"},
		{in: "/a%2Fb", errHas: "%2F"},
		{in: "/a\\b", errHas: "'\\'"},
		{in: "/a%5cb", errHas: "%5C"},
		{in: "/a%5C..%5Cb", errHas: "%5C"},
		{in: "/a\x00b", errHas: "NUL"},
		{in: "/a%00b", errHas: "NUL"},
		{in: "/a%0d%0aHost:x", errHas: "control"},
		{in: "/a\tb", errHas: "control"},
		{in: "/a%7f", errHas: "control"},
		{in: "/a%", errHas: "invalid percent"},
		{in: "/a%2", errHas: "invalid percent"},
		{in: "/a%zz", errHas: "invalid percent"},
		{in: "/a%%32%65", errHas: "invalid percent"},
		{in: "a/b", errHas: "start with '/'"},
		{in: "*", errHas: "start with '/'"},
		{in: "//a", errHas: "empty path segment"},
		{in: "/api//admin", errHas: "empty path segment"},
		{in: "/public/..;/admin", errHas: "parameters"},
		{in: "/public/.;x/admin", errHas: "parameters"},
		{in: "/public/%2e%2e;/admin", errHas: "parameters"},
	}
	for _, tt := range tests {
		got, err := NormalizePath(tt.in)
		if tt.errHas != "" {
			if err == nil || !strings.Contains(err.Error(), tt.errHas) {
				t.Errorf("NormalizePath(%q) = %q, %v; want error containing %q", tt.in, got, err, tt.errHas)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("NormalizePath(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			continue
		}
		if again, err := NormalizePath(got); err != nil || again != got {
			t.Errorf("NormalizePath(%q) = %q is not a fixed point: %q, %v", tt.in, got, again, err)
		}
	}
}

func TestPathPattern(t *testing.T) {
	tests := []struct {
		pattern string
		yes     []string
		no      []string
	}{
		{"/exact", []string{"/exact"}, []string{"/exact/", "/exactx", "/exac", "/", "/exact/a"}},
		{"/", []string{"/"}, []string{"/a"}},
		{"/api/**", []string{"/api", "/api/", "/api/a", "/api/a/b/c"}, []string{"/apix", "/apix/a", "/ap", "/", "/x/api/a"}},
		{"/api/*", []string{"/api/a", "/api/abc"}, []string{"/api/a/b", "/api/", "/api", "/apix/a"}},
		{"/repos/*/issues", []string{"/repos/acme/issues"}, []string{"/repos/acme/issues/1", "/repos//issues", "/repos/issues", "/repos/a/b/issues"}},
		{"/repos/*/**", []string{"/repos/acme", "/repos/acme/", "/repos/acme/x/y"}, []string{"/repos", "/repos/", "/reposx/a"}},
		{"/**", []string{"/", "/a", "/a/b/"}, nil},
		{"/a/", []string{"/a/"}, []string{"/a", "/a/b"}},
		{"/caf%C3%A9/*", []string{"/caf%C3%A9/x"}, []string{"/café/x"}},
	}
	for _, tt := range tests {
		pp, err := compilePathPattern(tt.pattern)
		if err != nil {
			t.Errorf("compilePathPattern(%q): %v", tt.pattern, err)
			continue
		}
		for _, p := range tt.yes {
			if !pp.match(p, false) || !pp.match(p, true) {
				t.Errorf("%q should match %q", tt.pattern, p)
			}
		}
		for _, p := range tt.no {
			if pp.match(p, false) {
				t.Errorf("%q should not match %q", tt.pattern, p)
			}
		}
	}
}

func TestPathPatternInvalid(t *testing.T) {
	for _, p := range []string{
		"", "api", "/api/**/x", "/api/a*", "/api/*x", "/a/***", "/a/../b", "/a/./b",
		"/a%2fb", "/a//b", "/%7euser", "/a%3ab", "/a b", "/a\\b",
	} {
		if _, err := compilePathPattern(p); err == nil {
			t.Errorf("compilePathPattern(%q) succeeded; want an error", p)
		}
	}
}

// Deny patterns match spellings that some servers treat as equal; allow
// patterns do not.
func TestPathPatternLenient(t *testing.T) {
	tests := []struct {
		pattern string
		yes     []string // lenient only
		no      []string // not even lenient
	}{
		{"/admin/**", []string{"/Admin/x", "/ADMIN", "/admin;jsessionid=1/x", "/AdMiN;x"}, []string{"/adminx", "/x/admin", "/admin%3Bx/y"}},
		{"/admin", []string{"/admin/", "/Admin/", "/admin;x"}, []string{"/admin/x", "/admin//"}},
		{"/api/*/delete", []string{"/api/1/DELETE", "/api/1/delete;x", "/api/1/delete/"}, []string{"/api/delete", "/api/1/2/delete"}},
	}
	for _, tt := range tests {
		pp, err := compilePathPattern(tt.pattern)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range tt.yes {
			if !pp.match(p, true) {
				t.Errorf("lenient %q should match %q", tt.pattern, p)
			}
			if pp.match(p, false) {
				t.Errorf("exact %q should not match %q", tt.pattern, p)
			}
		}
		for _, p := range tt.no {
			if pp.match(p, true) {
				t.Errorf("lenient %q should not match %q", tt.pattern, p)
			}
		}
	}
}
