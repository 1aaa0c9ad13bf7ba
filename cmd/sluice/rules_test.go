package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const rulesTestConfig = `version: 1
secrets:
  - name: github
    source: file
    hosts: [api.github.com]
tenants:
  - id: demo
    allow:
      - host: api.github.com
        ports: [443]
        methods: [GET, POST]
        paths: ["/repos/**", "/user"]
        inject:
          - header: Authorization
            value: "Bearer ${secret:github}"
      - host: "*.pythonhosted.org"
        ports: [443]
      - host: plain.example.org
    deny:
      - host: gist.github.com
  - id: watch
    mode: report
    allow:
      - host: pypi.org
`

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRulesCheck(t *testing.T) {
	dir := t.TempDir()
	good := writeFile(t, dir, "good.yaml", rulesTestConfig)
	bad := writeFile(t, dir, "bad.yaml", "version: 1\n"+
		"tenants:\n"+
		"  - id: Demo\n"+
		"    allow:\n"+
		"      - host: \"*.com\"\n"+
		"        ports: [https]\n"+
		"        Methods: [GET]\n")
	semantic := writeFile(t, dir, "semantic.yaml", "version: 1\ntenants:\n  - id: Demo\n    allow:\n      - host: \"*.com\"\n        ports: [0]\n")

	out, errOut, code := runSluice(t, "", "rules", "check", good)
	if code != 0 || out != good+": ok (2 tenants, 5 rules, 1 secrets)\n" || errOut != "" {
		t.Errorf("check good: code %d\nstdout %q\nstderr %q", code, out, errOut)
	}

	out, errOut, code = runSluice(t, "", "rules", "check", "../../examples/quickstart/sluice.yaml")
	if code != 0 || !strings.Contains(out, "sluice.yaml: ok (1 tenants, 4 rules, 1 secrets)") {
		t.Errorf("check quickstart: code %d\nstdout %q\nstderr %q", code, out, errOut)
	}

	// Decoding problems: every one, with file, line and path.
	out, errOut, code = runSluice(t, "", "rules", "check", good, bad)
	if code != 2 {
		t.Errorf("check good+bad: code %d; want 2", code)
	}
	if !strings.Contains(out, good+": ok") {
		t.Errorf("the good file is not reported ok: %q", out)
	}
	for _, want := range []string{
		bad + ":6: tenants[0].allow[0].ports[0]: want integer, got \"https\"",
		bad + ":7: tenants[0].allow[0].\"Methods\": invalid key",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}

	// Validation problems, with lines too.
	_, errOut, code = runSluice(t, "", "rules", "check", semantic)
	if code != 2 {
		t.Errorf("check semantic: code %d; want 2", code)
	}
	for _, want := range []string{
		semantic + ":3: tenants[0].id: invalid tenant id \"Demo\"",
		semantic + ":5: tenants[0].allow[0].host: wildcard \"*.com\" is too broad",
		semantic + ":6: tenants[0].allow[0].ports[0]: port must be 1-65535, got 0",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}

	_, errOut, code = runSluice(t, "", "rules", "check", filepath.Join(dir, "missing.yaml"))
	if code != 2 || !strings.Contains(errOut, "missing.yaml: no such file or directory") {
		t.Errorf("check missing: code %d, stderr %q", code, errOut)
	}
	empty := writeFile(t, dir, "empty.yaml", "")
	_, errOut, code = runSluice(t, "", "rules", "check", empty)
	if code != 2 || !strings.Contains(errOut, "empty configuration") {
		t.Errorf("check empty: code %d, stderr %q", code, errOut)
	}
	if _, _, code = runSluice(t, "", "rules", "check"); code != 1 {
		t.Errorf("check without files: code %d; want 1 (usage)", code)
	}
}

func TestRulesTest(t *testing.T) {
	cfg := writeFile(t, t.TempDir(), "sluice.yaml", rulesTestConfig)
	tests := []struct {
		name   string
		args   []string
		code   int
		wants  []string
		avoids []string
	}{
		{"allowed and intercepted", []string{"GET", "https://api.github.com/repos/acme/x"}, 0, []string{
			"tenant:   demo (mode enforce)", "target:   GET https://api.github.com:443/repos/acme/x",
			"connect:  api.github.com:443 -> intercept", "decision: allow\n", "rule:     demo/allow/0", "reason:   allowed",
		}, nil},
		{"host and path normalised", []string{"POST", "https://API.GitHub.com./user/x/%2e%2E/"}, 3, []string{
			"target:   POST https://api.github.com:443/user/", "decision: deny", "reason:   not_allowlisted",
		}, nil},
		{"dot segments cannot escape the allowlist", []string{"GET", "https://api.github.com/repos/../admin"}, 3, []string{
			"target:   GET https://api.github.com:443/admin", "decision: deny",
		}, nil},
		{"method not allowed", []string{"DELETE", "https://api.github.com/repos/acme/x"}, 3, []string{"decision: deny", "reason:   not_allowlisted"}, nil},
		{"wrong port", []string{"GET", "https://api.github.com:8443/repos/acme/x"}, 3, []string{"connect:  api.github.com:8443 -> deny [not_allowlisted]", "decision: deny"}, nil},
		{"deny rule", []string{"GET", "https://gist.github.com/"}, 3, []string{"connect:  gist.github.com:443 -> deny [denied_by_rule, rule demo/deny/0]", "rule:     demo/deny/0", "reason:   denied_by_rule"}, nil},
		{"wildcard splices", []string{"GET", "https://files.pythonhosted.org/packages/x.whl"}, 0, []string{"-> splice", "decision: allow", "rule:     demo/allow/1"}, nil},
		{"wildcard never the apex", []string{"GET", "https://pythonhosted.org/"}, 3, []string{"decision: deny"}, nil},
		{"lookalike", []string{"GET", "https://evilpythonhosted.org/"}, 3, []string{"decision: deny"}, nil},
		{"plain http is decided as a request", []string{"GET", "http://plain.example.org/a"}, 0, []string{"target:   GET http://plain.example.org:80/a", "decision: allow", "rule:     demo/allow/2"}, nil},
		{"connect form", []string{"CONNECT", "files.pythonhosted.org:443"}, 0, []string{"target:   CONNECT files.pythonhosted.org:443", "-> splice", "decision: allow"}, nil},
		{"connect intercept", []string{"CONNECT", "api.github.com:443"}, 0, []string{"-> intercept", "decision: allow"}, nil},
		{"connect needs a port", []string{"CONNECT", "api.github.com"}, 3, []string{"reason:   invalid_host"}, nil},
		{"encoded slash", []string{"GET", "https://api.github.com/repos%2fx"}, 3, []string{"decision: deny", "reason:   ambiguous_path"}, nil},
		{"double slash", []string{"GET", "https://api.github.com/repos//x"}, 3, []string{"reason:   ambiguous_path"}, nil},
		{"numeric host", []string{"GET", "http://2130706433/"}, 3, []string{"reason:   invalid_host", "ambiguous"}, nil},
		{"mapped ipv6", []string{"GET", "http://[::ffff:127.0.0.1]/"}, 3, []string{"reason:   invalid_host"}, nil},
		{"userinfo", []string{"GET", "https://user:pw@api.github.com/repos/x"}, 3, []string{"reason:   bad_request"}, []string{"pw"}},
		{"not http", []string{"GET", "ftp://api.github.com/"}, 3, []string{"reason:   bad_request"}, nil},
		{"bad method", []string{"GE T", "https://api.github.com/"}, 3, []string{"reason:   bad_request"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"rules", "test", "--config", cfg, "--tenant", "demo"}, tt.args...)
			out, errOut, code := runSluice(t, "", args...)
			if code != tt.code {
				t.Errorf("exit %d; want %d\nstdout:\n%s\nstderr:\n%s", code, tt.code, out, errOut)
			}
			for _, w := range tt.wants {
				if !strings.Contains(out, w) {
					t.Errorf("stdout lacks %q:\n%s", w, out)
				}
			}
			for _, a := range tt.avoids {
				if strings.Contains(out+errOut, a) {
					t.Errorf("output contains %q:\n%s%s", a, out, errOut)
				}
			}
		})
	}
}

func TestRulesTestModesAndErrors(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "sluice.yaml", rulesTestConfig)

	out, _, code := runSluice(t, "", "rules", "test", "--config", cfg, "--tenant", "watch", "GET", "https://api.github.com/repos/acme/x")
	if code != 0 || !strings.Contains(out, "tenant:   watch (mode report)") || !strings.Contains(out, "decision: allow (report mode: enforce would deny)") ||
		!strings.Contains(out, "reason:   not_allowlisted") {
		t.Errorf("report mode: exit %d\n%s", code, out)
	}
	// Another tenant's rules never answer: watch allows pypi.org, demo does not.
	if _, _, code := runSluice(t, "", "rules", "test", "--config", cfg, "--tenant", "demo", "GET", "https://pypi.org/simple/"); code != 3 {
		t.Errorf("demo reached watch's rule: exit %d", code)
	}
	out, _, code = runSluice(t, "", "rules", "test", "--config", cfg, "--tenant", "nobody", "GET", "https://pypi.org/")
	if code != 3 || !strings.Contains(out, "reason:   unknown_tenant") || !strings.Contains(out, "(mode -)") {
		t.Errorf("unknown tenant: exit %d\n%s", code, out)
	}
	bad := writeFile(t, dir, "bad.yaml", "version: 2\n")
	_, errOut, code := runSluice(t, "", "rules", "test", "--config", bad, "--tenant", "demo", "GET", "https://pypi.org/")
	if code != 2 || !strings.Contains(errOut, bad+":1: version: unsupported version 2") {
		t.Errorf("invalid config: exit %d\n%s", code, errOut)
	}
	if _, _, code := runSluice(t, "", "rules", "test", "--config", cfg, "GET", "https://pypi.org/"); code != 1 {
		t.Errorf("missing --tenant: exit %d; want 1", code)
	}
}
