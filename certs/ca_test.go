package certs

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestCreateLoadRoundTrip(t *testing.T) {
	clock := newFakeClock()
	ca, certPath, keyPath := newTestCA(t, CAOptions{Now: clock.Now})

	for path, want := range map[string]os.FileMode{certPath: 0o644, keyPath: 0o600} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s mode = %04o, want %04o", filepath.Base(path), got, want)
		}
	}
	keyPEM, err := os.ReadFile(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := pem.Decode(keyPEM); b == nil || b.Type != "PRIVATE KEY" {
		t.Errorf("key file is not a PKCS#8 PEM block")
	}
	// No temporary files are left next to the outputs.
	entries, _ := os.ReadDir(filepath.Dir(certPath))
	if len(entries) != 2 {
		t.Errorf("directory holds %d entries, want 2 (no temp files left)", len(entries))
	}

	c := ca.Certificate()
	if !c.IsCA || !c.BasicConstraintsValid {
		t.Error("not a CA certificate")
	}
	if c.MaxPathLen != 0 || !c.MaxPathLenZero {
		t.Errorf("MaxPathLen = %d, MaxPathLenZero = %v; want 0, true", c.MaxPathLen, c.MaxPathLenZero)
	}
	if c.KeyUsage != x509.KeyUsageCertSign|x509.KeyUsageCRLSign {
		t.Errorf("KeyUsage = %v, want CertSign|CRLSign", c.KeyUsage)
	}
	if len(c.SubjectKeyId) != 20 {
		t.Errorf("SubjectKeyId has %d bytes, want 20", len(c.SubjectKeyId))
	}
	if c.SerialNumber.Sign() <= 0 || c.SerialNumber.BitLen() > 128 {
		t.Errorf("serial %v is not a positive number of at most 128 bits", c.SerialNumber)
	}
	if !strings.HasPrefix(c.Subject.CommonName, "Sluice interception CA ") || len(c.Subject.CommonName) <= len("Sluice interception CA ") {
		t.Errorf("CommonName = %q, want the prefix plus a random suffix", c.Subject.CommonName)
	}
	if got := c.NotAfter.Sub(clock.Now()); got != DefaultCAValidity {
		t.Errorf("validity = %s, want %s", got, DefaultCAValidity)
	}
	if pub, ok := c.PublicKey.(*ecdsa.PublicKey); !ok || pub.Curve != elliptic.P256() {
		t.Errorf("public key is %T, want ECDSA P-256", c.PublicKey)
	}
	if err := c.CheckSignatureFrom(c); err != nil {
		t.Errorf("self-signature does not verify: %v", err)
	}

	// Two CAs never share a name or serial.
	ca2, _, _ := newTestCA(t, CAOptions{})
	if ca2.Certificate().Subject.CommonName == c.Subject.CommonName || ca2.Certificate().SerialNumber.Cmp(c.SerialNumber) == 0 {
		t.Error("two CAs share a CommonName or a serial")
	}
}

func TestCreateCAValidity(t *testing.T) {
	dir := t.TempDir()
	clock := newFakeClock()
	cp, kp := filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
	if err := CreateCA(cp, kp, CAOptions{Validity: 48 * time.Hour, CommonName: "test CA", Now: clock.Now}); err != nil {
		t.Fatal(err)
	}
	ca, err := LoadCAWithOptions(cp, kp, LoadOptions{Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	if got := ca.Certificate().NotAfter.Sub(clock.Now()); got != 48*time.Hour {
		t.Errorf("validity = %s, want 48h", got)
	}
	if ca.Certificate().Subject.CommonName != "test CA" {
		t.Errorf("CommonName = %q", ca.Certificate().Subject.CommonName)
	}
	for _, v := range []time.Duration{-time.Hour, time.Minute, 31 * 365 * 24 * time.Hour} {
		err := CreateCA(filepath.Join(dir, "x.pem"), filepath.Join(dir, "x-key.pem"), CAOptions{Validity: v})
		if err == nil || !strings.Contains(err.Error(), "validity") {
			t.Errorf("validity %s: err = %v, want a validity error", v, err)
		}
	}
	if err := CreateCA(cp, cp, CAOptions{}); err == nil {
		t.Error("same path for cert and key: no error")
	}
	if err := CreateCA("", kp, CAOptions{}); err == nil {
		t.Error("empty cert path: no error")
	}
	if err := CreateCA(filepath.Join(dir, "missing", "c.pem"), filepath.Join(dir, "missing", "k.pem"), CAOptions{}); err == nil {
		t.Error("missing directory: no error")
	}
}

func TestCreateCARefusesOverwrite(t *testing.T) {
	for _, existing := range []string{"cert", "key"} {
		t.Run(existing, func(t *testing.T) {
			dir := t.TempDir()
			cp, kp := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
			target := map[string]string{"cert": cp, "key": kp}[existing]
			writeFile(t, target, []byte("precious"), 0o600)

			err := CreateCA(cp, kp, CAOptions{})
			if err == nil || !strings.Contains(err.Error(), "refusing to overwrite") {
				t.Fatalf("err = %v, want a refusal to overwrite", err)
			}
			if b, _ := os.ReadFile(target); string(b) != "precious" {
				t.Errorf("existing %s was modified", existing)
			}
			entries, _ := os.ReadDir(dir)
			if len(entries) != 1 {
				t.Errorf("directory holds %d entries, want only the pre-existing file", len(entries))
			}
		})
	}
	// A dangling symlink counts as existing: following it would write the key
	// wherever it points.
	dir := t.TempDir()
	kp := filepath.Join(dir, "ca-key.pem")
	if err := os.Symlink(filepath.Join(dir, "elsewhere"), kp); err != nil {
		t.Fatal(err)
	}
	if err := CreateCA(filepath.Join(dir, "ca.pem"), kp, CAOptions{}); err == nil {
		t.Error("dangling symlink at key path: no error")
	}
	if _, err := os.Lstat(filepath.Join(dir, "elsewhere")); err == nil {
		t.Error("key written through a symlink")
	}
}

func TestCreateExclusiveLosesRace(t *testing.T) {
	// createExclusive has no existence pre-check of its own: the link step
	// alone must refuse, which is what closes the check-then-write race.
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	writeFile(t, p, []byte("first"), 0o644)
	if err := createExclusive(p, []byte("second"), 0o644); err == nil {
		t.Fatal("createExclusive overwrote an existing file")
	}
	if b, _ := os.ReadFile(p); string(b) != "first" {
		t.Error("existing file modified")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("%d entries left, want 1", len(entries))
	}
}

func TestLoadCAKeyMode(t *testing.T) {
	_, cp, kp := newTestCA(t, CAOptions{})
	for _, mode := range []os.FileMode{0o640, 0o604, 0o660, 0o644, 0o602} {
		if err := os.Chmod(kp, mode); err != nil {
			t.Fatal(err)
		}
		_, err := LoadCA(cp, kp)
		if err == nil || !strings.Contains(err.Error(), "chmod 600") {
			t.Errorf("mode %04o: err = %v, want a key mode refusal", mode, err)
		}
	}
	// The explicit opt-in accepts readable keys but never writable ones.
	if err := os.Chmod(kp, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadCAWithOptions(cp, kp, LoadOptions{AllowReadableKey: true}); err != nil {
		t.Errorf("mode 0644 with AllowReadableKey: %v", err)
	}
	for _, mode := range []os.FileMode{0o666, 0o620, 0o646} {
		if err := os.Chmod(kp, mode); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadCAWithOptions(cp, kp, LoadOptions{AllowReadableKey: true}); err == nil {
			t.Errorf("mode %04o with AllowReadableKey: no error for a writable key", mode)
		}
	}
	for _, mode := range []os.FileMode{0o600, 0o400} {
		if err := os.Chmod(kp, mode); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadCA(cp, kp); err != nil {
			t.Errorf("mode %04o: %v", mode, err)
		}
	}
	// A directory or a device is not a key file.
	if _, err := LoadCA(cp, filepath.Dir(kp)); err == nil {
		t.Error("directory as key: no error")
	}
	if _, err := LoadCA(cp, filepath.Join(filepath.Dir(kp), "missing")); err == nil {
		t.Error("missing key: no error")
	}
}

func TestLoadCAMismatchedKey(t *testing.T) {
	_, cp1, _ := newTestCA(t, CAOptions{})
	_, _, kp2 := newTestCA(t, CAOptions{})
	_, err := LoadCA(cp1, kp2)
	if err == nil || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("err = %v, want a mismatch error", err)
	}
}

func TestLoadCABenchFormat(t *testing.T) {
	for _, sec1 := range []bool{false, true} {
		t.Run(fmt.Sprintf("sec1=%v", sec1), func(t *testing.T) {
			dir := t.TempDir()
			cp, kp, combined, key := certgenCA(t, dir, sec1)

			// certgen writes the key with mode 0644: strict loading refuses it...
			if _, err := LoadCA(cp, kp); err == nil || !strings.Contains(err.Error(), "chmod 600") {
				t.Fatalf("strict load of a 0644 key: err = %v, want a mode refusal", err)
			}
			// ...the explicit opt-in accepts it...
			ca, err := LoadCAWithOptions(cp, kp, LoadOptions{AllowReadableKey: true})
			if err != nil {
				t.Fatalf("load bench CA with AllowReadableKey: %v", err)
			}
			if !ca.key.Equal(key) {
				t.Error("loaded key differs from the generated key")
			}
			// ...and so does strict loading once the key is private.
			if err := os.Chmod(kp, 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := LoadCA(cp, kp); err != nil {
				t.Fatalf("strict load after chmod 600: %v", err)
			}
			// mitmproxy's combined key+cert file serves as both.
			if err := os.Chmod(combined, 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := LoadCA(combined, combined); err != nil {
				t.Fatalf("combined file: %v", err)
			}
			// And leaves issued with it verify.
			iss, err := NewIssuer(ca, IssuerOptions{})
			if err != nil {
				t.Fatal(err)
			}
			verifyLeaf(t, iss, ca, "127.0.0.1", "127.0.0.1")
		})
	}
}

func TestLoadCARefusals(t *testing.T) {
	now := time.Now()
	p256, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	rsaKey, _ := rsa.GenerateKey(rand.Reader, 2048)
	edPub, edKey, _ := ed25519.GenerateKey(rand.Reader)
	caTmpl := func(mod func(*x509.Certificate)) *x509.Certificate {
		c := &x509.Certificate{
			SerialNumber:          big.NewInt(7),
			Subject:               pkix.Name{CommonName: "refusal test"},
			NotBefore:             now.Add(-time.Hour),
			NotAfter:              now.Add(time.Hour),
			KeyUsage:              x509.KeyUsageCertSign,
			BasicConstraintsValid: true,
			IsCA:                  true,
		}
		if mod != nil {
			mod(c)
		}
		return c
	}
	cases := []struct {
		name string
		tmpl *x509.Certificate
		key  any
		pub  any
		want string
	}{
		{"not a CA", caTmpl(func(c *x509.Certificate) { c.IsCA = false; c.KeyUsage = x509.KeyUsageDigitalSignature }), p256, &p256.PublicKey, "not a CA"},
		{"no cert sign", caTmpl(func(c *x509.Certificate) { c.KeyUsage = x509.KeyUsageDigitalSignature }), p256, &p256.PublicKey, "key usage"},
		{"expired", caTmpl(func(c *x509.Certificate) { c.NotBefore = now.Add(-48 * time.Hour); c.NotAfter = now.Add(-time.Hour) }), p256, &p256.PublicKey, "expired"},
		{"not yet valid", caTmpl(func(c *x509.Certificate) { c.NotBefore = now.Add(time.Hour); c.NotAfter = now.Add(48 * time.Hour) }), p256, &p256.PublicKey, "not valid before"},
		{"P-384", caTmpl(nil), p384, &p384.PublicKey, "P-256"},
		{"RSA", caTmpl(nil), rsaKey, &rsaKey.PublicKey, "ECDSA P-256"},
		{"Ed25519", caTmpl(nil), edKey, edPub, "ECDSA P-256"},
		{"ok", caTmpl(nil), p256, &p256.PublicKey, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			cb, kb := selfSignedPEM(t, tc.tmpl, tc.key, tc.pub)
			cp, kp := filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
			writeFile(t, cp, cb, 0o644)
			writeFile(t, kp, kb, 0o600)
			_, err := LoadCA(cp, kp)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("valid CA refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}

	// A P-256 certificate whose key file holds a key of another kind.
	dir := t.TempDir()
	cb, _ := selfSignedPEM(t, caTmpl(nil), p256, &p256.PublicKey)
	cp := filepath.Join(dir, "c.pem")
	writeFile(t, cp, cb, 0o644)
	rsaDER := x509.MarshalPKCS1PrivateKey(rsaKey)
	p384DER, _ := x509.MarshalECPrivateKey(p384)
	keyFiles := map[string][]byte{
		"rsa-pkcs1":  pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: rsaDER}),
		"p384-sec1":  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: p384DER}),
		"encrypted":  pem.EncodeToMemory(&pem.Block{Type: "ENCRYPTED PRIVATE KEY", Bytes: []byte{1, 2, 3}}),
		"garbage":    []byte("not a pem file"),
		"empty":      nil,
		"bad-pkcs8":  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte{0x30, 0x03, 1, 2, 3}}),
		"cert-only":  cb,
		"bad-sec1":   pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: []byte{0x30, 0x00}}),
		"ed25519-p8": selfKeyPEM(t, edKey),
	}
	for name, data := range keyFiles {
		kp := filepath.Join(dir, name+".pem")
		writeFile(t, kp, data, 0o600)
		if _, err := LoadCA(cp, kp); err == nil {
			t.Errorf("key file %s: no error", name)
		}
	}
	// Certificate files that are not certificates.
	for name, data := range map[string][]byte{
		"garbage":  []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"),
		"key-only": keyFiles["p384-sec1"],
	} {
		p := filepath.Join(dir, "cert-"+name+".pem")
		writeFile(t, p, data, 0o644)
		if _, err := LoadCA(p, filepath.Join(dir, "p384-sec1.pem")); err == nil {
			t.Errorf("cert file %s: no error", name)
		}
	}
}

func selfKeyPEM(t *testing.T, key any) []byte {
	t.Helper()
	d, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: d})
}

func TestCANeverPrintsKey(t *testing.T) {
	ca, _, keyPath := newTestCA(t, CAOptions{})
	keyFile, err := os.ReadFile(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	d := ca.key.D
	secrets := []string{d.String(), hex.EncodeToString(d.Bytes()), fmt.Sprintf("%x", d.Bytes()), string(bytes.TrimSpace(keyFile))}
	var logBuf bytes.Buffer
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("loaded", slog.Any("ca", ca))
	outputs := map[string]string{
		"%v":   fmt.Sprintf("%v", ca),
		"%+v":  fmt.Sprintf("%+v", ca),
		"%#v":  fmt.Sprintf("%#v", ca),
		"%s":   fmt.Sprintf("%s", ca),
		"slog": logBuf.String(),
	}
	for verb, out := range outputs {
		if !strings.Contains(out, ca.Fingerprint()) {
			t.Errorf("%s output %q lacks the fingerprint", verb, out)
		}
		for _, s := range secrets {
			if strings.Contains(out, s) {
				t.Errorf("%s output contains key material", verb)
			}
		}
	}
}
