package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/vault/api"
)

// vaultBinary finds the Vault server built by scripts/build-vault.sh. Without
// it the Vault tests skip, except under CI, where they must run.
func vaultBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SLUICE_VAULT_BIN"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("SLUICE_VAULT_BIN=%s: %v", p, err)
		}
		return p
	}
	cache := os.Getenv("SLUICE_CACHE")
	if cache == "" {
		base := os.Getenv("XDG_CACHE_HOME")
		if base == "" {
			home, _ := os.UserHomeDir()
			base = filepath.Join(home, ".cache")
		}
		cache = filepath.Join(base, "sluice")
	}
	p := filepath.Join(cache, "vault-v1.21.0", "vault")
	if _, err := os.Stat(p); err != nil {
		msg := fmt.Sprintf("no Vault server binary at %s: run scripts/build-vault.sh or set SLUICE_VAULT_BIN", p)
		if os.Getenv("CI") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// devVault is one `vault server -dev` process on loopback.
type devVault struct {
	t     *testing.T
	bin   string
	addr  string
	root  string
	cmd   *exec.Cmd
	admin *api.Client
}

// startDevVault starts an in-memory dev server on addr (empty: a free
// loopback port) with the given root token (empty: random), waits for it to be
// healthy and registers its teardown.
func startDevVault(t *testing.T, addr, root string) *devVault {
	t.Helper()
	if addr == "" {
		addr = freeLoopbackAddr(t)
	}
	if root == "" {
		root = "root-" + randomHex(t, 12)
	}
	v := &devVault{t: t, bin: vaultBinary(t), addr: addr, root: root}
	dir := t.TempDir()
	logf, err := os.Create(filepath.Join(dir, "vault.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logf.Close() })
	cmd := exec.Command(v.bin, "server", "-dev",
		"-dev-listen-address="+addr, "-dev-root-token-id="+root, "-dev-no-store-token", "-log-level=warn")
	cmd.Dir = dir
	// A clean environment: no VAULT_* or proxy settings from the host.
	cmd.Env = []string{"HOME=" + dir, "PATH=" + os.Getenv("PATH"), "TMPDIR=" + dir}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatalf("start vault: %v", err)
	}
	v.cmd = cmd
	t.Cleanup(v.Stop)

	conf := api.DefaultConfig()
	conf.Address = "http://" + addr
	conf.HttpClient.Transport.(*http.Transport).Proxy = nil
	conf.MaxRetries = 0
	admin, err := api.NewClient(conf)
	if err != nil {
		t.Fatal(err)
	}
	admin.SetToken(root)
	v.admin = admin

	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		h, err := admin.Sys().HealthWithContext(ctx)
		cancel()
		if err == nil && h.Initialized && !h.Sealed {
			break
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(logf.Name())
			t.Fatalf("vault on %s not healthy after 60s: %v\n%s", addr, err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The dev server mounts KV v2 at secret/, but asynchronously upgrades it:
	// wait until a write works.
	for {
		_, err := admin.KVv2("secret").Put(context.Background(), "sluice-probe", map[string]any{"ok": "1"})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("KV v2 on %s not ready: %v", addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return v
}

// Stop kills the server by PID and waits for it; safe to call twice.
func (v *devVault) Stop() {
	if v.cmd == nil || v.cmd.Process == nil {
		return
	}
	_ = v.cmd.Process.Kill()
	_ = v.cmd.Wait()
	v.cmd = nil
}

func (v *devVault) URL() string { return "http://" + v.addr }

func (v *devVault) putSecret(path string, data map[string]any) {
	v.t.Helper()
	if _, err := v.admin.KVv2("secret").Put(context.Background(), path, data); err != nil {
		v.t.Fatalf("put secret/%s: %v", path, err)
	}
}

// appRole enables AppRole (once), writes a read-only policy for secret/data/*
// and creates role name with the given token TTLs. It returns the role id.
func (v *devVault) appRole(name string, ttl, maxTTL time.Duration) string {
	v.t.Helper()
	auths, err := v.admin.Sys().ListAuth()
	if err != nil {
		v.t.Fatal(err)
	}
	if _, ok := auths["approle/"]; !ok {
		if err := v.admin.Sys().EnableAuthWithOptions("approle", &api.EnableAuthOptions{Type: "approle"}); err != nil {
			v.t.Fatalf("enable approle: %v", err)
		}
	}
	if err := v.admin.Sys().PutPolicy("sluice-read", `path "secret/data/*" { capabilities = ["read"] }`); err != nil {
		v.t.Fatalf("policy: %v", err)
	}
	role := map[string]any{"token_policies": "sluice-read", "token_ttl": int(ttl.Seconds()), "token_max_ttl": int(maxTTL.Seconds())}
	if _, err := v.admin.Logical().Write("auth/approle/role/"+name, role); err != nil {
		v.t.Fatalf("role: %v", err)
	}
	s, err := v.admin.Logical().Read("auth/approle/role/" + name + "/role-id")
	if err != nil {
		v.t.Fatalf("role id: %v", err)
	}
	return s.Data["role_id"].(string)
}

// secretID creates a secret id for role; wrapped returns a response-wrapping
// token holding it instead.
func (v *devVault) secretID(role string, wrapped bool) string {
	v.t.Helper()
	c := v.admin
	if wrapped {
		var err error
		if c, err = v.admin.Clone(); err != nil {
			v.t.Fatal(err)
		}
		c.SetToken(v.root)
		c.SetWrappingLookupFunc(func(string, string) string { return "5m" })
	}
	s, err := c.Logical().Write("auth/approle/role/"+role+"/secret-id", nil)
	if err != nil {
		v.t.Fatalf("secret id: %v", err)
	}
	if wrapped {
		return s.WrapInfo.Token
	}
	return s.Data["secret_id"].(string)
}

// writeCred writes a credential file with mode 0600 and returns its path.
func writeCred(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// assertNoLeak fails if any sensitive string appears in any of the texts.
func assertNoLeak(t *testing.T, texts []string, sensitive ...string) {
	t.Helper()
	for _, txt := range texts {
		for _, s := range sensitive {
			if s != "" && strings.Contains(txt, s) {
				t.Fatalf("a secret or credential leaked into logs or errors:\n%s", txt)
			}
		}
	}
}
