package sandbox

import (
	"strings"
	"testing"
	"time"
)

func TestValidateEnv(t *testing.T) {
	good := []string{"FOO=bar", "_X=", "a1=b=c", "LD_PRELOAD=/x"}
	if names, err := ValidateEnv(good); err != nil || strings.Join(names, ",") != "FOO,_X,a1,LD_PRELOAD" {
		t.Errorf("ValidateEnv(%v) = %v, %v", good, names, err)
	}
	for _, bad := range [][]string{
		{"NOEQUALS"}, {"=x"}, {"1A=x"}, {"A-B=x"}, {"A=x\x00y"}, {"A=1", "A=2"},
		{"HTTP_PROXY=x"}, {"https_proxy=x"}, {"All_Proxy=x"}, {"NO_PROXY=x"}, {"no_proxy=x"},
		{"SSL_CERT_FILE=x"}, {"NPM_CONFIG_CAFILE=x"}, {"JAVA_TOOL_OPTIONS=x"}, {"SSL_CERT_DIR=x"},
		{"A=" + strings.Repeat("x", maxEnvBytes)},
	} {
		if _, err := ValidateEnv(bad); err == nil {
			t.Errorf("ValidateEnv(%q) accepted", bad)
		} else if strings.Contains(err.Error(), "=x") {
			t.Errorf("error repeats the value: %v", err)
		}
	}
}

func TestBuildEnv(t *testing.T) {
	env := BuildEnv("acme", "tok/en+", true, "", []string{"FOO=1"})
	m := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if _, dup := m[k]; dup {
			t.Errorf("%s set twice", k)
		}
		m[k] = v
	}
	want := "http://acme:tok%2Fen+@127.0.0.1:3128"
	for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"} {
		if m[k] != want {
			t.Errorf("%s = %q, want %q", k, m[k], want)
		}
	}
	for _, k := range []string{"NO_PROXY", "no_proxy"} {
		if v, ok := m[k]; !ok || v != "" {
			t.Errorf("%s = %q (set %v), want set and empty", k, v, ok)
		}
	}
	for _, k := range caVarNames {
		if m[k] != CABundlePath {
			t.Errorf("%s = %q", k, m[k])
		}
	}
	if _, ok := m["TERM"]; ok || m["FOO"] != "1" || m["HOME"] != WorkspacePath {
		t.Errorf("env = %v", env)
	}
	if noCA := BuildEnv("acme", "t", false, "xterm", nil); strings.Contains(strings.Join(noCA, " "), "SSL_CERT_FILE") || !strings.Contains(strings.Join(noCA, " "), "TERM=xterm") {
		t.Errorf("env without CA = %v", noCA)
	}
}

func TestLimitsValidate(t *testing.T) {
	if err := (Limits{}).withDefaults().validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
	for name, l := range map[string]Limits{
		"timeout":  {Timeout: time.Millisecond},
		"long":     {Timeout: 48 * time.Hour},
		"memory":   {MemoryBytes: 1 << 20},
		"cpus":     {CPUs: -1},
		"pids":     {Pids: 2},
		"disk":     {DiskBytes: 100},
		"files":    {Files: -1},
		"tmp":      {TmpBytes: 1},
		"tmpfiles": {TmpFiles: -5},
	} {
		if err := l.withDefaults().validate(); err == nil {
			t.Errorf("%s: %+v accepted", name, l)
		}
	}
}

func TestSpecValidate(t *testing.T) {
	ok := Spec{Tenant: "acme", Command: []string{"true"}, Proxy: "127.0.0.1:8080"}
	ok.Limits = ok.Limits.withDefaults()
	if err := ok.validate(); err != nil {
		t.Fatalf("valid spec refused: %v", err)
	}
	for name, mut := range map[string]func(*Spec){
		"tenant":    func(s *Spec) { s.Tenant = "" },
		"command":   func(s *Spec) { s.Command = nil },
		"nul":       func(s *Spec) { s.Command = []string{"a\x00b"} },
		"proxy":     func(s *Spec) { s.Proxy = "" },
		"unix":      func(s *Spec) { s.Proxy = "unix:relative" },
		"noport":    func(s *Spec) { s.Proxy = "proxyhost" },
		"env":       func(s *Spec) { s.Env = []string{"HTTP_PROXY=x"} },
		"term":      func(s *Spec) { s.Term = "xterm;rm -rf" },
		"workspace": func(s *Spec) { s.Workspace = "/nonexistent/dir" },
		"root":      func(s *Spec) { s.RootDir = "/etc/passwd" },
	} {
		s := ok
		mut(&s)
		if err := s.validate(); err == nil {
			t.Errorf("%s: invalid spec accepted", name)
		}
	}
}
