package certs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// sluiceBin is the sluice binary TestMain builds for the CLI tests, or the
// reason it could not be built (reported by those tests only, so that the
// package's unit tests still run while cmd/sluice is mid-edit).
var (
	sluiceBin      string
	sluiceBuildErr error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sluice-certs-cli-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	sluiceBin, sluiceBuildErr = buildSluice(dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func buildSluice(dir string) (string, error) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	bin := filepath.Join(dir, "sluice")
	cmd := exec.Command(goBin, "build", "-o", bin, "github.com/sluicehq/sluice/cmd/sluice")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/sluice: %v\n%s", err, out)
	}
	return bin, nil
}

type cliResult struct {
	stdout, stderr string
	code           int
}

func runSluice(t *testing.T, args ...string) cliResult {
	t.Helper()
	if sluiceBuildErr != nil {
		t.Fatalf("sluice binary not built: %v", sluiceBuildErr)
	}
	cmd := exec.Command(sluiceBin, args...)
	var so, se bytes.Buffer
	cmd.Stdout, cmd.Stderr = &so, &se
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run sluice %v: %v", args, err)
	}
	return cliResult{so.String(), se.String(), code}
}

func TestCLICAInit(t *testing.T) {
	dir := t.TempDir()
	cp, kp := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	r := runSluice(t, "ca", "init", "--cert", cp, "--key", kp, "--validity", "48h")
	if r.code != 0 {
		t.Fatalf("ca init: exit %d, stderr %q", r.code, r.stderr)
	}
	ca, err := LoadCA(cp, kp)
	if err != nil {
		t.Fatalf("CA written by the CLI does not load: %v", err)
	}
	if !strings.Contains(r.stdout, ca.Fingerprint()) {
		t.Errorf("output %q lacks the fingerprint", r.stdout)
	}
	if got := time.Until(ca.Certificate().NotAfter); got > 48*time.Hour || got < 47*time.Hour {
		t.Errorf("--validity 48h gave %s", got)
	}
	keyPEM, _ := os.ReadFile(kp)
	keyBody := strings.Join(strings.Split(strings.TrimSpace(string(keyPEM)), "\n")[1:2], "")
	for _, out := range []string{r.stdout, r.stderr} {
		if strings.Contains(out, "PRIVATE KEY") || strings.Contains(out, keyBody) {
			t.Error("ca init printed key material")
		}
	}
	if fi, _ := os.Stat(kp); fi.Mode().Perm() != 0o600 {
		t.Errorf("key mode %04o", fi.Mode().Perm())
	}
	certPEM, _ := os.ReadFile(cp)

	// A second init refuses and leaves the pair untouched.
	r = runSluice(t, "ca", "init", "--cert", cp, "--key", kp)
	if r.code == 0 || !strings.Contains(r.stderr, "refusing to overwrite") {
		t.Errorf("second init: exit %d, stderr %q", r.code, r.stderr)
	}
	if b, _ := os.ReadFile(kp); !bytes.Equal(b, keyPEM) {
		t.Error("second init modified the key")
	}
	if b, _ := os.ReadFile(cp); !bytes.Equal(b, certPEM) {
		t.Error("second init modified the certificate")
	}

	for _, args := range [][]string{
		{"ca", "init", "--cert", filepath.Join(dir, "x.pem")},
		{"ca", "init", "--key", filepath.Join(dir, "x.key")},
		{"ca", "init", "--cert", filepath.Join(dir, "y.pem"), "--key", filepath.Join(dir, "y.key"), "--validity", "1m"},
		{"ca", "init", "--cert", filepath.Join(dir, "y.pem"), "--key", filepath.Join(dir, "y.key"), "--validity", "soon"},
		{"ca", "init", "--cert", filepath.Join(dir, "y.pem"), "--key", filepath.Join(dir, "y.key"), "extra"},
	} {
		if r := runSluice(t, args...); r.code == 0 {
			t.Errorf("%v: exit 0", args)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "y.key")); err == nil {
		t.Error("a refused init left a key behind")
	}
}

func TestCLICABundle(t *testing.T) {
	dir := t.TempDir()
	cp, kp := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if r := runSluice(t, "ca", "init", "--cert", cp, "--key", kp); r.code != 0 {
		t.Fatalf("ca init: %q", r.stderr)
	}
	ca, err := LoadCA(cp, kp)
	if err != nil {
		t.Fatal(err)
	}
	roots, want := fakeSystemRoots(t, dir)

	// stdout by default.
	r := runSluice(t, "ca", "bundle", "--cert", cp, "--system-roots", filepath.Join(dir, "missing.pem")+","+roots)
	if r.code != 0 {
		t.Fatalf("ca bundle: exit %d, stderr %q", r.code, r.stderr)
	}
	got := pemCerts(t, []byte(r.stdout))
	if len(got) != len(want)+1 || !got[len(got)-1].Equal(ca.Certificate()) || !got[0].Equal(want[0]) {
		t.Fatalf("bundle on stdout: %d certificates", len(got))
	}

	// --out writes a 0644 file, refuses to replace it without --force.
	out := filepath.Join(dir, "bundle.pem")
	if r := runSluice(t, "ca", "bundle", "--cert", cp, "--out", out, "--system-roots", roots); r.code != 0 {
		t.Fatalf("ca bundle --out: %q", r.stderr)
	}
	fi, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("bundle mode %04o, want 0644", fi.Mode().Perm())
	}
	if b, _ := os.ReadFile(out); string(b) != r.stdout {
		t.Error("--out content differs from stdout content")
	}
	if r := runSluice(t, "ca", "bundle", "--cert", cp, "--out", out, "--system-roots", roots); r.code == 0 || !strings.Contains(r.stderr, "--force") {
		t.Errorf("existing --out without --force: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := runSluice(t, "ca", "bundle", "--cert", cp, "--out", out, "--force", "--system-roots", roots); r.code != 0 {
		t.Errorf("--force: %q", r.stderr)
	}
	// A mistyped --out never clobbers the CA key.
	keyPEM, _ := os.ReadFile(kp)
	if r := runSluice(t, "ca", "bundle", "--cert", cp, "--out", kp, "--system-roots", roots); r.code == 0 {
		t.Error("--out pointing at the key: exit 0")
	}
	if b, _ := os.ReadFile(kp); !bytes.Equal(b, keyPEM) {
		t.Fatal("ca bundle overwrote the CA key")
	}

	// Bad inputs: a key given as the certificate (never echoed), no system
	// roots, a certificate that is not a CA.
	r = runSluice(t, "ca", "bundle", "--cert", kp, "--system-roots", roots)
	if r.code == 0 || strings.Contains(r.stderr+r.stdout, "PRIVATE KEY") {
		t.Errorf("key as --cert: exit %d, output mentions key: %v", r.code, strings.Contains(r.stderr+r.stdout, "PRIVATE KEY"))
	}
	if r := runSluice(t, "ca", "bundle", "--cert", cp, "--system-roots", filepath.Join(dir, "none.pem")); r.code == 0 || !strings.Contains(r.stderr, "no system root bundle") {
		t.Errorf("no system roots: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := runSluice(t, "ca", "bundle"); r.code == 0 {
		t.Error("bundle without --cert: exit 0")
	}

	// Default system roots: works when the machine has a bundle.
	hasSystem := false
	for _, p := range SystemRootFiles() {
		if _, err := os.Stat(p); err == nil {
			hasSystem = true
		}
	}
	r = runSluice(t, "ca", "bundle", "--cert", cp)
	if hasSystem != (r.code == 0) {
		t.Errorf("default roots: system bundle present %v, exit %d, stderr %q", hasSystem, r.code, r.stderr)
	}
}
