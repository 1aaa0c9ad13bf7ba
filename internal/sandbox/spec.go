package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/sluicehq/sluice/internal/sandbox/nsinit"
)

// Paths inside the sandbox.
const (
	WorkspacePath = nsinit.WorkspacePath
	CABundlePath  = nsinit.CABundlePath
	// RelayAddr is where the sandbox reaches the proxy: a listener inside the
	// sandbox's network namespace whose connections the launcher relays.
	RelayAddr   = nsinit.RelayAddr
	sandboxPATH = nsinit.PATH
)

// Exit statuses of a run that did not end with the command's own status.
const (
	ExitTimeout      = 124                     // the wall-clock timeout killed the sandbox
	ExitLaunchFailed = nsinit.ExitLaunchFailed // the sandbox could not be started
	ExitOOM          = 137                     // the memory limit killed the sandbox (128 + SIGKILL)
)

// Reasons a sandbox was killed (Result.KilledBy, Event.KilledBy).
const (
	KilledByTimeout = "timeout"
	KilledByMemory  = "memory"
	KilledBySignal  = "signal"
)

// Limit mechanisms (Result.Mechanism).
const (
	MechCgroupV2 = "cgroup-v2"
	MechCgroupV1 = "cgroup-v1"
	MechRlimit   = "rlimit"
)

// Defaults and bounds.
const (
	DefaultTimeout   = 30 * time.Minute
	MaxTimeout       = 24 * time.Hour
	DefaultMemory    = 512 << 20
	DefaultPids      = 256
	DefaultDisk      = 256 << 20
	DefaultFiles     = 16384
	DefaultTmpSize   = 64 << 20
	DefaultTmpFiles  = 4096
	maxCABundleBytes = 4 << 20
	maxEnvBytes      = 128 << 10
)

// Limits bound one sandbox. Zero values are replaced by the defaults.
type Limits struct {
	Timeout     time.Duration
	MemoryBytes int64
	CPUs        float64 // 0 = no CPU cap
	Pids        int64
	DiskBytes   int64 // workspace tmpfs size (rounded up to whole pages)
	Files       int64 // workspace inodes (files, directories, symlinks)
	TmpBytes    int64
	TmpFiles    int64
}

func (l Limits) withDefaults() Limits {
	if l.Timeout == 0 {
		l.Timeout = DefaultTimeout
	}
	if l.MemoryBytes == 0 {
		l.MemoryBytes = DefaultMemory
	}
	if l.Pids == 0 {
		l.Pids = DefaultPids
	}
	if l.DiskBytes == 0 {
		l.DiskBytes = DefaultDisk
	}
	if l.Files == 0 {
		l.Files = DefaultFiles
	}
	if l.TmpBytes == 0 {
		l.TmpBytes = DefaultTmpSize
	}
	if l.TmpFiles == 0 {
		l.TmpFiles = DefaultTmpFiles
	}
	return l
}

func (l Limits) validate() error {
	switch {
	case l.Timeout < time.Second || l.Timeout > MaxTimeout:
		return fmt.Errorf("timeout %s is out of range [1s, %s]", l.Timeout, MaxTimeout)
	case l.MemoryBytes < 16<<20:
		return fmt.Errorf("memory limit %d bytes is below the 16MiB minimum", l.MemoryBytes)
	case l.CPUs < 0 || l.CPUs > 1024:
		return fmt.Errorf("cpus %g is out of range [0, 1024]", l.CPUs)
	case l.Pids < 8 || l.Pids > 1<<22:
		return fmt.Errorf("pids limit %d is out of range [8, %d]", l.Pids, 1<<22)
	case l.DiskBytes < 4096 || l.DiskBytes > 1<<40:
		return fmt.Errorf("disk limit %d bytes is out of range [4KiB, 1TiB]", l.DiskBytes)
	case l.Files < 1 || l.Files > 1<<30:
		return fmt.Errorf("files limit %d is out of range [1, %d]", l.Files, 1<<30)
	case l.TmpBytes < 4096 || l.TmpBytes > 1<<40:
		return fmt.Errorf("tmp size %d bytes is out of range [4KiB, 1TiB]", l.TmpBytes)
	case l.TmpFiles < 1 || l.TmpFiles > 1<<30:
		return fmt.Errorf("tmp files limit %d is out of range [1, %d]", l.TmpFiles, 1<<30)
	}
	return nil
}

// Spec is one sandbox to run.
type Spec struct {
	Tenant  string
	Command []string // argv; Command[0] is looked up in the sandbox's PATH
	// Proxy is where relayed connections go: "host:port" (TCP) or "unix:/path".
	Proxy string
	// Workspace, if set, is a host directory copied into /workspace before the
	// command starts (symlinks are copied as symlinks, never followed).
	Workspace string
	// KeepDir, if set, receives a copy of /workspace after the command exits.
	KeepDir string
	// CABundle is a host PEM file made visible read-only at CABundlePath.
	CABundle string
	// RootDir is the host directory whose top-level entries form the
	// read-only root; default "/".
	RootDir string
	Env     []string // extra KEY=VALUE pairs (validated, may not touch proxy/CA variables)
	Term    string   // TERM value to pass, when the caller decided the sandbox is interactive
	Limits  Limits
	// AllowNoLandlock lets the run continue on a kernel without Landlock
	// (reported in Result and the audit record). Off by default: fail closed.
	AllowNoLandlock bool
	Stdin           io.Reader
	Stdout, Stderr  io.Writer
}

// Result is how a run ended.
type Result struct {
	SandboxID string
	ExitCode  int    // the command's status, or 128+signal, 124, 137, 125
	KilledBy  string // "", timeout, memory, signal
	Mechanism string // cgroup-v2, cgroup-v1 or rlimit
	Landlock  string // e.g. "abi 7: fs, net connect 3128, scope" or "unavailable"
	Message   string // one line for stderr when not a plain exit ("" otherwise)
	Start     time.Time
	End       time.Time
}

// TokenMinter mints the sandbox's proxy credential.
type TokenMinter interface {
	Mint(tenant, sandbox string, ttl time.Duration) (string, error)
}

// Recorder receives the launch and run audit events.
type Recorder interface {
	Record(ctx context.Context, ev Event) error
}

// Event kinds.
const (
	EventLaunch = "launch"
	EventRun    = "run"
)

// Event is one audit record of the launcher. It never carries the token or an
// environment value: only variable names.
type Event struct {
	Kind      string // launch | run
	Time      time.Time
	UID       int
	User      string
	Tenant    string
	Sandbox   string
	Command   []string
	EnvNames  []string
	Limits    Limits
	Mechanism string
	Landlock  string
	Start     time.Time
	End       time.Time // run only
	ExitCode  int       // run only
	KilledBy  string    // run only
	Error     string    // launch failure, if any
}

// proxyVars must point at the relay; a caller may not override them in any case.
var proxyVarNames = []string{"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"}

// caVarNames are the variables common toolchains read for an extra or
// replacement CA bundle. All point at CABundlePath.
var caVarNames = []string{
	"SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
	"PIP_CERT", "GIT_SSL_CAINFO", "npm_config_cafile", "CARGO_HTTP_CAINFO",
	"AWS_CA_BUNDLE", "DENO_CERT",
}

func reservedEnv(name string) bool {
	up := strings.ToUpper(name)
	for _, n := range proxyVarNames {
		if up == n {
			return true
		}
	}
	for _, n := range caVarNames {
		if up == strings.ToUpper(n) {
			return true
		}
	}
	return up == "JAVA_TOOL_OPTIONS" || up == "SSL_CERT_DIR"
}

func validEnvName(k string) bool {
	if k == "" || len(k) > 256 {
		return false
	}
	for i, c := range k {
		switch {
		case c == '_', c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// ValidateEnv checks caller-supplied KEY=VALUE pairs and returns their names.
func ValidateEnv(env []string) ([]string, error) {
	seen := map[string]bool{}
	total := 0
	names := make([]string, 0, len(env))
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("env %q: want KEY=VALUE", k)
		}
		if !validEnvName(k) {
			return nil, fmt.Errorf("env %q: name must match [A-Za-z_][A-Za-z0-9_]*", k)
		}
		if reservedEnv(k) {
			return nil, fmt.Errorf("env %s: the proxy and CA variables are set by sluice and cannot be overridden", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return nil, fmt.Errorf("env %s: value contains a NUL byte", k)
		}
		if seen[k] {
			return nil, fmt.Errorf("env %s: given twice", k)
		}
		seen[k] = true
		total += len(kv) + 1
		if total > maxEnvBytes {
			return nil, fmt.Errorf("env: more than %d bytes", maxEnvBytes)
		}
		names = append(names, k)
	}
	return names, nil
}

// BuildEnv returns the sandbox's whole environment, built from nothing: the
// launcher's own environment is never consulted.
func BuildEnv(tenant, token string, hasCA bool, term string, extra []string) []string {
	u := url.URL{Scheme: "http", User: url.UserPassword(tenant, token), Host: RelayAddr}
	proxy := u.String()
	env := []string{
		"PATH=" + sandboxPATH,
		"HOME=" + WorkspacePath,
		"LANG=C.UTF-8",
	}
	if term != "" {
		env = append(env, "TERM="+term)
	}
	for _, n := range proxyVarNames[:3] {
		env = append(env, n+"="+proxy, strings.ToLower(n)+"="+proxy)
	}
	// Empty on purpose: no loopback exception, every connection goes through the proxy.
	env = append(env, "NO_PROXY=", "no_proxy=")
	if hasCA {
		for _, n := range caVarNames {
			env = append(env, n+"="+CABundlePath)
		}
	}
	env = append(env, extra...)
	return env
}

// ValidTerm reports whether t is a plausible terminal type to pass through.
func ValidTerm(t string) bool {
	if t == "" || len(t) > 64 {
		return false
	}
	for _, c := range t {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("-_.+", c)) {
			return false
		}
	}
	return true
}

func (s *Spec) validate() error {
	if s.Tenant == "" {
		return errors.New("tenant is required")
	}
	if len(s.Command) == 0 || s.Command[0] == "" {
		return errors.New("a command is required")
	}
	for _, a := range s.Command {
		if strings.IndexByte(a, 0) >= 0 {
			return errors.New("command argument contains a NUL byte")
		}
	}
	if s.Proxy == "" {
		return errors.New("proxy address is required")
	}
	if p, ok := strings.CutPrefix(s.Proxy, "unix:"); ok {
		if !strings.HasPrefix(p, "/") {
			return fmt.Errorf("proxy %q: unix socket path must be absolute", s.Proxy)
		}
	} else if !strings.Contains(s.Proxy, ":") {
		return fmt.Errorf("proxy %q: want host:port or unix:/path", s.Proxy)
	}
	if _, err := ValidateEnv(s.Env); err != nil {
		return err
	}
	if s.Term != "" && !ValidTerm(s.Term) {
		return fmt.Errorf("TERM value is not a plain terminal name")
	}
	if s.Workspace != "" {
		fi, err := os.Stat(s.Workspace)
		if err != nil {
			return fmt.Errorf("workspace: %w", err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("workspace %s is not a directory", s.Workspace)
		}
	}
	if s.RootDir != "" {
		fi, err := os.Stat(s.RootDir)
		if err != nil || !fi.IsDir() {
			return fmt.Errorf("root %s is not a directory", s.RootDir)
		}
	}
	return s.Limits.validate()
}

func sortedCopy(s []string) []string {
	c := append([]string(nil), s...)
	sort.Strings(c)
	return c
}
