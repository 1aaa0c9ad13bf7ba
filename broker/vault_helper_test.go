package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/sluicehq/sluice/internal/vaultdev"
)

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// devVault is one `vault server -dev` process on loopback (see
// internal/vaultdev) with an admin client holding its root token.
type devVault struct {
	t *testing.T
	*vaultdev.Server
	addr  string
	root  string
	admin *api.Client
}

// startDevVault starts an in-memory dev server on addr (empty: a free
// loopback port) with the given root token (empty: random), waits for it to be
// healthy and registers its teardown.
func startDevVault(t *testing.T, addr, root string) *devVault {
	t.Helper()
	if root == "" {
		root = "root-" + randomHex(t, 12)
	}
	srv := vaultdev.Start(t, addr, root)
	v := &devVault{t: t, Server: srv, addr: srv.Addr, root: root}
	conf := api.DefaultConfig()
	conf.Address = srv.URL()
	conf.HttpClient.Transport.(*http.Transport).Proxy = nil
	conf.MaxRetries = 0
	admin, err := api.NewClient(conf)
	if err != nil {
		t.Fatal(err)
	}
	admin.SetToken(root)
	v.admin = admin
	return v
}

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
