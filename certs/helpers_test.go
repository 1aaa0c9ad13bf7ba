package certs

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable clock for renewal and expiry tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Now().Truncate(time.Second)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// newTestCA creates a CA with CreateCA in a temp dir and loads it.
func newTestCA(t testing.TB, opts CAOptions) (*CA, string, string) {
	t.Helper()
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if err := CreateCA(certPath, keyPath, opts); err != nil {
		t.Fatalf("CreateCA: %v", err)
	}
	lo := LoadOptions{Now: opts.Now}
	ca, err := LoadCAWithOptions(certPath, keyPath, lo)
	if err != nil {
		t.Fatalf("LoadCA: %v", err)
	}
	return ca, certPath, keyPath
}

// certgenCA mirrors /work/shared/bench/certgen: an ECDSA P-256 CA with
// KeyUsage CertSign|CRLSign|DigitalSignature, no path length constraint, no
// explicit SubjectKeyId, key marshalled with the given encoder, all files
// written with os.WriteFile(..., 0o644).
func certgenCA(t testing.TB, dir string, sec1 bool) (certPath, keyPath, combinedPath string, key *ecdsa.PrivateKey) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	tmpl := &x509.Certificate{
		SerialNumber:          n,
		Subject:               pkix.Name{CommonName: "proxybench MITM CA", Organization: []string{"proxybench"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(5 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	var kb []byte
	if sec1 {
		d, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		kb = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: d})
	} else {
		d, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		kb = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: d})
	}
	cb := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	certPath = filepath.Join(dir, "mitm-ca.pem")
	keyPath = filepath.Join(dir, "mitm-ca-key.pem")
	combinedPath = filepath.Join(dir, "mitm-ca-combined.pem")
	writeFile(t, certPath, cb, 0o644)
	writeFile(t, keyPath, kb, 0o644)
	writeFile(t, combinedPath, append(append([]byte{}, kb...), cb...), 0o644)
	return certPath, keyPath, combinedPath, k
}

// writeFile writes with an exact mode, whatever the umask.
func writeFile(t testing.TB, path string, data []byte, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, data, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

// selfSignedPEM makes a certificate+key pair from a template and a key of any
// type, for the refusal tests.
func selfSignedPEM(t testing.TB, tmpl *x509.Certificate, key any, pub any) (certPEM, keyPEM []byte) {
	t.Helper()
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, key)
	if err != nil {
		t.Fatal(err)
	}
	kd, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kd})
}
