package certs

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
)

// SystemRootFiles returns the usual locations of the system's PEM root bundle
// on Linux distributions, in the order they are tried (the same list Go's
// crypto/x509 uses).
func SystemRootFiles() []string {
	return []string{
		"/etc/ssl/certs/ca-certificates.crt",                // Debian, Ubuntu, Gentoo, Arch
		"/etc/pki/tls/certs/ca-bundle.crt",                  // Fedora, RHEL 6
		"/etc/ssl/ca-bundle.pem",                            // openSUSE
		"/etc/pki/tls/cacert.pem",                           // OpenELEC
		"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", // CentOS, RHEL 7
		"/etc/ssl/cert.pem",                                 // Alpine
	}
}

// WriteBundle writes the trust bundle a sandbox installs: the system roots
// (from the first file of SystemRootFiles that exists) followed by the CA's
// certificate, as one PEM file. It fails if no system bundle is found, since a
// bundle with only sluice's CA would silently break every spliced tunnel.
func WriteBundle(w io.Writer, ca *CA) error {
	if ca == nil || ca.cert == nil {
		return errors.New("certs: write bundle: no CA")
	}
	return WriteTrustBundle(w, ca.cert, SystemRootFiles())
}

// WriteTrustBundle writes the certificates of the first readable file among
// rootFiles, then caCert, as PEM. Only CERTIFICATE blocks are copied, each
// re-encoded after it parses, so stray text, headers or a key that found its
// way into a root file never reach a sandbox. caCert is not repeated if the
// system bundle already holds it.
func WriteTrustBundle(w io.Writer, caCert *x509.Certificate, rootFiles []string) error {
	if caCert == nil {
		return errors.New("certs: write bundle: no CA certificate")
	}
	var (
		data []byte
		src  string
	)
	for _, p := range rootFiles {
		b, err := readBounded(p, false)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("certs: write bundle: read system roots: %w", err)
		}
		data, src = b, p
		break
	}
	if src == "" {
		return fmt.Errorf("certs: write bundle: no system root bundle found (tried %d locations)", len(rootFiles))
	}
	var out bytes.Buffer
	n := 0
	haveCA := false
	for rest := data; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		if _, err := x509.ParseCertificate(b.Bytes); err != nil {
			// Go's own root loading skips unparsable entries too.
			continue
		}
		if bytes.Equal(b.Bytes, caCert.Raw) {
			haveCA = true
		}
		if err := pem.Encode(&out, &pem.Block{Type: "CERTIFICATE", Bytes: b.Bytes}); err != nil {
			return fmt.Errorf("certs: write bundle: %w", err)
		}
		n++
	}
	if n == 0 {
		return fmt.Errorf("certs: write bundle: %s holds no certificates", src)
	}
	if !haveCA {
		if err := pem.Encode(&out, &pem.Block{Type: "CERTIFICATE", Bytes: caCert.Raw}); err != nil {
			return fmt.Errorf("certs: write bundle: %w", err)
		}
	}
	if _, err := w.Write(out.Bytes()); err != nil {
		return fmt.Errorf("certs: write bundle: %w", err)
	}
	return nil
}
