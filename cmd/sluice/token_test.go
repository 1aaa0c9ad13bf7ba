package main

import (
	"encoding/base64"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/rules"
)

func TestTokenNewPrintsSecretThenHash(t *testing.T) {
	out, errOut, code := runSluice(t, "", "token", "new")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("want 2 lines, got %d", len(lines))
	}
	secret, hash := lines[0], lines[1]
	if !strings.HasPrefix(secret, identity.SecretPrefix) {
		t.Fatal("first line is not a sluice secret")
	}
	want, err := identity.HashSecret(secret)
	if err != nil || hash != want {
		t.Fatalf("second line is not the secret's hash (%v)", err)
	}
	if strings.Contains(errOut, secret) || strings.Contains(hash, secret) {
		t.Fatal("secret shown outside the first line")
	}
	// The hash is accepted by the authenticator and the secret authenticates.
	a, err := identity.NewAuthenticator(map[string][]rules.CredentialSpec{"acme": {{Name: "ci", Hash: hash}}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := a.Authenticate("Basic "+base64.StdEncoding.EncodeToString([]byte("acme:"+secret)), time.Now())
	if err != nil || p.CredentialName != "ci" {
		t.Fatalf("generated credential does not authenticate: %+v %v", p, err)
	}
	// Two runs, two different secrets.
	out2, _, _ := runSluice(t, "", "token", "new")
	if strings.SplitN(out2, "\n", 2)[0] == secret {
		t.Fatal("token new printed the same secret twice")
	}
}

func TestTokenHashReadsStdinOnly(t *testing.T) {
	secret, err := identity.NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	want, _ := identity.HashSecret(secret)
	for _, in := range []string{secret, secret + "\n", secret + "\r\n"} {
		out, errOut, code := runSluice(t, in, "token", "hash")
		if code != 0 || out != want+"\n" {
			t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
		}
		if strings.Contains(out+errOut, secret) {
			t.Fatal("token hash echoed the secret")
		}
	}
	// Refusals: the secret on argv (plain, as a flag, glued to a shorthand),
	// under the parent command, and bad stdin. None may echo the secret.
	for _, c := range []struct {
		stdin string
		args  []string
	}{
		{"", []string{"token", "hash", secret}},
		{secret, []string{"token", "hash", secret}},
		{"", []string{"token", "hash", "--secret=" + secret}},
		{"", []string{"token", "hash", "-s" + secret}},
		{"", []string{"token", secret}},
		{"", []string{"token", "new", secret}},
		{"", []string{"token", "hash"}},
		{"sls_short\n", []string{"token", "hash"}},
		{secret + "\n" + secret + "\n", []string{"token", "hash"}},
		{secret + " trailing\n", []string{"token", "hash"}},
		{strings.Repeat(secret, 20), []string{"token", "hash"}},
	} {
		out, errOut, code := runSluice(t, c.stdin, c.args...)
		if code == 0 {
			t.Errorf("%q with stdin of %d bytes: exit 0 (stdout %q)", c.args, len(c.stdin), out)
		}
		if strings.Contains(out+errOut, secret) || strings.Contains(out+errOut, "sls_short") {
			t.Errorf("%q: output contains the secret: %q", c.args, out+errOut)
		}
		if errOut == "" {
			t.Errorf("%q: no error message", c.args)
		}
	}
}

func TestTokenKeygenAndMint(t *testing.T) {
	dir := t.TempDir()
	keyPath := filepath.Join(dir, "keys", "token.key")
	out, errOut, code := runSluice(t, "", "token", "keygen", "--key", keyPath)
	if code != 0 {
		t.Fatalf("keygen exit %d: %s", code, errOut)
	}
	raw, err := os.ReadFile(keyPath)
	if err != nil || len(raw) != identity.KeySize {
		t.Fatalf("key file: %d bytes, %v", len(raw), err)
	}
	fi, _ := os.Stat(keyPath)
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v", fi.Mode())
	}
	leaks := func(s string) bool {
		return strings.Contains(s, hex.EncodeToString(raw)) || strings.Contains(s, base64.StdEncoding.EncodeToString(raw)) ||
			strings.Contains(s, base64.RawURLEncoding.EncodeToString(raw)) || strings.Contains(s, string(raw))
	}
	if leaks(out + errOut) {
		t.Fatal("keygen printed the key")
	}
	if _, _, code := runSluice(t, "", "token", "keygen", "--key", keyPath); code == 0 {
		t.Fatal("keygen overwrote an existing key")
	}
	if again, _ := os.ReadFile(keyPath); string(again) != string(raw) {
		t.Fatal("existing key changed")
	}

	before := time.Now().Truncate(time.Second)
	out, errOut, code = runSluice(t, "", "token", "mint", "--key", keyPath, "--tenant", "acme", "--sandbox", "run-7", "--ttl", "90m")
	if code != 0 {
		t.Fatalf("mint exit %d: %s", code, errOut)
	}
	if leaks(out + errOut) {
		t.Fatal("mint printed the key")
	}
	tok := strings.TrimSuffix(out, "\n")
	if strings.Contains(tok, "\n") || strings.Contains(errOut, tok) {
		t.Fatal("mint output is not exactly one token on stdout")
	}
	key, err := identity.LoadKeyFile(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	a, err := identity.NewAuthenticator(map[string][]rules.CredentialSpec{"acme": nil}, &key, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := a.Authenticate("Basic "+base64.StdEncoding.EncodeToString([]byte("acme:"+tok)), time.Now())
	if err != nil {
		t.Fatalf("minted token refused: %v", err)
	}
	if p.Tenant != "acme" || p.Sandbox != "run-7" || p.Expiry.Before(before.Add(90*time.Minute)) || p.Expiry.After(time.Now().Add(90*time.Minute)) {
		t.Fatalf("principal %+v", p)
	}

	// Refusals: a key readable by others, missing flags, bad ids, bad ttl.
	loose := filepath.Join(dir, "loose.key")
	if err := os.WriteFile(loose, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(loose, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"token", "mint", "--key", loose, "--tenant", "acme", "--sandbox", "s"},
		{"token", "mint", "--key", keyPath, "--tenant", "acme"},
		{"token", "mint", "--tenant", "acme", "--sandbox", "s"},
		{"token", "mint", "--key", keyPath, "--tenant", "a:b", "--sandbox", "s"},
		{"token", "mint", "--key", keyPath, "--tenant", "acme", "--sandbox", "s", "--ttl", "0s"},
		{"token", "mint", "--key", keyPath, "--tenant", "acme", "--sandbox", "s", "--ttl", "1000h"},
		{"token", "keygen"},
	} {
		out, errOut, code := runSluice(t, "", args...)
		if code == 0 || out != "" {
			t.Errorf("%q: exit %d stdout %q", args, code, out)
		}
		if leaks(errOut) {
			t.Errorf("%q: stderr leaks the key", args)
		}
	}
}
