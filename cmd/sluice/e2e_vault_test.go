package main

// End-to-end tests of Vault-backed secret injection through the real
// `sluice serve` binary and a real Vault dev server on loopback (built once by
// scripts/build-vault.sh): AppRole login (plain and response-wrapped secret
// id), a KV v2 secret injected into an intercepted request, rotation within
// the refresh interval, an outage served from the cache until max staleness
// and refused after it, and recovery when Vault comes back. Also checks the
// shipped examples/vault configuration and setup script.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/vaultdev"
)

// e2eVault is one `vault server -dev` on loopback (see internal/vaultdev),
// configured through its HTTP API with the root token.
type e2eVault struct {
	*vaultdev.Server
	t    *testing.T
	http *http.Client
}

// startE2EVault starts a dev server on addr (empty: a free loopback port)
// with root as its root token and waits until it is healthy and KV v2 at
// secret/ takes writes. It is killed by PID at cleanup (or by Stop).
func startE2EVault(t *testing.T, addr, root string) *e2eVault {
	t.Helper()
	return &e2eVault{Server: vaultdev.Start(t, addr, root), t: t,
		http: &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 5 * time.Second}}
}

// call is one HTTP API request with the root token. Errors never include
// the request body (it may hold secrets).
func (v *e2eVault) call(method, path string, body any, header http.Header) (map[string]any, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, "http://"+v.Addr+"/v1/"+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-Vault-Token", v.Root)
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := v.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode >= 300 {
		return nil, fmt.Errorf("%s %s: status %d", method, path, resp.StatusCode)
	}
	out := map[string]any{}
	if len(bytes.TrimSpace(raw)) > 0 {
		if err := json.Unmarshal(raw, &out); err != nil {
			return nil, fmt.Errorf("%s %s: %w", method, path, err)
		}
	}
	return out, nil
}

func (v *e2eVault) must(method, path string, body any) map[string]any {
	v.t.Helper()
	out, err := v.call(method, path, body, nil)
	if err != nil {
		v.t.Fatalf("vault: %v", err)
	}
	return out
}

// seedAppRole enables AppRole with a role "sluice" whose tokens may only
// read secret/data/e2e/*, with the given role id and (unless empty) secret id.
func (v *e2eVault) seedAppRole(roleID, secretID string) {
	v.t.Helper()
	v.must(http.MethodPost, "sys/auth/approle", map[string]any{"type": "approle"})
	v.must(http.MethodPut, "sys/policies/acl/sluice-read", map[string]any{"policy": `path "secret/data/e2e/*" { capabilities = ["read"] }`})
	v.must(http.MethodPost, "auth/approle/role/sluice", map[string]any{"token_policies": "sluice-read", "token_ttl": "1m", "token_max_ttl": "10m"})
	v.must(http.MethodPost, "auth/approle/role/sluice/role-id", map[string]any{"role_id": roleID})
	if secretID != "" {
		v.must(http.MethodPost, "auth/approle/role/sluice/custom-secret-id", map[string]any{"secret_id": secretID})
	}
}

// wrappedSecretID returns a response-wrapping token that holds a new secret id.
func (v *e2eVault) wrappedSecretID() string {
	v.t.Helper()
	out, err := v.call(http.MethodPost, "auth/approle/role/sluice/secret-id", nil, http.Header{"X-Vault-Wrap-Ttl": {"5m"}})
	if err != nil {
		v.t.Fatalf("vault: %v", err)
	}
	wi, _ := out["wrap_info"].(map[string]any)
	tok, _ := wi["token"].(string)
	if tok == "" {
		v.t.Fatal("vault: no wrapping token in the secret-id response")
	}
	return tok
}

func (v *e2eVault) putKV(path string, data map[string]string) {
	v.t.Helper()
	v.must(http.MethodPost, "secret/data/"+path, map[string]any{"data": data})
}

// vaultWorld is the MITM world with a Vault-backed secret "api" for api.test.
type vaultWorld struct {
	*mitmWorld
	vault              *e2eVault
	roleID, secretID   string
	roleFile, secretFn string
}

func newVaultWorld(t *testing.T) *vaultWorld {
	t.Helper()
	vaultdev.Binary(t) // skip before building anything
	w := &vaultWorld{mitmWorld: newMITMWorld(t)}
	root := "root-" + randomToken(t)
	w.vault = startE2EVault(t, "", root)
	w.roleID, w.secretID = randomUUID(t), randomUUID(t)
	w.addSecret(root)
	w.addSecret(w.secretID)
	w.addSecret(w.roleID)
	w.vault.seedAppRole(w.roleID, w.secretID)
	w.roleFile, w.secretFn = w.env.Path("vault-role-id"), w.env.Path("vault-secret-id")
	for path, val := range map[string]string{w.roleFile: w.roleID, w.secretFn: w.secretID} {
		if err := os.WriteFile(path, []byte(val+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return w
}

// randomUUID is a random value in the UUID shape Vault uses for ids.
func randomUUID(t *testing.T) string {
	h := randomToken(t)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

func (w *vaultWorld) config(wrapped bool) string {
	return fmt.Sprintf(`version: 1
server:
  read_header_timeout: 5s
  dial_timeout: 3s
  upstream_timeout: 10s
  shutdown_timeout: 5s
audit:
  on_failure: closed
  fsync: never
ca:
  cert: %[1]s
  key: %[2]s
broker:
  refresh: 200ms
  max_staleness: 3s
  vault:
    address: http://%[3]s
    auth: approle
    role_id_file: %[4]s
    secret_id_file: %[5]s
    secret_id_wrapped: %[6]t
    timeout: 1s
    max_retries: 1
secrets:
  - name: api
    source: vault
    path: secret/data/e2e/api
    field: token
    hosts: [api.test]
tenants:
  - id: acme
    credentials:
      - name: %[7]s
        hash: %[8]s
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - id: api-inject
        host: api.test
        ports: [%[9]d]
        inject:
          - header: Authorization
            value: "Bearer ${secret:api}"
`, w.caCert, w.caKey, w.vault.Addr, w.roleFile, w.secretFn, wrapped, w.cred.Name, w.cred.Hash, w.api.Port)
}

// putValue writes a new value of the secret into Vault and into the scan.
func (w *vaultWorld) putValue(v string) {
	w.addSecret(v)
	w.vault.putKV("e2e/api", map[string]string{"token": v})
}

// injected makes one request and returns what the origin received as
// Authorization, or the refusal.
func (w *vaultWorld) injected(t *testing.T, path string) (status int, auth string, body []byte) {
	t.Helper()
	resp, body := w.get(t, w.apiURL(path))
	if resp.StatusCode != 200 {
		return resp.StatusCode, "", body
	}
	got := w.api.last(t, path).Header.Values("Authorization")
	if len(got) != 1 {
		t.Fatalf("origin saw %d Authorization values", len(got))
	}
	return 200, got[0], body
}

func (w *vaultWorld) readyz(t *testing.T) int {
	t.Helper()
	cl := &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 5 * time.Second}
	resp, err := cl.Get("http://" + w.p.AdminAddr + "/readyz")
	if err != nil {
		t.Fatalf("readyz: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	w.saw.response(resp, body)
	return resp.StatusCode
}

// TestE2EVaultLifecycle: AppRole login, injection, rotation, outage with
// bounded staleness, recovery.
func TestE2EVaultLifecycle(t *testing.T) {
	w := newVaultWorld(t)
	v1, v2, v3 := "v1-"+randomToken(t), "v2-"+randomToken(t), "v3-"+randomToken(t)
	w.putValue(v1)
	p := w.env.StartSluice(w.config(false), sluiceOptions{Resolver: w.dns.Addr, UpstreamCA: w.pki.CAFile})
	w.p = p
	n := 0
	next := func() string { n++; return fmt.Sprintf("/v1/req/%d", n) }

	// The first fetch happens before sluice serves.
	mark := p.AuditMark(t)
	path := next()
	st, auth, body := w.injected(t, path)
	if st != 200 || auth != "Bearer "+v1 {
		t.Fatalf("first request: status %d (%.200q); injected value is v1: %v", st, body, auth == "Bearer "+v1)
	}
	rec := waitRecordWhere(t, p, mark, "first", requestAt(path))
	checkRecord(t, rec, wantRecord{Decision: audit.DecisionAllow, Reason: "allowed", Rule: "api-inject", Tenant: "acme", Host: "api.test", Status: 200})
	if len(rec.Secrets) != 1 || rec.Secrets[0] != "api" || !rec.Intercepted {
		t.Errorf("record secrets=%v intercepted=%v", rec.Secrets, rec.Intercepted)
	}
	if code := w.readyz(t); code != 200 {
		t.Errorf("readyz %d with a fresh secret", code)
	}

	// Rotation: the new value is used within the refresh interval; the
	// poll is bounded well above it.
	w.putValue(v2)
	rotated := time.Now()
	for {
		path := next()
		st, auth, body := w.injected(t, path)
		if st != 200 {
			t.Fatalf("during rotation: status %d (%.200q)", st, body)
		}
		if auth == "Bearer "+v2 {
			break
		}
		if auth != "Bearer "+v1 {
			t.Fatal("origin got neither the old nor the new value")
		}
		if time.Since(rotated) > e2eTimeout {
			t.Fatalf("rotated value not used within %s", e2eTimeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("rotation seen after %s (refresh 200ms)", time.Since(rotated).Round(time.Millisecond))

	// Outage: the cached value serves, until max staleness (3s) has
	// passed since the last successful refresh; then 503.
	w.vault.Stop()
	stopped := time.Now()
	path = next()
	if st, auth, body := w.injected(t, path); st != 200 || auth != "Bearer "+v2 {
		t.Fatalf("right after Vault stopped: status %d (%.200q); cached v2 injected: %v", st, body, auth == "Bearer "+v2)
	}
	var firstRefusal time.Duration
	for {
		path := next()
		seen := len(w.api.Seen())
		mark := p.AuditMark(t)
		resp, body := w.get(t, w.apiURL(path))
		if resp.StatusCode == 200 {
			if got := w.api.last(t, path).Header.Get("Authorization"); got != "Bearer "+v2 {
				t.Fatal("during the outage the origin got something other than the cached value")
			}
		} else {
			firstRefusal = time.Since(stopped)
			checkDenial(t, "stale secret", resp, body, http.StatusServiceUnavailable, "secret_unavailable")
			rec := waitRecordWhere(t, p, mark, "stale", requestAt(path))
			checkRecord(t, rec, wantRecord{Decision: audit.DecisionDeny, Reason: "secret_unavailable", Rule: "api-inject", Tenant: "acme", Host: "api.test", Status: 503})
			if len(rec.Secrets) != 1 || rec.Secrets[0] != "api" {
				t.Errorf("record secrets %v, want [api]", rec.Secrets)
			}
			if len(w.api.Seen()) != seen {
				t.Error("the request was forwarded without its secret")
			}
			break
		}
		if time.Since(stopped) > e2eTimeout {
			t.Fatalf("still serving the cached value %s after Vault stopped (max_staleness 3s)", e2eTimeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The last successful refresh was at most one interval (plus a fetch)
	// before the stop, so the refusal cannot come earlier than this.
	if firstRefusal < 2500*time.Millisecond {
		t.Errorf("refused %s after Vault stopped: the cached value must serve until max_staleness (3s)", firstRefusal)
	}
	t.Logf("first 503 %s after Vault stopped (max_staleness 3s)", firstRefusal.Round(time.Millisecond))
	if code := w.readyz(t); code != http.StatusServiceUnavailable {
		t.Errorf("readyz %d with a stale secret, want 503", code)
	}
	// Still refused, never forwarded bare.
	for range 3 {
		path := next()
		resp, body := w.get(t, w.apiURL(path))
		checkDenial(t, "still stale", resp, body, http.StatusServiceUnavailable, "secret_unavailable")
	}

	// The broker says so in its log once a refresh fails past max
	// staleness; a refresh against a dead server may still be in its
	// retries, so wait for that line before Vault comes back.
	staleLogged := time.Now()
	for !strings.Contains(p.Stderr(), "secret stale") {
		if time.Since(staleLogged) > e2eTimeout {
			t.Fatalf("no log line mentioning \"secret stale\" within %s:\n%s", e2eTimeout, tail(p.Stderr(), 3000))
		}
		time.Sleep(50 * time.Millisecond)
	}

	// Recovery: a new dev server on the same address with the same root
	// token, re-seeded (same AppRole ids, a third value). sluice's old
	// token means nothing to it: the broker must log in again.
	w.vault = startE2EVault(t, w.vault.Addr, w.vault.Root)
	w.vault.seedAppRole(w.roleID, w.secretID)
	w.putValue(v3)
	restarted := time.Now()
	for {
		path := next()
		resp, body := w.get(t, w.apiURL(path))
		if resp.StatusCode == 200 {
			if got := w.api.last(t, path).Header.Get("Authorization"); got != "Bearer "+v3 {
				t.Fatal("after recovery the origin did not get the new value")
			}
			break
		}
		checkDenial(t, "recovering", resp, body, http.StatusServiceUnavailable, "secret_unavailable")
		if time.Since(restarted) > 2*e2eTimeout {
			t.Fatalf("no recovery within %s of Vault coming back:\n%s", 2*e2eTimeout, tail(p.Stderr(), 3000))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("recovered %s after Vault came back", time.Since(restarted).Round(time.Millisecond))
	if code := w.readyz(t); code != 200 {
		t.Errorf("readyz %d after recovery", code)
	}
	log := p.Stderr()
	for _, want := range []string{"broker: secret rotated", "serving cached value", "secret stale"} {
		if !strings.Contains(log, want) {
			t.Errorf("no log line mentioning %q", want)
		}
	}
}

// TestE2EVaultWrappedSecretID: the secret id file holds a response-wrapping
// token; sluice unwraps it (using it up) and logs in.
func TestE2EVaultWrappedSecretID(t *testing.T) {
	w := newVaultWorld(t)
	value := "wv-" + randomToken(t)
	w.putValue(value)
	wrapping := w.vault.wrappedSecretID()
	w.addSecret(wrapping)
	if err := os.WriteFile(w.secretFn, []byte(wrapping+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	w.p = w.env.StartSluice(w.config(true), sluiceOptions{Resolver: w.dns.Addr, UpstreamCA: w.pki.CAFile})
	st, auth, body := w.injected(t, "/v1/wrapped")
	if st != 200 || auth != "Bearer "+value {
		t.Fatalf("status %d (%.200q); injected: %v", st, body, auth == "Bearer "+value)
	}
	// A wrapping token is single-use: sluice's unwrap consumed it.
	if _, err := w.vault.call(http.MethodPost, "sys/wrapping/lookup", map[string]any{"token": wrapping}, nil); err == nil {
		t.Error("the wrapping token is still valid: sluice did not unwrap it")
	}
}

// TestE2EVaultUnavailableAtStart: a secret Vault cannot serve at start does
// not stop sluice; requests needing it are refused (never forwarded bare)
// until it arrives.
func TestE2EVaultUnavailableAtStart(t *testing.T) {
	w := newVaultWorld(t)
	w.p = w.env.StartSluice(w.config(false), sluiceOptions{Resolver: w.dns.Addr, UpstreamCA: w.pki.CAFile})
	seen := len(w.api.Seen())
	resp, body := w.get(t, w.apiURL("/v1/missing"))
	checkDenial(t, "secret not in Vault", resp, body, http.StatusServiceUnavailable, "secret_unavailable")
	if len(w.api.Seen()) != seen {
		t.Error("request forwarded without its secret")
	}
	if code := w.readyz(t); code != http.StatusServiceUnavailable {
		t.Errorf("readyz %d, want 503", code)
	}
	value := "late-" + randomToken(t)
	w.putValue(value)
	deadline := time.Now().Add(e2eTimeout)
	for i := 0; ; i++ {
		path := fmt.Sprintf("/v1/late/%d", i)
		st, auth, _ := w.injected(t, path)
		if st == 200 {
			if auth != "Bearer "+value {
				t.Fatal("origin did not get the value")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("secret written after start not used within %s", e2eTimeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestE2EVaultExample: examples/vault/sluice.yaml passes `sluice rules
// check`, and with a dev server prepared by examples/vault/setup.sh it
// starts, logs in with the wrapped secret id and becomes ready.
func TestE2EVaultExample(t *testing.T) {
	src, err := filepath.Abs(filepath.Join("..", "..", "examples", "vault"))
	if err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runSluice(t, "", "rules", "check", filepath.Join(src, "sluice.yaml"))
	if code != 0 {
		t.Fatalf("sluice rules check examples/vault/sluice.yaml: exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(out, "ok") {
		t.Errorf("rules check output %q", out)
	}

	t.Run("setup.sh against a dev server", func(t *testing.T) {
		bin := vaultdev.Binary(t)
		if _, err := exec.LookPath("bash"); err != nil {
			t.Skip("no bash")
		}
		env := newE2EEnv(t)
		saw := &clientLog{}
		root := "root-" + randomToken(t)
		gh, oa := "ghp_"+randomToken(t), "sk-"+randomToken(t)
		scan := []string{root, gh, oa}
		secretScan(t, env, saw, func() []string { return scan })
		v := startE2EVault(t, "", root)

		// A copy of the example, as an operator would have it, in the
		// directory where StartSluice writes the config: the example's
		// relative paths (vault/role-id, sluice-ca.pem) resolve there.
		dir := env.Dir
		var config []byte
		for _, f := range []string{"sluice.yaml", "setup.sh", "sluice-policy.hcl"} {
			b := mustRead(t, filepath.Join(src, f))
			if f == "sluice.yaml" {
				config = bytes.ReplaceAll(b, []byte("http://127.0.0.1:8200"), []byte("http://"+v.Addr))
				continue
			}
			if err := os.WriteFile(filepath.Join(dir, f), b, 0o700); err != nil {
				t.Fatal(err)
			}
		}
		// The vault CLI is the same binary as the server.
		binDir := env.Path("bin")
		if err := os.MkdirAll(binDir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(bin, filepath.Join(binDir, "vault")); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*e2eTimeout)
		defer cancel()
		setup := exec.CommandContext(ctx, "bash", filepath.Join(dir, "setup.sh"))
		setup.Env = []string{"PATH=" + binDir + ":" + os.Getenv("PATH"), "HOME=" + env.Dir,
			"VAULT_ADDR=http://" + v.Addr, "VAULT_TOKEN=" + root, "GITHUB_TOKEN=" + gh, "OPENAI_API_KEY=" + oa}
		var so, se bytes.Buffer
		setup.Stdout, setup.Stderr = &so, &se
		if err := setup.Run(); err != nil {
			t.Fatalf("setup.sh: %v\n%s%s", err, so.String(), se.String())
		}
		saw.text(so.String() + se.String())
		for _, f := range []string{"vault/role-id", "vault/secret-id"} {
			fi, err := os.Stat(filepath.Join(dir, f))
			if err != nil {
				t.Fatalf("setup.sh did not write %s: %v", f, err)
			}
			if fi.Mode().Perm()&0o077 != 0 {
				t.Errorf("%s has mode %v, want no group/other access", f, fi.Mode().Perm())
			}
			scan = append(scan, strings.TrimSpace(string(mustRead(t, filepath.Join(dir, f)))))
		}
		interceptionCA(t, dir)

		p := env.StartSluice(string(config), sluiceOptions{})
		cl := &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 5 * time.Second}
		resp, err := cl.Get("http://" + p.AdminAddr + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		saw.response(resp, body)
		if resp.StatusCode != 200 {
			t.Fatalf("example not ready after setup.sh: %d %s\n%s", resp.StatusCode, body, tail(p.Stderr(), 3000))
		}
		if !strings.Contains(p.Stderr(), `"secrets":2`) {
			t.Errorf("serving line does not count the example's two secrets")
		}
	})
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
