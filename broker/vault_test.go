package broker

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/rules"
)

type vaultEnv struct {
	b     *Broker
	logs  *syncBuffer
	clock *fakeClock
	errs  []string // every error the test saw from the broker
}

func (e *vaultEnv) get(name string) string {
	v, err := e.b.Get(name)
	if err != nil {
		e.errs = append(e.errs, err.Error())
		return "error: " + err.Error()
	}
	return v.Reveal()
}

func (e *vaultEnv) texts() []string {
	out := append([]string{e.logs.String()}, e.errs...)
	if err := e.b.Ready(); err != nil {
		out = append(out, err.Error())
	}
	return out
}

// startVaultBroker starts a broker on cfg; clock may be nil for real time.
func startVaultBroker(t *testing.T, cfg rules.BrokerConfig, clock *fakeClock, specs ...rules.SecretSpec) *vaultEnv {
	t.Helper()
	env := &vaultEnv{logs: &syncBuffer{}, clock: clock}
	opts := Options{Logger: slog.New(slog.NewJSONHandler(env.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	if clock != nil {
		opts.Now = clock.Now
	}
	b, err := New(cfg, specs, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); b.Wait() })
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	env.b = b
	return env
}

func vaultSpec(name, path, field string) rules.SecretSpec {
	return rules.SecretSpec{Name: name, Source: "vault", Path: path, Field: field, Hosts: []string{"api.example.com"}}
}

func TestVaultAppRoleFetchAndRotate(t *testing.T) {
	for _, wrapped := range []bool{false, true} {
		name := "plain-secret-id"
		if wrapped {
			name = "wrapped-secret-id"
		}
		t.Run(name, func(t *testing.T) {
			v := startDevVault(t, "", "")
			v1 := "ghp_" + randomHex(t, 16)
			v2 := "ghp_" + randomHex(t, 16)
			v.putSecret("ci/github", map[string]any{"token": v1, "user": "octo"})
			roleID := v.appRole("sluice", time.Hour, 2*time.Hour)
			secretID := v.secretID("sluice", wrapped)
			dir := t.TempDir()
			cfg := rules.BrokerConfig{
				Refresh: rules.Duration(200 * time.Millisecond),
				Vault: rules.VaultConfig{
					Address: v.URL(), Auth: "approle",
					RoleIDFile:      writeCred(t, dir, "role-id", roleID),
					SecretIDFile:    writeCred(t, dir, "secret-id", secretID),
					SecretIDWrapped: wrapped,
					Timeout:         rules.Duration(5 * time.Second),
				},
			}
			env := startVaultBroker(t, cfg, nil, vaultSpec("github", "secret/data/ci/github", "token"))
			if got := env.get("github"); got != v1 {
				t.Fatalf("Get = %q", got)
			}
			v.putSecret("ci/github", map[string]any{"token": v2, "user": "octo"})
			eventually(t, 10*time.Second, "rotated value", func() bool { return env.get("github") == v2 })
			if !strings.Contains(env.logs.String(), "secret rotated") {
				t.Fatalf("rotation not logged:\n%s", env.logs.String())
			}
			if wrapped {
				// The wrapping token was single-use: it cannot be unwrapped again.
				if _, err := v.admin.Logical().Unwrap(secretID); err == nil {
					t.Fatal("wrapping token still valid after login")
				}
			}
			assertNoLeak(t, env.texts(), v1, v2, roleID, secretID, v.root)
		})
	}
}

func TestVaultTokenRenewalAndRelogin(t *testing.T) {
	v := startDevVault(t, "", "")
	v.putSecret("ci/api", map[string]any{"key": "sk-one-" + randomHex(t, 8)})
	roleID := v.appRole("short", 3*time.Second, 6*time.Second)
	secretID := v.secretID("short", false)
	dir := t.TempDir()
	cfg := rules.BrokerConfig{
		Refresh:      rules.Duration(200 * time.Millisecond),
		MaxStaleness: rules.Duration(time.Second),
		Vault: rules.VaultConfig{
			Address: v.URL(), Auth: "approle",
			RoleIDFile:   writeCred(t, dir, "role-id", roleID),
			SecretIDFile: writeCred(t, dir, "secret-id", secretID),
			Timeout:      rules.Duration(5 * time.Second),
		},
	}
	env := startVaultBroker(t, cfg, nil, vaultSpec("api", "secret/data/ci/api", "key"))
	// Run well past the token's max TTL (6s), rotating the value every
	// second: each must arrive, so fetching never stopped.
	var values []string
	for i := range 9 {
		val := "sk-" + randomHex(t, 8)
		values = append(values, val)
		v.putSecret("ci/api", map[string]any{"key": val})
		eventually(t, 5*time.Second, "value "+string(rune('0'+i)), func() bool { return env.get("api") == val })
		time.Sleep(time.Second)
	}
	logs := env.logs.String()
	if n := strings.Count(logs, "vault approle login"); n < 2 {
		t.Fatalf("want a re-login after max TTL, saw %d logins:\n%s", n, logs)
	}
	// The re-login comes from the lifetime watcher ending, or, when a
	// loaded machine lets the token lapse first, from a fetch that found
	// it gone (the watcher then follows that login). Either way fetching
	// went on past the max TTL, which the values above prove.
	if strings.Contains(logs, "refresh failed") {
		t.Fatalf("a refresh failed around the token's end of life:\n%s", logs)
	}
	if !strings.Contains(logs, "vault token renewed") {
		t.Fatalf("the token was never renewed:\n%s", logs)
	}
	assertNoLeak(t, env.texts(), append(values, roleID, secretID, v.root)...)
}

func TestVaultOutageStaleAndRecovery(t *testing.T) {
	v := startDevVault(t, "", "")
	val := "xoxb-" + randomHex(t, 12)
	v.putSecret("ci/slack", map[string]any{"token": val})
	dir := t.TempDir()
	clock := newFakeClock()
	cfg := rules.BrokerConfig{
		Refresh:      rules.Duration(200 * time.Millisecond),
		MaxStaleness: rules.Duration(time.Minute),
		Vault: rules.VaultConfig{
			Address: v.URL(), Auth: "token", TokenFile: writeCred(t, dir, "token", v.root),
			Timeout: rules.Duration(2 * time.Second), MaxRetries: 1,
		},
	}
	env := startVaultBroker(t, cfg, clock, vaultSpec("slack", "secret/data/ci/slack", "token"))
	if got := env.get("slack"); got != val {
		t.Fatalf("Get = %q", got)
	}

	v.Stop()
	eventually(t, 20*time.Second, "failed refresh", func() bool { return strings.Contains(env.logs.String(), "serving cached value") })
	clock.Advance(59 * time.Second)
	if got := env.get("slack"); got != val {
		t.Fatalf("within max staleness, Vault down: Get = %q", got)
	}
	clock.Advance(2 * time.Second)
	if _, err := env.b.Get("slack"); !errors.Is(err, ErrStale) || !strings.Contains(err.Error(), `"slack"`) {
		t.Fatalf("past max staleness: %v", err)
	} else {
		env.errs = append(env.errs, err.Error())
	}
	if err := env.b.Ready(); err == nil {
		t.Fatal("Ready with a stale secret")
	}

	// A new dev server on the same address with the same root token; dev
	// servers are in memory, so seed the secret again (rotated meanwhile).
	v2 := startDevVault(t, v.addr, v.root)
	rotated := "xoxb-" + randomHex(t, 12)
	v2.putSecret("ci/slack", map[string]any{"token": rotated})
	eventually(t, 20*time.Second, "recovery", func() bool { return env.get("slack") == rotated })
	if err := env.b.Ready(); err != nil {
		t.Fatalf("Ready after recovery: %v", err)
	}
	assertNoLeak(t, env.texts(), val, rotated, v.root)
}

func TestVaultFetchErrors(t *testing.T) {
	v := startDevVault(t, "", "")
	val := "sk-" + randomHex(t, 12)
	v.putSecret("app", map[string]any{"key": val, "num": 42})
	dir := t.TempDir()
	src, err := NewVaultSource(rules.VaultConfig{Address: v.URL(), TokenFile: writeCred(t, dir, "token", v.root)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	got, err := src.Fetch(ctx, vaultSpec("a", "secret/data/app", "key"))
	if err != nil || got.Reveal() != val {
		t.Fatalf("Fetch: %v", err)
	}
	cases := map[string]rules.SecretSpec{
		`no field "nope"`:           vaultSpec("a", "secret/data/app", "nope"),
		`field "num" is a`:          vaultSpec("a", "secret/data/app", "num"),
		"no secret at this path":    vaultSpec("a", "secret/data/missing", "key"),
		"want the KV v2 API path":   vaultSpec("a", "secret/app", "key"),
		"lookup-self":               {}, // bad token, below
		"approle login (mount":      {}, // bad approle, below
		"approle secret id":         {}, // missing file, below
		"no token (set broker.vaul": {}, // no token, below
	}
	var errs []string
	for want, spec := range cases {
		s := src
		switch want {
		case "lookup-self":
			s, _ = NewVaultSource(rules.VaultConfig{Address: v.URL(), TokenFile: writeCred(t, dir, "bad", "hvs.not-a-real-token")}, nil)
			spec = vaultSpec("a", "secret/data/app", "key")
		case "approle login (mount":
			v.appRole("r", time.Hour, time.Hour)
			s, _ = NewVaultSource(rules.VaultConfig{Address: v.URL(), Auth: "approle",
				RoleIDFile: writeCred(t, dir, "rid", "bogus-role-id"), SecretIDFile: writeCred(t, dir, "sid", "bogus-secret-id")}, nil)
			spec = vaultSpec("a", "secret/data/app", "key")
		case "approle secret id":
			s, _ = NewVaultSource(rules.VaultConfig{Address: v.URL(), Auth: "approle",
				RoleIDFile: writeCred(t, dir, "rid2", "x"), SecretIDFile: dir + "/absent"}, nil)
			spec = vaultSpec("a", "secret/data/app", "key")
		case "no token (set broker.vaul":
			t.Setenv("VAULT_TOKEN", "")
			s, _ = NewVaultSource(rules.VaultConfig{Address: v.URL()}, nil)
			spec = vaultSpec("a", "secret/data/app", "key")
		}
		_, err := s.Fetch(ctx, spec)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err = %v", want, err)
		}
		if err != nil {
			errs = append(errs, err.Error())
		}
	}
	assertNoLeak(t, errs, val, v.root, "hvs.not-a-real-token", "bogus-secret-id", "bogus-role-id")
}

func TestVaultClientIgnoresProxyEnvironment(t *testing.T) {
	t.Setenv("VAULT_HTTP_PROXY", "http://127.0.0.1:9")
	t.Setenv("HTTPS_PROXY", "http://127.0.0.1:9")
	t.Setenv("HTTP_PROXY", "http://127.0.0.1:9")
	src, err := NewVaultSource(rules.VaultConfig{Address: "http://127.0.0.1:8200"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tr, ok := src.client.CloneConfig().HttpClient.Transport.(*http.Transport)
	if !ok || tr.Proxy != nil {
		t.Fatalf("the Vault client's transport uses a proxy")
	}
	if src.client.Token() != "" {
		t.Fatal("client picked up a token before login")
	}
}

// A path the policy denies must not cost the login every other secret needs,
// even with a single-use wrapped secret id that cannot log in twice.
func TestVaultPolicyDenialKeepsLogin(t *testing.T) {
	v := startDevVault(t, "", "")
	v.putSecret("app", map[string]any{"key": "first-" + randomHex(t, 8)})
	roleID := v.appRole("sluice", time.Hour, 2*time.Hour)
	secretID := v.secretID("sluice", true)
	dir := t.TempDir()
	cfg := rules.BrokerConfig{
		Refresh: rules.Duration(200 * time.Millisecond),
		Vault: rules.VaultConfig{
			Address: v.URL(), Auth: "approle", SecretIDWrapped: true,
			RoleIDFile:   writeCred(t, dir, "role-id", roleID),
			SecretIDFile: writeCred(t, dir, "secret-id", secretID),
		},
	}
	env := startVaultBroker(t, cfg, nil, vaultSpec("ok", "secret/data/app", "key"), vaultSpec("denied", "other/data/x", "key"))
	if _, err := env.b.Get("denied"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("denied: %v", err)
	}
	eventually(t, 10*time.Second, "several denied refreshes", func() bool {
		return strings.Count(env.logs.String(), "permission denied") >= 3
	})
	val := "second-" + randomHex(t, 8)
	v.putSecret("app", map[string]any{"key": val})
	eventually(t, 10*time.Second, "rotation of the allowed secret", func() bool { return env.get("ok") == val })
	if n := strings.Count(env.logs.String(), "vault approle login"); n != 1 {
		t.Fatalf("%d logins, want 1", n)
	}
	assertNoLeak(t, env.texts(), val, roleID, secretID, v.root)
}
