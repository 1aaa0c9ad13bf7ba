package certs

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"strings"
	"time"
)

// DefaultCAValidity is how long a CA made by CreateCA is valid unless told
// otherwise: five years, the usual lifetime of a private interception root.
const DefaultCAValidity = 5 * 365 * 24 * time.Hour

const (
	minCAValidity = time.Hour
	maxCAValidity = 30 * 365 * 24 * time.Hour
	// caBackdate tolerates clients whose clock runs a little behind ours.
	caBackdate = time.Hour
)

// CAOptions tune CreateCA. The zero value is valid.
type CAOptions struct {
	// Validity is the CA's lifetime; zero means DefaultCAValidity.
	Validity time.Duration
	// CommonName defaults to "Sluice interception CA <random suffix>". The
	// suffix makes each installation's root distinguishable in trust stores.
	CommonName string
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// CA is a loaded interception CA: its certificate and its private key. The key
// stays inside this value; CA never prints, logs or marshals it.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// Certificate returns the CA certificate (public data).
func (c *CA) Certificate() *x509.Certificate { return c.cert }

// Fingerprint returns the SHA-256 of the CA certificate's DER, in lower-case
// hex, for logs and for operators comparing trust stores.
func (c *CA) Fingerprint() string {
	sum := sha256.Sum256(c.cert.Raw)
	return hex.EncodeToString(sum[:])
}

// String describes the CA without its key, so that %v and %+v cannot print
// the key through reflection.
func (c *CA) String() string {
	if c == nil || c.cert == nil {
		return "CA(<nil>)"
	}
	return fmt.Sprintf("CA(%q, sha256:%s, expires %s)", c.cert.Subject.CommonName, c.Fingerprint(), c.cert.NotAfter.UTC().Format(time.RFC3339))
}

// GoString keeps %#v from dumping the private key.
func (c *CA) GoString() string { return c.String() }

// LogValue keeps slog from dumping the private key.
func (c *CA) LogValue() slog.Value {
	if c == nil || c.cert == nil {
		return slog.StringValue("<nil>")
	}
	return slog.GroupValue(
		slog.String("subject", c.cert.Subject.CommonName),
		slog.String("sha256", c.Fingerprint()),
		slog.Time("not_after", c.cert.NotAfter),
	)
}

// CreateCA creates a new ECDSA P-256 interception CA and writes its
// certificate (PEM, mode 0644) to certPath and its key (PKCS#8 PEM, mode 0600)
// to keyPath. It never overwrites an existing file, and each file appears
// atomically, complete or not at all.
func CreateCA(certPath, keyPath string, opts CAOptions) error {
	if certPath == "" || keyPath == "" {
		return errors.New("certs: create CA: both a certificate path and a key path are required")
	}
	if certPath == keyPath {
		return errors.New("certs: create CA: the certificate and the key must be different files")
	}
	validity := opts.Validity
	if validity == 0 {
		validity = DefaultCAValidity
	}
	if validity < minCAValidity || validity > maxCAValidity {
		return fmt.Errorf("certs: create CA: validity %s is outside [%s, %s]", validity, minCAValidity, maxCAValidity)
	}
	now := time.Now
	if opts.Now != nil {
		now = opts.Now
	}
	// Check both paths before generating anything, so the common mistake
	// (running init twice) fails without leaving a half-written pair.
	for _, p := range []string{certPath, keyPath} {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("certs: create CA: %s already exists: refusing to overwrite it", p)
		}
	}

	cn := opts.CommonName
	if cn == "" {
		suffix := make([]byte, 4)
		if _, err := rand.Read(suffix); err != nil {
			return fmt.Errorf("certs: create CA: random name suffix: %w", err)
		}
		cn = "Sluice interception CA " + hex.EncodeToString(suffix)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("certs: create CA: generate key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return fmt.Errorf("certs: create CA: %w", err)
	}
	ski, err := subjectKeyID(&key.PublicKey)
	if err != nil {
		return fmt.Errorf("certs: create CA: %w", err)
	}
	t := now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn, Organization: []string{"Sluice"}},
		NotBefore:             t.Add(-caBackdate),
		NotAfter:              t.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		// The CA signs leaves only, never intermediates.
		MaxPathLen:     0,
		MaxPathLenZero: true,
		SubjectKeyId:   ski,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return fmt.Errorf("certs: create CA: sign certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("certs: create CA: encode key: %w", err)
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})

	// Key first: a certificate without its key is useless, but a lone key
	// left behind by a failure would be confusing; we remove it below.
	if err := createExclusive(keyPath, keyPEM, 0o600); err != nil {
		return fmt.Errorf("certs: create CA: write key: %w", err)
	}
	if err := createExclusive(certPath, certPEM, 0o644); err != nil {
		// We created keyPath a moment ago, so removing it destroys nothing
		// that existed before.
		_ = os.Remove(keyPath)
		return fmt.Errorf("certs: create CA: write certificate: %w", err)
	}
	return nil
}

// LoadOptions tune LoadCAWithOptions. The zero value is the strict default.
type LoadOptions struct {
	// AllowReadableKey accepts a key file that group or others can read. Only
	// for keys that are not secret in the deployment at hand, such as a
	// benchmark harness's throwaway CA written with mode 0644. A key file
	// that group or others can write is refused regardless.
	AllowReadableKey bool
	// Now is the clock for the validity check; nil means time.Now.
	Now func() time.Time
}

// LoadCA loads an interception CA from a PEM certificate file and a PEM key
// file (SEC 1 "EC PRIVATE KEY" or PKCS#8 "PRIVATE KEY"; both may be the same
// combined file). It refuses a key file that group or others can access, a
// key that is not ECDSA P-256, a key that does not match the certificate, and
// a certificate that is not a CA or is outside its validity period.
func LoadCA(certPath, keyPath string) (*CA, error) {
	return LoadCAWithOptions(certPath, keyPath, LoadOptions{})
}

// LoadCAWithOptions is LoadCA with options; see LoadOptions.
func LoadCAWithOptions(certPath, keyPath string, opts LoadOptions) (*CA, error) {
	now := time.Now
	if opts.Now != nil {
		now = opts.Now
	}
	cert, err := ReadCACertificate(certPath, now())
	if err != nil {
		return nil, err
	}
	keyData, err := readBounded(keyPath, true)
	if err != nil {
		var kme *keyModeError
		if !errors.As(err, &kme) || !opts.AllowReadableKey || kme.mode&0o022 != 0 {
			return nil, fmt.Errorf("certs: load CA key: %w", err)
		}
		// Readable but not writable by others, and the caller said that is
		// acceptable: read it without the mode check.
		keyData, err = readBounded(keyPath, false)
		if err != nil {
			return nil, fmt.Errorf("certs: load CA key: %w", err)
		}
	}
	key, err := parseP256Key(keyData)
	if err != nil {
		return nil, fmt.Errorf("certs: load CA key %s: %w", keyPath, err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("certs: load CA: key %s does not match certificate %s", keyPath, certPath)
	}
	return &CA{cert: cert, key: key}, nil
}

// ReadCACertificate reads the first certificate in a PEM file and checks that
// it can serve as sluice's interception CA at time now: a CA certificate
// allowed to sign certificates, with an ECDSA P-256 key, within its validity
// period. It needs no private key, which is what exporting a trust bundle
// wants.
func ReadCACertificate(certPath string, now time.Time) (*x509.Certificate, error) {
	data, err := readBounded(certPath, false)
	if err != nil {
		return nil, fmt.Errorf("certs: read CA certificate: %w", err)
	}
	cert, err := parseFirstCertificate(data)
	if err != nil {
		return nil, fmt.Errorf("certs: read CA certificate %s: %w", certPath, err)
	}
	if err := checkCACertificate(cert, now); err != nil {
		return nil, fmt.Errorf("certs: CA certificate %s: %w", certPath, err)
	}
	return cert, nil
}

func checkCACertificate(cert *x509.Certificate, now time.Time) error {
	if !cert.BasicConstraintsValid || !cert.IsCA {
		return errors.New("not a CA certificate (basic constraints CA:TRUE missing)")
	}
	if cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return errors.New("key usage does not allow signing certificates")
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok {
		return fmt.Errorf("public key is %s, want ECDSA P-256", cert.PublicKeyAlgorithm)
	}
	if pub.Curve != elliptic.P256() {
		return fmt.Errorf("public key is ECDSA %s, want P-256", pub.Curve.Params().Name)
	}
	if now.Before(cert.NotBefore) {
		return fmt.Errorf("not valid before %s", cert.NotBefore.UTC().Format(time.RFC3339))
	}
	if !now.Before(cert.NotAfter) {
		return fmt.Errorf("expired at %s", cert.NotAfter.UTC().Format(time.RFC3339))
	}
	return nil
}

// parseFirstCertificate returns the first CERTIFICATE block of a PEM file,
// skipping other blocks (a combined key+certificate file has the key first).
func parseFirstCertificate(data []byte) (*x509.Certificate, error) {
	rest := data
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errors.New("no PEM CERTIFICATE block found")
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		cert, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		return cert, nil
	}
}

// parseP256Key returns the first private key block of a PEM file, which must
// hold an ECDSA P-256 key. Errors name block types only, never key material.
func parseP256Key(data []byte) (*ecdsa.PrivateKey, error) {
	rest := data
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errors.New("no PEM private key block found (want \"EC PRIVATE KEY\" or \"PRIVATE KEY\")")
		}
		switch b.Type {
		case "CERTIFICATE", "EC PARAMETERS":
			// A combined file, or `openssl ecparam -genkey` output.
			continue
		case "EC PRIVATE KEY":
			k, err := x509.ParseECPrivateKey(b.Bytes)
			if err != nil {
				return nil, errors.New("malformed SEC 1 EC private key")
			}
			return requireP256(k)
		case "PRIVATE KEY":
			k, err := x509.ParsePKCS8PrivateKey(b.Bytes)
			if err != nil {
				return nil, errors.New("malformed PKCS#8 private key")
			}
			ek, ok := k.(*ecdsa.PrivateKey)
			if !ok {
				return nil, fmt.Errorf("PKCS#8 key is %T, want ECDSA P-256", k)
			}
			return requireP256(ek)
		case "ENCRYPTED PRIVATE KEY":
			return nil, errors.New("encrypted private keys are not supported")
		default:
			if strings.HasSuffix(b.Type, "PRIVATE KEY") {
				return nil, fmt.Errorf("PEM block %q is not supported: want an ECDSA P-256 key (\"EC PRIVATE KEY\" or \"PRIVATE KEY\")", b.Type)
			}
			continue
		}
	}
}

func requireP256(k *ecdsa.PrivateKey) (*ecdsa.PrivateKey, error) {
	if k.Curve != elliptic.P256() {
		return nil, fmt.Errorf("ECDSA key on %s, want P-256", k.Curve.Params().Name)
	}
	return k, nil
}

// randomSerial returns a positive random 128-bit serial number. Random serials
// keep certificates unpredictable and unique without any state.
func randomSerial() (*big.Int, error) {
	b := make([]byte, 16)
	for {
		if _, err := rand.Read(b); err != nil {
			return nil, fmt.Errorf("random serial: %w", err)
		}
		n := new(big.Int).SetBytes(b)
		if n.Sign() > 0 {
			return n, nil
		}
	}
}

// subjectKeyID follows RFC 7093 method 1: the leftmost 160 bits of the
// SHA-256 of the subjectPublicKey bit string (the uncompressed EC point).
func subjectKeyID(pub *ecdsa.PublicKey) ([]byte, error) {
	ek, err := pub.ECDH()
	if err != nil {
		return nil, fmt.Errorf("subject key id: %w", err)
	}
	sum := sha256.Sum256(ek.Bytes())
	return sum[:20], nil
}
