package identity

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicehq/sluice/rules"
)

func basic(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}

func mustSecret(t testing.TB) (secret, hash string) {
	t.Helper()
	s, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	h, err := HashSecret(s)
	if err != nil {
		t.Fatal(err)
	}
	return s, h
}

func mustKey(t testing.TB) Key {
	t.Helper()
	k, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestNewSecretAndHash(t *testing.T) {
	s1, h1 := mustSecret(t)
	s2, _ := mustSecret(t)
	if s1 == s2 {
		t.Fatal("two secrets are equal")
	}
	if !strings.HasPrefix(s1, SecretPrefix) || len(s1) != len(SecretPrefix)+43 {
		t.Fatalf("secret has unexpected shape (len %d)", len(s1))
	}
	if !strings.HasPrefix(h1, "sha256:") || len(h1) != 7+64 || strings.ToLower(h1) != h1 {
		t.Fatalf("hash has unexpected shape: %q", h1)
	}
	if h1b, _ := HashSecret(s1); h1b != h1 {
		t.Fatal("hash is not deterministic")
	}
	if _, err := parseHash(h1); err != nil {
		t.Fatalf("own hash does not parse: %v", err)
	}
}

func TestHashSecretRefuses(t *testing.T) {
	for name, s := range map[string]string{
		"short":     "abcdefghijklmnopqrstuvw", // 23
		"space":     "abcdefghijkl mnopqrstuvwxyz",
		"newline":   "abcdefghijklmnopqrstuvwxyz\n",
		"non-ascii": "abcdefghijklmnopqrstuvwxyzé",
		"token":     "slt1.abcdefghijklmnopqrstuvwxyz",
		"long":      strings.Repeat("a", MaxSecretLen+1),
	} {
		_, err := HashSecret(s)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if strings.Contains(err.Error(), strings.TrimSpace(s)[:20]) {
			t.Errorf("%s: error contains the secret: %v", name, err)
		}
	}
	if _, err := HashSecret(strings.Repeat("x", MinSecretLen)); err != nil {
		t.Errorf("24-character secret refused: %v", err)
	}
}

func TestParseHashRefuses(t *testing.T) {
	good := "sha256:" + strings.Repeat("ab", 32)
	if _, err := parseHash(good); err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"", "ab", "sha1:" + strings.Repeat("ab", 32), "sha256:" + strings.Repeat("AB", 32), "sha256:" + strings.Repeat("ab", 31), "sha256:" + strings.Repeat("zz", 32)} {
		if _, err := parseHash(h); err == nil {
			t.Errorf("parseHash(%q) accepted", h)
		}
	}
}

func TestKeyFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a", "b", "token.key")
	if err := GenerateKeyFile(path); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Size() != KeySize {
		t.Fatalf("key file mode %v size %d", fi.Mode(), fi.Size())
	}
	di, _ := os.Stat(filepath.Dir(path))
	if di.Mode().Perm() != 0o700 {
		t.Fatalf("parent dir mode %v", di.Mode())
	}
	before, _ := os.ReadFile(path)
	if err := GenerateKeyFile(path); err == nil {
		t.Fatal("overwrote an existing key file")
	}
	after, _ := os.ReadFile(path)
	if !bytes.Equal(before, after) {
		t.Fatal("existing key file was modified")
	}
	k, err := LoadKeyFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(k.b[:], before) {
		t.Fatal("loaded key differs from file")
	}

	// A token minted with the loaded key verifies with a second load of it.
	k2, _ := LoadKeyFile(path)
	a, err := NewAuthenticator(map[string][]rules.CredentialSpec{"acme": nil}, &k2, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_800_000_000, 0)
	tok, err := Mint(k, "acme", "sb1", time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Authenticate(basic("acme", tok), now); err != nil {
		t.Fatalf("token from loaded key refused: %v", err)
	}
}

func TestLoadKeyFileRefuses(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, data []byte, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key32 := bytes.Repeat([]byte{7}, KeySize)
	cases := map[string]string{
		"group-readable": write("g", key32, 0o640),
		"world-readable": write("w", key32, 0o604),
		"group-writable": write("gw", key32, 0o620),
		"short":          write("s", key32[:31], 0o600),
		"long":           write("l", append(key32, '\n'), 0o600),
		"empty":          write("e", nil, 0o600),
		"directory":      dir,
		"missing":        filepath.Join(dir, "nope"),
	}
	for name, p := range cases {
		if _, err := LoadKeyFile(p); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := LoadKeyFile(write("ok", key32, 0o400)); err != nil {
		t.Errorf("0400 key refused: %v", err)
	}
}

func TestKeyIsRedacted(t *testing.T) {
	k := mustKey(t)
	raw := k.b[:]
	forms := []string{
		fmt.Sprint(k), fmt.Sprintf("%v %+v %#v %s %x %X %q %d", k, k, k, k, k, k, k, k),
		fmt.Sprintf("%v %#v %x", &k, &k, &k), fmt.Sprintf("%+v", struct{ K Key }{k}),
	}
	var logBuf bytes.Buffer
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("x", "key", k)
	forms = append(forms, logBuf.String())
	if _, err := json.Marshal(k); err == nil {
		t.Error("json.Marshal of a key succeeded")
	}
	for _, f := range forms {
		for _, enc := range []string{fmt.Sprintf("%x", raw), fmt.Sprintf("%X", raw), base64.StdEncoding.EncodeToString(raw), string(raw), fmt.Sprint(raw)} {
			if strings.Contains(f, enc) {
				t.Fatalf("key bytes visible in %q", f)
			}
		}
		if !strings.Contains(f, "REDACTED") {
			t.Fatalf("no redaction marker in %q", f)
		}
	}
}

type fixture struct {
	a        *Authenticator
	key      Key
	secretA1 string
	secretA2 string
	secretB  string
	now      time.Time
}

func newFixture(t testing.TB, revoked ...string) *fixture {
	f := &fixture{key: mustKey(t), now: time.Unix(1_800_000_000, 0)}
	var hA1, hA2, hB string
	f.secretA1, hA1 = mustSecret(t)
	f.secretA2, hA2 = mustSecret(t)
	f.secretB, hB = mustSecret(t)
	creds := CredentialsFromTenants([]rules.TenantSpec{
		{ID: "acme", Credentials: []rules.CredentialSpec{{Name: "ci", Hash: hA1}, {Name: "dev", Hash: hA2}}},
		{ID: "beta", Credentials: []rules.CredentialSpec{{Name: "ci", Hash: hB}}},
		{ID: "gamma"},
	})
	var err error
	f.a, err = NewAuthenticator(creds, &f.key, revoked)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fixture) mint(t testing.TB, tenant, sandbox string, ttl time.Duration) string {
	t.Helper()
	tok, err := Mint(f.key, tenant, sandbox, ttl, f.now)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestAuthenticateSuccess(t *testing.T) {
	f := newFixture(t)
	p, err := f.a.Authenticate(basic("acme", f.secretA2), f.now)
	if err != nil {
		t.Fatal(err)
	}
	want := Principal{Tenant: "acme", Sandbox: "static:dev", Kind: KindStatic, CredentialName: "dev"}
	if p != want {
		t.Fatalf("got %+v want %+v", p, want)
	}
	// Scheme is case-insensitive, extra spaces tolerated.
	enc := base64.StdEncoding.EncodeToString([]byte("beta:" + f.secretB))
	for _, h := range []string{"basic " + enc, "BASIC  " + enc + " "} {
		if p, err := f.a.Authenticate(h, f.now); err != nil || p.Tenant != "beta" || p.CredentialName != "ci" {
			t.Fatalf("%q: %+v %v", h[:7], p, err)
		}
	}
	tok := f.mint(t, "gamma", "run-42.a_b", time.Hour)
	p, err = f.a.Authenticate(basic("gamma", tok), f.now)
	if err != nil {
		t.Fatal(err)
	}
	if p.Tenant != "gamma" || p.Sandbox != "run-42.a_b" || p.Kind != KindToken || len(p.TokenID) != 32 || !p.Expiry.Equal(f.now.Add(time.Hour)) || p.CredentialName != "" {
		t.Fatalf("unexpected principal %+v", p)
	}
}

func TestAuthenticateErrors(t *testing.T) {
	f := newFixture(t, "bad-sandbox", "static:dev")
	other := mustKey(t)
	tok := f.mint(t, "acme", "sb1", time.Hour)
	otherTok, _ := Mint(other, "acme", "sb1", time.Hour, f.now)
	revokedTok := f.mint(t, "acme", "bad-sandbox", time.Hour)
	byID := f.mint(t, "acme", "sb2", time.Hour)
	sameSandbox := f.mint(t, "acme", "sb2", time.Hour)
	pb, err := f.a.Authenticate(basic("acme", byID), f.now)
	if err != nil {
		t.Fatal(err)
	}
	fID2, err := NewAuthenticator(map[string][]rules.CredentialSpec{"acme": nil}, &f.key, []string{pb.TokenID})
	if err != nil {
		t.Fatal(err)
	}
	noKey, _ := NewAuthenticator(map[string][]rules.CredentialSpec{"acme": nil}, nil, nil)

	parts := strings.Split(tok, ".")
	flip := func(s string, i int) string {
		b := []byte(s)
		if b[i] == 'A' {
			b[i] = 'B'
		} else {
			b[i] = 'A'
		}
		return string(b)
	}
	tamperedPayload := parts[0] + "." + flip(parts[1], 5) + "." + parts[2]
	tamperedSig := parts[0] + "." + parts[1] + "." + flip(parts[2], 10)
	// A payload re-encoded for another tenant with the old signature.
	raw, _ := base64.RawURLEncoding.DecodeString(parts[1])
	forged := parts[0] + "." + base64.RawURLEncoding.EncodeToString(bytes.Replace(raw, []byte("acme"), []byte("beta"), 1)) + "." + parts[2]

	type tc struct {
		name   string
		a      *Authenticator
		header string
		at     time.Time
		want   error
	}
	cases := []tc{
		{"missing", f.a, "", f.now, ErrMissing},
		{"bearer", f.a, "Bearer " + f.secretA1, f.now, ErrMalformed},
		{"basic no space", f.a, "Basic", f.now, ErrMalformed},
		{"bad base64", f.a, "Basic !!!" + f.secretA1, f.now, ErrMalformed},
		{"no colon", f.a, "Basic " + base64.StdEncoding.EncodeToString([]byte("acme"+f.secretA1)), f.now, ErrMalformed},
		{"empty user", f.a, basic("", f.secretA1), f.now, ErrMalformed},
		{"too long", f.a, "Basic " + strings.Repeat("QUFB", 2000), f.now, ErrMalformed},
		{"token garbage", f.a, basic("acme", "slt1.not a token"), f.now, ErrMalformed},
		{"token truncated", f.a, basic("acme", tok[:len(tok)-3]), f.now, ErrMalformed},
		{"unknown tenant", f.a, basic("nobody", f.secretA1), f.now, ErrUnknown},
		{"wrong secret", f.a, basic("acme", f.secretB), f.now, ErrUnknown},
		{"tenant without static creds", f.a, basic("gamma", f.secretA1), f.now, ErrUnknown},
		{"short password", f.a, basic("acme", "x"), f.now, ErrUnknown},
		{"revoked static", f.a, basic("acme", f.secretA2), f.now, ErrRevoked},
		{"other key", f.a, basic("acme", otherTok), f.now, ErrUnknown},
		{"tampered payload", f.a, basic("acme", tamperedPayload), f.now, ErrUnknown},
		{"tampered signature", f.a, basic("acme", tamperedSig), f.now, ErrUnknown},
		{"forged tenant", f.a, basic("beta", forged), f.now, ErrUnknown},
		{"no key", noKey, basic("acme", tok), f.now, ErrUnknown},
		{"tenant mismatch", f.a, basic("beta", tok), f.now, ErrTenantMismatch},
		{"revoked sandbox", f.a, basic("acme", revokedTok), f.now, ErrRevoked},
		{"revoked token id", fID2, basic("acme", byID), f.now, ErrRevoked},
		{"expired", f.a, basic("acme", tok), f.now.Add(2 * time.Hour), ErrExpired},
	}
	all := []error{ErrMissing, ErrMalformed, ErrUnknown, ErrExpired, ErrRevoked, ErrTenantMismatch}
	for _, c := range cases {
		p, err := c.a.Authenticate(c.header, c.at)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
			continue
		}
		if p != (Principal{}) {
			t.Errorf("%s: non-zero principal on failure", c.name)
		}
		matches := 0
		for _, e := range all {
			if errors.Is(err, e) {
				matches++
			}
		}
		if matches != 1 {
			t.Errorf("%s: error matches %d sentinels", c.name, matches)
		}
		msg := err.Error()
		for _, secret := range []string{f.secretA1, f.secretA2, f.secretB, tok, parts[1], parts[2], strings.TrimPrefix(c.header, "Basic ")} {
			if len(secret) > 8 && strings.Contains(msg, secret) {
				t.Errorf("%s: error %q contains credential material", c.name, msg)
			}
		}
	}
	// Revoking one token id leaves another token for the same sandbox valid.
	if _, err := fID2.Authenticate(basic("acme", sameSandbox), f.now); err != nil {
		t.Fatalf("sibling of a revoked token: %v", err)
	}
}

func TestTokenExpiryBoundary(t *testing.T) {
	f := newFixture(t)
	tok := f.mint(t, "acme", "sb", 90*time.Second)
	exp := f.now.Add(90 * time.Second)
	for _, c := range []struct {
		at   time.Time
		want error
	}{
		{f.now.Add(-time.Hour), nil}, // issued in the future relative to a skewed clock: only expiry matters
		{f.now, nil},
		{exp.Add(-time.Nanosecond), nil},
		{exp, ErrExpired},
		{exp.Add(time.Nanosecond), ErrExpired},
	} {
		p, err := f.a.Authenticate(basic("acme", tok), c.at)
		if !errors.Is(err, c.want) || (c.want == nil && err != nil) {
			t.Errorf("at exp%+v: got %v want %v", c.at.Sub(exp), err, c.want)
		}
		if err == nil && !p.Expiry.Equal(exp) {
			t.Errorf("expiry %v want %v", p.Expiry, exp)
		}
	}
}

func TestMintRefuses(t *testing.T) {
	k := mustKey(t)
	now := time.Now()
	for name, c := range map[string]struct {
		tenant, sandbox string
		ttl             time.Duration
		now             time.Time
	}{
		"empty tenant":  {"", "s", time.Hour, now},
		"colon tenant":  {"a:b", "s", time.Hour, now},
		"pipe sandbox":  {"a", "s|x", time.Hour, now},
		"dot first":     {"a", ".s", time.Hour, now},
		"long sandbox":  {"a", strings.Repeat("s", MaxIDLen+1), time.Hour, now},
		"zero ttl":      {"a", "s", 0, now},
		"sub-second":    {"a", "s", 999 * time.Millisecond, now},
		"huge ttl":      {"a", "s", MaxTokenTTL + time.Second, now},
		"zero now":      {"a", "s", time.Hour, time.Time{}},
		"non-ascii id":  {"a", "sé", time.Hour, now},
		"space tenant ": {"a b", "s", time.Hour, now},
	} {
		if _, err := Mint(k, c.tenant, c.sandbox, c.ttl, c.now); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := Mint(Key{}, "a", "s", time.Hour, now); err == nil {
		t.Error("minted with the zero key")
	}
	if _, err := NewAuthenticator(map[string][]rules.CredentialSpec{"a": nil}, &Key{}, nil); err == nil {
		t.Error("authenticator accepted the zero key")
	}
	long := strings.Repeat("x", MaxIDLen)
	tok, err := Mint(k, long, long, MaxTokenTTL, now)
	if err != nil {
		t.Fatal(err)
	}
	if len(tok) > maxTokenLength {
		t.Fatalf("max token is %d bytes, bound %d", len(tok), maxTokenLength)
	}
	a, _ := NewAuthenticator(map[string][]rules.CredentialSpec{long: nil}, &k, nil)
	if p, err := a.Authenticate(basic(long, tok), now); err != nil || p.Sandbox != long {
		t.Fatalf("longest token: %+v %v", p, err)
	}
}

func TestNewAuthenticatorRefuses(t *testing.T) {
	_, h1 := mustSecret(t)
	_, h2 := mustSecret(t)
	for name, c := range map[string]struct {
		creds   map[string][]rules.CredentialSpec
		revoked []string
	}{
		"bad tenant id":    {map[string][]rules.CredentialSpec{"a:b": nil}, nil},
		"empty name":       {map[string][]rules.CredentialSpec{"a": {{Hash: h1}}}, nil},
		"dup name":         {map[string][]rules.CredentialSpec{"a": {{Name: "x", Hash: h1}, {Name: "x", Hash: h2}}}, nil},
		"bad hash":         {map[string][]rules.CredentialSpec{"a": {{Name: "x", Hash: "plaintext-password-oops"}}}, nil},
		"dup hash":         {map[string][]rules.CredentialSpec{"a": {{Name: "x", Hash: h1}, {Name: "y", Hash: h1}}}, nil},
		"dup hash tenants": {map[string][]rules.CredentialSpec{"a": {{Name: "x", Hash: h1}}, "b": {{Name: "x", Hash: h1}}}, nil},
		"empty revocation": {map[string][]rules.CredentialSpec{"a": nil}, []string{""}},
	} {
		a, err := NewAuthenticator(c.creds, nil, c.revoked)
		if err == nil || a != nil {
			t.Errorf("%s: accepted", name)
		}
	}
	_, err := NewAuthenticator(map[string][]rules.CredentialSpec{"a": {{Name: "x", Hash: "plaintext-password-oops"}}}, nil, nil)
	if err != nil && strings.Contains(err.Error(), "plaintext-password-oops") {
		t.Error("error echoes the configured hash value")
	}
}

func TestAuthenticateConcurrent(t *testing.T) {
	f := newFixture(t, "revoked-sb")
	toks := make([]string, 8)
	for i := range toks {
		toks[i] = f.mint(t, "acme", fmt.Sprintf("sb%d", i), time.Hour)
	}
	bad := f.mint(t, "acme", "revoked-sb", time.Hour)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 300; i++ {
				var err error
				switch i % 4 {
				case 0:
					var p Principal
					p, err = f.a.Authenticate(basic("acme", toks[(g+i)%len(toks)]), f.now)
					if err == nil && p.Sandbox != fmt.Sprintf("sb%d", (g+i)%len(toks)) {
						err = fmt.Errorf("wrong sandbox %q", p.Sandbox)
					}
				case 1:
					_, err = f.a.Authenticate(basic("beta", f.secretB), f.now)
				case 2:
					if _, e := f.a.Authenticate(basic("acme", bad), f.now); !errors.Is(e, ErrRevoked) {
						err = fmt.Errorf("revoked token: %v", e)
					}
				case 3:
					if _, e := f.a.Authenticate(basic("beta", f.secretA1), f.now); !errors.Is(e, ErrUnknown) {
						err = fmt.Errorf("cross-tenant secret: %v", e)
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func BenchmarkAuthenticate(b *testing.B) {
	f := newFixture(b)
	tok := f.mint(b, "acme", "sandbox-1234", time.Hour)
	for _, c := range []struct{ name, header string }{
		{"static", basic("acme", f.secretA2)},
		{"token", basic("acme", tok)},
		{"unknown-tenant", basic("nobody", f.secretA2)},
		{"bad-signature", basic("acme", tok[:len(tok)-2]+"AA")},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = f.a.Authenticate(c.header, f.now)
			}
		})
	}
}
