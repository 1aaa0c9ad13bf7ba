package certs

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// pemCerts parses a bundle and fails on any block that is not a certificate.
func pemCerts(t *testing.T, data []byte) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	rest := data
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" || len(b.Headers) != 0 {
			t.Fatalf("bundle holds a %q block with headers %v", b.Type, b.Headers)
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatalf("bundle holds an unparsable certificate: %v", err)
		}
		out = append(out, c)
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		t.Fatalf("bundle has trailing non-PEM data: %q", rest)
	}
	return out
}

// fakeSystemRoots writes a root file with two real roots plus the kinds of
// noise a bundle must not carry over: comments, a key, a broken certificate.
func fakeSystemRoots(t *testing.T, dir string) (string, []*x509.Certificate) {
	t.Helper()
	r1, _, _ := newTestCA(t, CAOptions{CommonName: "Fake Root One"})
	r2, _, r2Key := newTestCA(t, CAOptions{CommonName: "Fake Root Two"})
	keyPEM, err := os.ReadFile(r2Key)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	b.WriteString("# Fake Root One\n")
	pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: r1.Certificate().Raw})
	b.WriteString("# a key that must never be copied\n")
	b.Write(keyPEM)
	pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: []byte{0x30, 0x03, 1, 2, 3}})
	pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Headers: map[string]string{"Note": "x"}, Bytes: r2.Certificate().Raw})
	p := filepath.Join(dir, "roots.pem")
	writeFile(t, p, b.Bytes(), 0o644)
	return p, []*x509.Certificate{r1.Certificate(), r2.Certificate()}
}

func TestWriteTrustBundle(t *testing.T) {
	dir := t.TempDir()
	roots, want := fakeSystemRoots(t, dir)
	ca, _, _ := newTestCA(t, CAOptions{})
	other := filepath.Join(dir, "other.pem")
	writeFile(t, other, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Certificate().Raw}), 0o644)

	var out bytes.Buffer
	// The first existing file wins; missing ones are skipped.
	if err := WriteTrustBundle(&out, ca.Certificate(), []string{filepath.Join(dir, "missing.pem"), roots, other}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "PRIVATE KEY") || strings.Contains(out.String(), "#") {
		t.Fatal("bundle carries a key or comments from the system file")
	}
	got := pemCerts(t, out.Bytes())
	if len(got) != 3 {
		t.Fatalf("bundle holds %d certificates, want 2 roots + the CA", len(got))
	}
	for k, c := range want {
		if !got[k].Equal(c) {
			t.Errorf("certificate %d is %q, want %q", k, got[k].Subject.CommonName, c.Subject.CommonName)
		}
	}
	if !got[2].Equal(ca.Certificate()) {
		t.Error("the sluice CA is not last")
	}
	// A pool built from the bundle verifies a sluice leaf.
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	leaf := verifyLeaf(t, iss, ca, "bundle.example", "bundle.example")
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(out.Bytes()) {
		t.Fatal("bundle does not load into a CertPool")
	}
	if _, err := leaf.Leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: "bundle.example"}); err != nil {
		t.Errorf("leaf does not verify against the bundle: %v", err)
	}

	// A system file that already holds the CA does not get it twice.
	out.Reset()
	if err := WriteTrustBundle(&out, ca.Certificate(), []string{other}); err != nil {
		t.Fatal(err)
	}
	if n := len(pemCerts(t, out.Bytes())); n != 1 {
		t.Errorf("CA duplicated: %d certificates", n)
	}
}

func TestWriteTrustBundleErrors(t *testing.T) {
	dir := t.TempDir()
	ca, _, _ := newTestCA(t, CAOptions{})
	var out bytes.Buffer
	if err := WriteTrustBundle(&out, ca.Certificate(), []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")}); err == nil || !strings.Contains(err.Error(), "no system root bundle") {
		t.Errorf("no root file: err = %v", err)
	}
	if err := WriteTrustBundle(&out, ca.Certificate(), nil); err == nil {
		t.Error("empty root list: no error")
	}
	empty := filepath.Join(dir, "empty.pem")
	writeFile(t, empty, []byte("# nothing here\n"), 0o644)
	if err := WriteTrustBundle(&out, ca.Certificate(), []string{empty}); err == nil || !strings.Contains(err.Error(), "no certificates") {
		t.Errorf("root file without certificates: err = %v", err)
	}
	// A root path that exists but cannot be read is an error, not skipped.
	if err := WriteTrustBundle(&out, ca.Certificate(), []string{dir}); err == nil {
		t.Error("directory as root file: no error")
	}
	if err := WriteTrustBundle(&out, nil, []string{empty}); err == nil {
		t.Error("nil CA certificate: no error")
	}
	if err := WriteBundle(&out, nil); err == nil {
		t.Error("WriteBundle(nil): no error")
	}
	if out.Len() != 0 {
		t.Error("a failed call wrote output")
	}
}

// TestWriteBundleSystemRoots uses the machine's own bundle: success when one
// of the usual files exists, a clear error when none does.
func TestWriteBundleSystemRoots(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	found := ""
	for _, p := range SystemRootFiles() {
		if _, err := os.Stat(p); err == nil {
			found = p
			break
		}
	}
	var out bytes.Buffer
	err := WriteBundle(&out, ca)
	if found == "" {
		if err == nil {
			t.Fatal("no system bundle on this machine, yet WriteBundle succeeded")
		}
		return
	}
	if err != nil {
		t.Fatalf("system bundle %s: %v", found, err)
	}
	certs := pemCerts(t, out.Bytes())
	if len(certs) < 2 || !certs[len(certs)-1].Equal(ca.Certificate()) {
		t.Fatalf("bundle of %d certificates does not end with the sluice CA", len(certs))
	}
}
