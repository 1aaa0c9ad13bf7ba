package sandbox_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/rules"
)

// The tests run the real launcher: the sluice binary, built once, re-executes
// itself as the sandbox's init. They need root (as CI has) for cgroups and
// user namespaces mapped to another uid.

var bin struct {
	sluice, probe, dir string
}

func TestMain(m *testing.M) {
	if os.Geteuid() != 0 {
		fmt.Println("sandbox tests need root (cgroups, id-mapped user namespaces); skipping")
		os.Exit(0)
	}
	dir, err := os.MkdirTemp("", "sluice-sandbox-test-")
	if err != nil {
		panic(err)
	}
	bin.dir = dir
	bin.sluice = os.Getenv("SLUICE_TEST_BINARY") // a prebuilt binary, for when cmd/sluice is mid-edit
	if bin.sluice == "" {
		bin.sluice = filepath.Join(dir, "sluice")
		build(bin.sluice, "../../cmd/sluice")
	}
	bin.probe = filepath.Join(dir, "probe")
	build(bin.probe, "./testdata/probe")
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func build(out, pkg string) {
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building %s: %v\n%s", pkg, err, b)
		os.Exit(1)
	}
}

// env is one test's world: a token key, a state dir, an origin and a fake
// forward proxy (a stand-in for `sluice serve`) that checks the sandbox
// credential and records who asked for what.
type env struct {
	t        testing.TB
	key      string
	keyVal   identity.Key
	state    string
	origin   *httptest.Server
	proxy    *httptest.Server
	mu       sync.Mutex
	seen     []seenReq
	marker   string
	baseArgs []string
}

type seenReq struct {
	tenant, sandbox, host string
}

func newEnv(t testing.TB) *env {
	t.Helper()
	dir := t.TempDir()
	e := &env{t: t, key: filepath.Join(dir, "token.key"), state: filepath.Join(dir, "state")}
	if err := identity.GenerateKeyFile(e.key); err != nil {
		t.Fatal(err)
	}
	k, err := identity.LoadKeyFile(e.key)
	if err != nil {
		t.Fatal(err)
	}
	e.keyVal = k
	auth, err := identity.NewAuthenticator(identity.CredentialsFromTenants([]rules.TenantSpec{{ID: "acme"}}), &k, nil)
	if err != nil {
		t.Fatal(err)
	}
	e.origin = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "origin-ok")
	}))
	t.Cleanup(e.origin.Close)
	originAddr := e.origin.Listener.Addr().String()
	tr := &http.Transport{Proxy: nil, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", originAddr) // every host name resolves to the origin
	}}
	t.Cleanup(tr.CloseIdleConnections)
	e.proxy = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := auth.Authenticate(r.Header.Get("Proxy-Authorization"), time.Now())
		if err != nil {
			w.Header().Set("Proxy-Authenticate", `Basic realm="sluice"`)
			http.Error(w, "auth: "+err.Error(), http.StatusProxyAuthRequired)
			return
		}
		e.mu.Lock()
		e.seen = append(e.seen, seenReq{p.Tenant, p.Sandbox, r.URL.Host})
		e.mu.Unlock()
		if !r.URL.IsAbs() {
			http.Error(w, "want absolute-form", http.StatusBadRequest)
			return
		}
		out, _ := http.NewRequestWithContext(r.Context(), r.Method, r.URL.String(), nil)
		resp, err := tr.RoundTrip(out)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	}))
	t.Cleanup(e.proxy.Close)
	var b [8]byte
	rand.Read(b[:])
	e.marker = fmt.Sprintf("m%x", b)
	e.baseArgs = []string{"run", "--tenant", "acme", "--key", e.key, "--state-dir", e.state,
		"--proxy", e.proxy.Listener.Addr().String(), "--env", "SLUICE_TEST_MARK=" + e.marker}
	t.Cleanup(func() { e.assertNothingLeft() })
	return e
}

type result struct {
	stdout, stderr string
	code           int
	sandbox        string
}

var sandboxIDRe = regexp.MustCompile(`sandbox (sb-[0-9a-f]{16})`)

// run runs sluice with the base arguments, extra flags, then "--" and argv.
func (e *env) run(flags []string, argv ...string) result {
	e.t.Helper()
	return e.runEnv(nil, flags, argv...)
}

func (e *env) runEnv(extraEnv []string, flags []string, argv ...string) result {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	args := append(append(append([]string{}, e.baseArgs...), flags...), "--")
	cmd := exec.CommandContext(ctx, bin.sluice, append(args, argv...)...)
	cmd.Env = append(os.Environ(), extraEnv...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatalf("running sluice: %v", err)
	}
	if m := sandboxIDRe.FindStringSubmatch(r.stderr); m != nil {
		r.sandbox = m[1]
	}
	return r
}

// workspace returns a host directory holding the probe binary.
func (e *env) workspace() string {
	e.t.Helper()
	dir := e.t.TempDir()
	b, err := os.ReadFile(bin.probe)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "probe"), b, 0o755); err != nil {
		e.t.Fatal(err)
	}
	return dir
}

// ourProcesses lists processes that belong to a sandbox of this test: its
// marker in their environment or a sluice cgroup in their cgroup list.
func (e *env) ourProcesses() []string {
	ents, _ := os.ReadDir("/proc")
	var found []string
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		envb, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "environ"))
		cg, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cgroup"))
		cmdline, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if strings.Contains(string(envb), e.marker) || strings.Contains(string(cg), "/sluice-sb-") && strings.Contains(string(cmdline), "sluice-init") {
			found = append(found, fmt.Sprintf("%d %q", pid, strings.ReplaceAll(string(cmdline), "\x00", " ")))
		}
	}
	return found
}

// sluiceCgroups lists sluice-* cgroups for the given sandbox id ("" = any).
func sluiceCgroups(id string) []string {
	var out []string
	filepath.WalkDir("/sys/fs/cgroup", func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if strings.HasPrefix(d.Name(), "sluice-sb-") && (id == "" || d.Name() == "sluice-"+id) {
			out = append(out, p)
			return filepath.SkipDir
		}
		if strings.Count(p, "/") > 7 {
			return filepath.SkipDir
		}
		return nil
	})
	return out
}

func sluiceMounts() []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "sluice-") {
			out = append(out, l)
		}
	}
	return out
}

func (e *env) assertNothingLeft() {
	e.t.Helper()
	if p := e.ourProcesses(); len(p) > 0 {
		e.t.Errorf("sandbox processes left behind: %v", p)
	}
	if ents, err := os.ReadDir(e.state); err == nil && len(ents) > 0 {
		e.t.Errorf("state directories left behind: %v", ents)
	}
	if m := sluiceMounts(); len(m) > 0 {
		e.t.Errorf("mounts left behind in the host namespace: %v", m)
	}
}

func (e *env) requests() []seenReq {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]seenReq(nil), e.seen...)
}

func wantLine(t *testing.T, out, prefix, want string) {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, prefix) {
			if !strings.Contains(l, want) {
				t.Errorf("%s: got %q, want it to contain %q", prefix, l, want)
			}
			return
		}
	}
	t.Errorf("no line starting with %q in output:\n%s", prefix, out)
}

func TestProxyIsTheOnlyWayOut(t *testing.T) {
	e := newEnv(t)
	ws := e.workspace()
	originPort := e.origin.Listener.Addr().(*net.TCPAddr).Port
	proxyAddr := e.proxy.Listener.Addr().String()
	// A host-side service on ::1, to show the sandbox cannot reach it either.
	ln6, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln6.Close()
	go func() {
		for {
			c, err := ln6.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	script := strings.Join([]string{
		fmt.Sprintf(`curl -sS --max-time 5 http://origin.sluice.test:%d/hello; echo " curl-proxy=$?"`, originPort),
		fmt.Sprintf(`./probe proxyget http://origin.sluice.test:%d/go`, originPort),
		fmt.Sprintf(`curl -sS --max-time 5 --noproxy '*' http://127.0.0.1:%d/; echo " curl-direct=$?"`, originPort),
		fmt.Sprintf(`./probe dial 127.0.0.1:%d`, originPort),
		fmt.Sprintf(`./probe dial %s`, proxyAddr),
		fmt.Sprintf(`./probe dial %s`, ln6.Addr().String()),
		`./probe dial 192.0.2.1:80`,
		// Port 3128 passes Landlock, so these show the empty network namespace.
		`./probe dial 192.0.2.1:3128`,
		`./probe dial [::1]:3128`,
		`./probe dns example.com`,
		`getent hosts example.com; echo "getent=$?"`,
		`cat /etc/resolv.conf`,
		`ls /sys /run/* 2>&1 | head -3; echo "ls-end"`,
	}, "\n")
	r := e.run([]string{"--workspace", ws}, "sh", "-c", script)
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	out := r.stdout
	if !strings.Contains(out, "origin-ok curl-proxy=0") {
		t.Errorf("curl through the proxy failed:\n%s", out)
	}
	wantLine(t, out, "proxyget:", "ok 200 origin-ok")
	if !regexp.MustCompile(`curl-direct=[1-9]`).MatchString(out) {
		t.Errorf("curl reached the origin directly:\n%s", out)
	}
	wantLine(t, out, fmt.Sprintf("dial 127.0.0.1:%d:", originPort), "errno=")
	wantLine(t, out, "dial "+proxyAddr+":", "errno=")
	wantLine(t, out, "dial "+ln6.Addr().String()+":", "errno=")
	wantLine(t, out, "dial 192.0.2.1:80:", "errno=13 ")    // Landlock: only port 3128
	wantLine(t, out, "dial 192.0.2.1:3128:", "errno=101 ") // ENETUNREACH: no route at all
	wantLine(t, out, "dial [::1]:3128:", "errno=111 ")     // ECONNREFUSED: the relay is IPv4 only
	wantLine(t, out, "dns example.com:", "err")
	if strings.Contains(out, "dns example.com: ok") || !strings.Contains(out, "getent=2") {
		t.Errorf("DNS resolved inside the sandbox:\n%s", out)
	}
	if strings.Contains(out, "nameserver") {
		t.Errorf("resolv.conf names a server:\n%s", out)
	}
	reqs := e.requests()
	if len(reqs) != 2 {
		t.Fatalf("proxy saw %d requests, want 2 (curl and Go): %+v", len(reqs), reqs)
	}
	for _, q := range reqs {
		if q.tenant != "acme" || q.sandbox != r.sandbox || q.host != fmt.Sprintf("origin.sluice.test:%d", originPort) {
			t.Errorf("proxy saw %+v, want tenant acme, sandbox %s", q, r.sandbox)
		}
	}
}

func TestEnvironmentFromNothing(t *testing.T) {
	e := newEnv(t)
	const secret = "SLUICE_TEST_FAKE_SECRET=hunter2-do-not-leak"
	ca := filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(ca, []byte("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"), 0o644)
	r := e.runEnv([]string{secret, "AWS_SECRET_ACCESS_KEY=also-secret"}, []string{"--env", "FOO=bar baz", "--ca-bundle", ca}, "env")
	if r.code != 0 {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
	if strings.Contains(r.stdout, "hunter2") || strings.Contains(r.stdout, "SLUICE_TEST_FAKE_SECRET") || strings.Contains(r.stdout, "also-secret") {
		t.Errorf("launcher environment leaked into the sandbox:\n%s", r.stdout)
	}
	got := map[string]string{}
	var names []string
	for _, l := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		k, v, _ := strings.Cut(l, "=")
		got[k] = v
		names = append(names, k)
	}
	sort.Strings(names)
	want := []string{"ALL_PROXY", "AWS_CA_BUNDLE", "CARGO_HTTP_CAINFO", "CURL_CA_BUNDLE", "DENO_CERT", "FOO", "GIT_SSL_CAINFO",
		"HOME", "HTTPS_PROXY", "HTTP_PROXY", "LANG", "NODE_EXTRA_CA_CERTS", "NO_PROXY", "PATH", "PIP_CERT",
		"REQUESTS_CA_BUNDLE", "SLUICE_TEST_MARK", "SSL_CERT_FILE", "all_proxy", "http_proxy", "https_proxy", "no_proxy", "npm_config_cafile"}
	if strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("sandbox environment names:\n got %v\nwant %v", names, want)
	}
	if got["FOO"] != "bar baz" || got["HOME"] != "/workspace" || got["NO_PROXY"] != "" || got["SSL_CERT_FILE"] != "/sluice/ca.pem" {
		t.Errorf("unexpected values: %v", got)
	}
	if !regexp.MustCompile(`^http://acme:slt1\.[A-Za-z0-9_.-]+@127\.0\.0\.1:3128$`).MatchString(got["HTTPS_PROXY"]) || got["https_proxy"] != got["HTTPS_PROXY"] {
		t.Errorf("proxy URL has the wrong shape")
	}
	for _, bad := range []string{"HTTP_PROXY=http://evil", "no_proxy=*", "Ssl_Cert_File=/x", "1BAD=x", "A-B=x"} {
		r := e.run([]string{"--env", bad}, "true")
		if r.code != 125 || !strings.Contains(r.stderr, "env") {
			t.Errorf("--env %s: exit %d, stderr %q; want 125 and an env error", bad, r.code, r.stderr)
		}
	}
}

func TestExitStatuses(t *testing.T) {
	e := newEnv(t)
	if r := e.run(nil, "sh", "-c", "exit 7"); r.code != 7 {
		t.Errorf("exit 7: got %d (%s)", r.code, r.stderr)
	}
	if r := e.run(nil, "sh", "-c", "kill -TERM $$"); r.code != 128+15 {
		t.Errorf("killed by SIGTERM: got %d (%s)", r.code, r.stderr)
	}
	r := e.run(nil, "/nonexistent/cmd")
	if r.code != 125 || !strings.Contains(r.stderr, "launch failed") {
		t.Errorf("missing command: got %d (%s)", r.code, r.stderr)
	}
	r = e.run([]string{"--timeout", "2s"}, "sh", "-c", "while :; do :; done")
	if r.code != 124 || !strings.Contains(r.stderr, "timeout") {
		t.Errorf("busy loop: got %d (%s), want 124 and a timeout message", r.code, r.stderr)
	}
}

func TestMemoryBombIsKilled(t *testing.T) {
	e := newEnv(t)
	r := e.run([]string{"--memory", "64MiB", "--timeout", "30s"}, "python3", "-c", "a = [bytearray(1 << 20) for _ in range(1024)]; print('survived')")
	if r.code != 137 || !strings.Contains(r.stderr, "out of memory") || strings.Contains(r.stdout, "survived") {
		t.Errorf("memory bomb: exit %d, stdout %q, stderr %q; want 137 and an out-of-memory message", r.code, r.stdout, r.stderr)
	}
}

func TestForkBombIsBounded(t *testing.T) {
	e := newEnv(t)
	// Every process waits for its children, so the tree stays at the limit
	// until the timeout kills the whole sandbox.
	bomb := "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
	p := e.start([]string{"--pids", "48", "--timeout", "4s"}, "python3", "-c", bomb)
	cg := ""
	waitFor(t, 10*time.Second, "the sandbox's pids cgroup", func() bool {
		for _, d := range sluiceCgroups(p.id) {
			if _, err := os.Stat(filepath.Join(d, "pids.max")); err == nil {
				cg = d
				return true
			}
		}
		return false
	})
	peak, refused := 0, 0
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		b, err := os.ReadFile(filepath.Join(cg, "pids.current"))
		if err != nil {
			break // the sandbox is already gone
		}
		n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		peak = max(peak, n)
		if ev, err := os.ReadFile(filepath.Join(cg, "pids.events")); err == nil {
			fmt.Sscanf(strings.TrimSpace(string(ev)), "max %d", &refused)
		}
	}
	r := p.wait()
	if peak > 48 {
		t.Errorf("fork bomb reached %d processes, over the 48 allowed", peak)
	}
	if refused == 0 || peak < 40 {
		t.Errorf("the bomb never hit the limit (peak %d, %d forks refused)", peak, refused)
	}
	if r.code != 124 || !strings.Contains(r.stderr, "timeout") {
		t.Errorf("fork bomb: exit %d, stderr %q; want the timeout to end it", r.code, r.stderr)
	}
}

// started is a sluice run in the background.
type started struct {
	t    testing.TB
	cmd  *exec.Cmd
	id   string
	errb *strings.Builder
	done chan struct{}
}

// start runs sluice in the background and returns once the sandbox runs.
func (e *env) start(flags []string, argv ...string) *started {
	e.t.Helper()
	args := append(append(append([]string{}, e.baseArgs...), flags...), "--")
	cmd := exec.Command(bin.sluice, append(args, argv...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		e.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	p := &started{t: e.t, cmd: cmd, errb: &strings.Builder{}, done: make(chan struct{})}
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		p.errb.WriteString(sc.Text() + "\n")
		if m := sandboxIDRe.FindStringSubmatch(sc.Text()); m != nil {
			p.id = m[1]
			break
		}
	}
	go func() {
		io.Copy(p.errb, stderr)
		close(p.done)
	}()
	if p.id == "" {
		cmd.Process.Kill()
		cmd.Wait()
		e.t.Fatalf("no sandbox id on stderr: %s", p.errb)
	}
	return p
}

func (p *started) wait() result {
	<-p.done
	err := p.cmd.Wait()
	r := result{stderr: p.errb.String(), sandbox: p.id}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	}
	return r
}

func TestWorkspaceCaps(t *testing.T) {
	e := newEnv(t)
	script := `head -c 1048576 /dev/zero > /workspace/a && echo "fill=ok"
printf x >> /workspace/a; echo "onebyte=$?"
wc -c < /workspace/a
i=0; while [ $i -lt 9 ]; do i=$((i+1)); touch /workspace/f$i || echo "file $i failed"; done; echo "files=$i"
touch /workspace/toomany; echo "toomany=$?"
head -c 2097152 /dev/zero > /tmp/b; echo "tmp=$?"`
	r := e.run([]string{"--disk", "1MiB", "--files", "10", "--tmp-size", "1MiB"}, "sh", "-c", script)
	out := r.stdout + r.stderr
	for _, want := range []string{"fill=ok", "onebyte=1", "1048576", "files=9", "toomany=1", "tmp=1", "No space left on device"} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in output:\n%s", want, out)
		}
	}
	if strings.Contains(out, "failed") {
		t.Errorf("a file within the cap could not be created:\n%s", out)
	}
}

func TestSeccompAndLandlock(t *testing.T) {
	e := newEnv(t)
	ws := e.workspace()
	script := `./probe unshare; ./probe unshare-user; ./probe rawsocket; ./probe packet; ./probe netlink; ./probe mount
./probe iouring; ./probe ptrace; ./probe selfconnect 127.0.0.1:8080; ./probe killinit
for p in /etc/x /usr/x /x /sluice/x /root/x /home/x /proc/x /dev/x; do ./probe write $p; done
./probe write /workspace/ok; ./probe write /tmp/ok
unshare -n true; echo "unshare-cli=$?"
grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd):' /proc/self/status`
	r := e.run([]string{"--workspace", ws}, "sh", "-c", script)
	if r.code != 0 {
		t.Fatalf("exit %d: %s\n%s", r.code, r.stdout, r.stderr)
	}
	out := r.stdout
	eperm := "errno=1 "
	for _, p := range []string{"unshare:", "unshare-user:", "rawsocket:", "packet:", "netlink:", "mount:", "iouring:", "ptrace:", "killinit:"} {
		wantLine(t, out, p, eperm)
	}
	// Landlock allows TCP connect only to the relay port, even to a listener
	// of the sandbox's own.
	wantLine(t, out, "selfconnect 127.0.0.1:8080:", "errno=13 ")
	for _, p := range []string{"/etc/x", "/usr/x", "/x", "/sluice/x", "/root/x", "/home/x", "/proc/x", "/dev/x"} {
		wantLine(t, out, "write "+p+":", "errno=")
	}
	wantLine(t, out, "write /workspace/ok:", "ok")
	wantLine(t, out, "write /tmp/ok:", "ok")
	for _, w := range []string{"unshare-cli=1", "NoNewPrivs:\t1", "Seccomp:\t2", "CapEff:\t0000000000000000", "CapBnd:\t0000000000000000"} {
		if !strings.Contains(out+r.stderr, w) {
			t.Errorf("want %q in output:\n%s", w, out)
		}
	}
	if !strings.Contains(r.stderr, "landlock abi") || !strings.Contains(r.stderr, "limits via cgroup-v1") {
		t.Errorf("stderr does not say which mechanisms applied: %s", r.stderr)
	}
}

func TestKillLauncherLeavesNothing(t *testing.T) {
	e := newEnv(t)
	p := e.start([]string{"--timeout", "2m"}, "sh", "-c", "sleep 100 & sleep 100")
	id, cmd := p.id, p.cmd
	// The sandbox runs: processes, cgroups, state exist.
	waitFor(t, 10*time.Second, "sandbox processes to appear", func() bool { return len(e.ourProcesses()) >= 2 })
	if len(sluiceCgroups(id)) == 0 {
		t.Fatalf("no cgroup for %s while it runs", id)
	}
	cmd.Process.Signal(os.Kill)
	p.wait()
	waitFor(t, 10*time.Second, "sandbox processes to die with the launcher", func() bool { return len(e.ourProcesses()) == 0 })
	// The kernel took the processes and mounts; the sweeper takes the rest.
	r := e.run(nil, "true")
	if r.code != 0 {
		t.Fatalf("next run: exit %d: %s", r.code, r.stderr)
	}
	if cg := sluiceCgroups(id); len(cg) > 0 {
		t.Errorf("cgroups left after the sweep: %v", cg)
	}
	if _, err := os.Stat(filepath.Join(e.state, id)); !os.IsNotExist(err) {
		t.Errorf("state dir of %s left after the sweep: %v", id, err)
	}
}

func TestKeepWorkspace(t *testing.T) {
	e := newEnv(t)
	ws := t.TempDir()
	os.WriteFile(filepath.Join(ws, "in.txt"), []byte("from host"), 0o644)
	os.Symlink("/etc/passwd", filepath.Join(ws, "link"))
	r := e.run([]string{"--workspace", ws, "--keep"}, "sh", "-c", "cat in.txt; echo made > out.txt; mkdir d; echo x > d/y; ln -sf /etc/shadow evil; cat link >/dev/null 2>&1 || echo link-dangling")
	if r.code != 0 || !strings.Contains(r.stdout, "from host") {
		t.Fatalf("exit %d: %s %s", r.code, r.stdout, r.stderr)
	}
	if b, _ := os.ReadFile(filepath.Join(ws, "out.txt")); string(b) != "made\n" {
		t.Errorf("out.txt not kept: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(ws, "d", "y")); string(b) != "x\n" {
		t.Errorf("d/y not kept: %q", b)
	}
	if fi, err := os.Lstat(filepath.Join(ws, "evil")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("symlink not kept as a symlink: %v", err)
	}
	// Without --keep nothing comes back.
	r = e.run([]string{"--workspace", ws}, "sh", "-c", "echo gone > gone.txt")
	if _, err := os.Stat(filepath.Join(ws, "gone.txt")); !os.IsNotExist(err) || r.code != 0 {
		t.Errorf("workspace written back without --keep (exit %d)", r.code)
	}
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// BenchmarkLaunchTrue measures launch-to-exit of /bin/true under sluice run
// (launcher process, namespaces, init, mounts, cgroups, restrictions,
// cleanup) beside bwrap doing a comparable job, in the same process and
// machine state. Run with -benchtime=50x; p50-ms is the median.
func BenchmarkLaunchTrue(b *testing.B) {
	e := newEnv(b)
	bwrap, bwrapErr := exec.LookPath("bwrap")
	for _, c := range []struct {
		name string
		argv []string
	}{
		{"sluice", append(append([]string{bin.sluice}, e.baseArgs...), "--", "/bin/true")},
		{"bwrap", []string{bwrap, "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"}},
	} {
		b.Run(c.name, func(b *testing.B) {
			if c.name == "bwrap" && bwrapErr != nil {
				b.Skip("bwrap not installed")
			}
			durs := make([]time.Duration, 0, b.N)
			for b.Loop() {
				cmd := exec.Command(c.argv[0], c.argv[1:]...)
				t0 := time.Now()
				out, err := cmd.CombinedOutput()
				durs = append(durs, time.Since(t0))
				if err != nil {
					b.Fatalf("%s: %v\n%s", c.name, err, out)
				}
			}
			sort.Slice(durs, func(i, j int) bool { return durs[i] < durs[j] })
			b.ReportMetric(float64(durs[len(durs)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(durs[len(durs)*9/10].Microseconds())/1000, "p90-ms")
		})
	}
}
