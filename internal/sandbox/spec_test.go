package sandbox

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
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

// TestSeccompProgram runs the assembled filter in the x/net/bpf VM over
// synthetic seccomp_data and checks each decision.
func TestSeccompProgram(t *testing.T) {
	raw, err := seccompProgram()
	if err != nil {
		t.Fatal(err)
	}
	ins, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatal("filter does not disassemble")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatal(err)
	}
	arch, _ := auditArch()
	data := func(a uint32, nr uint32, args ...uint64) []byte {
		b := make([]byte, 64)
		le := func(off int, v uint64, n int) {
			for i := 0; i < n; i++ {
				b[off+i] = byte(v >> (8 * i))
			}
		}
		le(0, uint64(nr), 4)
		le(4, uint64(a), 4)
		for i, v := range args {
			le(16+8*i, v, 8)
		}
		return b
	}
	// The VM only reads big-endian; seccomp_data is native (little) endian,
	// so the filter's loads are checked against byte-swapped input below.
	swap := func(b []byte) []byte {
		out := make([]byte, len(b))
		for i := 0; i+4 <= len(b); i += 4 {
			out[i], out[i+1], out[i+2], out[i+3] = b[i+3], b[i+2], b[i+1], b[i]
		}
		return out
	}
	eperm := uint32(seccompRetErrno | uint32(unix.EPERM))
	cases := []struct {
		name string
		in   []byte
		want uint32
	}{
		{"getpid", data(arch, unix.SYS_GETPID), seccompRetAllow},
		{"wrong arch", data(arch^1, unix.SYS_GETPID), seccompRetKillProcess},
		{"mount", data(arch, unix.SYS_MOUNT), eperm},
		{"setns", data(arch, unix.SYS_SETNS), eperm},
		{"bpf", data(arch, unix.SYS_BPF), eperm},
		{"io_uring", data(arch, unix.SYS_IO_URING_SETUP), eperm},
		{"ptrace", data(arch, unix.SYS_PTRACE), eperm},
		{"clone thread", data(arch, unix.SYS_CLONE, unix.CLONE_VM|unix.CLONE_THREAD|unix.CLONE_SIGHAND), seccompRetAllow},
		{"clone newuser", data(arch, unix.SYS_CLONE, unix.CLONE_NEWUSER|uint64(unix.SIGCHLD)), eperm},
		{"clone3", data(arch, unix.SYS_CLONE3), seccompRetErrno | uint32(unix.ENOSYS)},
		{"unshare fs", data(arch, unix.SYS_UNSHARE, unix.CLONE_FS), seccompRetAllow},
		{"unshare net", data(arch, unix.SYS_UNSHARE, unix.CLONE_NEWNET), eperm},
		{"unshare time", data(arch, unix.SYS_UNSHARE, unix.CLONE_NEWTIME), eperm},
		{"tcp socket", data(arch, unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC), seccompRetAllow},
		{"unix socket", data(arch, unix.SYS_SOCKET, unix.AF_UNIX, unix.SOCK_STREAM), seccompRetAllow},
		{"raw socket", data(arch, unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_RAW|unix.SOCK_NONBLOCK), eperm},
		{"packet", data(arch, unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_DGRAM), eperm},
		{"netlink", data(arch, unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_DGRAM), eperm},
		{"ioctl tcgets", data(arch, unix.SYS_IOCTL, 0, unix.TCGETS), seccompRetAllow},
		{"ioctl tiocsti", data(arch, unix.SYS_IOCTL, 0, unix.TIOCSTI), eperm},
	}
	for _, c := range cases {
		got, err := vm.Run(swap(c.in))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if uint32(got) != c.want {
			t.Errorf("%s: filter returned %#x, want %#x", c.name, got, c.want)
		}
	}
}
