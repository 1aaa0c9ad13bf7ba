package certs

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// verifyLeaf issues a leaf for host and checks that it chains to ca for
// dnsName (the name a client would verify).
func verifyLeaf(t *testing.T, iss *Issuer, ca *CA, host, dnsName string) *tls.Certificate {
	t.Helper()
	cert, err := iss.Certificate(context.Background(), host)
	if err != nil {
		t.Fatalf("Certificate(%q): %v", host, err)
	}
	if _, err := cert.Leaf.Verify(verifyOpts(ca, dnsName, time.Time{})); err != nil {
		t.Fatalf("leaf for %q does not verify as %q: %v", host, dnsName, err)
	}
	return cert
}

func verifyOpts(ca *CA, dnsName string, at time.Time) x509.VerifyOptions {
	roots := x509.NewCertPool()
	roots.AddCert(ca.Certificate())
	return x509.VerifyOptions{Roots: roots, DNSName: dnsName, CurrentTime: at, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
}

func TestLeafDNSName(t *testing.T) {
	clock := newFakeClock()
	ca, _, _ := newTestCA(t, CAOptions{Now: clock.Now})
	iss, err := NewIssuer(ca, IssuerOptions{Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := iss.Certificate(context.Background(), "API.Example.COM.")
	if err != nil {
		t.Fatal(err)
	}
	leaf := cert.Leaf
	if leaf == nil {
		t.Fatal("Leaf not set")
	}
	if len(cert.Certificate) != 2 || string(cert.Certificate[1]) != string(ca.Certificate().Raw) {
		t.Fatal("chain is not [leaf, CA]")
	}
	if string(cert.Certificate[0]) != string(leaf.Raw) {
		t.Fatal("Leaf is not the first certificate of the chain")
	}
	if len(leaf.DNSNames) != 1 || leaf.DNSNames[0] != "api.example.com" || len(leaf.IPAddresses) != 0 {
		t.Errorf("SANs = %v %v, want DNS api.example.com only", leaf.DNSNames, leaf.IPAddresses)
	}
	if leaf.IsCA {
		t.Error("leaf is a CA")
	}
	if leaf.KeyUsage != x509.KeyUsageDigitalSignature || len(leaf.ExtKeyUsage) != 1 || leaf.ExtKeyUsage[0] != x509.ExtKeyUsageServerAuth {
		t.Errorf("key usage %v / %v, want DigitalSignature / ServerAuth", leaf.KeyUsage, leaf.ExtKeyUsage)
	}
	if got := leaf.NotAfter.Sub(clock.Now()); got != DefaultLeafValidity {
		t.Errorf("leaf validity from now = %s, want %s", got, DefaultLeafValidity)
	}
	if got := clock.Now().Sub(leaf.NotBefore); got != leafBackdate {
		t.Errorf("leaf backdated by %s, want %s", got, leafBackdate)
	}
	if string(leaf.AuthorityKeyId) != string(ca.Certificate().SubjectKeyId) {
		t.Error("AuthorityKeyId does not name the CA")
	}
	if _, err := leaf.Verify(verifyOpts(ca, "api.example.com", clock.Now())); err != nil {
		t.Errorf("leaf does not verify for its host: %v", err)
	}
	for _, other := range []string{"example.com", "evil.example.com", "x.api.example.com", "api.example.org", "127.0.0.1"} {
		if _, err := leaf.Verify(verifyOpts(ca, other, clock.Now())); err == nil {
			t.Errorf("leaf for api.example.com verifies for %q", other)
		}
	}
	// Another CA does not vouch for it.
	other, _, _ := newTestCA(t, CAOptions{Now: clock.Now})
	if _, err := leaf.Verify(verifyOpts(other, "api.example.com", clock.Now())); err == nil {
		t.Error("leaf verifies against an unrelated CA")
	}
	// Outside its validity, it does not verify.
	if _, err := leaf.Verify(verifyOpts(ca, "api.example.com", clock.Now().Add(DefaultLeafValidity+time.Second))); err == nil {
		t.Error("leaf verifies after its expiry")
	}
	// The same host in other spellings hits the same cache entry.
	for _, h := range []string{"api.example.com", "api.example.com:443", "API.EXAMPLE.COM"} {
		c2, err := iss.Certificate(context.Background(), h)
		if err != nil {
			t.Fatal(err)
		}
		if c2 != cert {
			t.Errorf("%q did not hit the cached leaf", h)
		}
	}
	if s := iss.Stats(); s.Issued != 1 || s.Hits != 3 {
		t.Errorf("stats = %+v, want 1 issued, 3 hits", s)
	}
}

func TestLeafIPLiteral(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v4 := verifyLeaf(t, iss, ca, "127.0.0.1:443", "127.0.0.1")
	if len(v4.Leaf.IPAddresses) != 1 || !v4.Leaf.IPAddresses[0].Equal(net.ParseIP("127.0.0.1")) || len(v4.Leaf.DNSNames) != 0 {
		t.Errorf("SANs = %v %v, want IP 127.0.0.1 only", v4.Leaf.DNSNames, v4.Leaf.IPAddresses)
	}
	if _, err := v4.Leaf.Verify(verifyOpts(ca, "127.0.0.2", time.Time{})); err == nil {
		t.Error("leaf for 127.0.0.1 verifies for 127.0.0.2")
	}
	v6 := verifyLeaf(t, iss, ca, "[::1]:8443", "::1")
	if len(v6.Leaf.IPAddresses) != 1 || !v6.Leaf.IPAddresses[0].Equal(net.IPv6loopback) {
		t.Errorf("IP SANs = %v, want ::1", v6.Leaf.IPAddresses)
	}
	for _, h := range []string{"::1", "[::1]", "0:0:0:0:0:0:0:1"} {
		c, err := iss.Certificate(context.Background(), h)
		if err != nil {
			t.Fatal(err)
		}
		if c != v6 {
			t.Errorf("%q did not hit the cached ::1 leaf", h)
		}
	}
	if _, err := v6.Leaf.Verify(verifyOpts(ca, "localhost", time.Time{})); err == nil {
		t.Error("IP leaf verifies for a DNS name")
	}
}

func TestHostValidation(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bad := []string{
		"", ".", "*.example.com", "*", "exa mple.com", "a..b", "-", "ex/ample.com",
		strings.Repeat("a", 64) + ".com",
		strings.Repeat("abcdefghi.", 26) + "com",
		"fe80::1%eth0", "[fe80::1%25eth0]:443", "example.com:0", "example.com:http", "example.com:70000",
		"bücher.example", "-leading.example", "a.-b.example", "1.2.3.4.5", "256.1.1.1", "example.com\x00.evil", "host:1:2",
	}
	for _, h := range bad {
		if c, err := iss.Certificate(context.Background(), h); err == nil {
			t.Errorf("Certificate(%q) issued %v, want an error", h, c.Leaf.DNSNames)
		}
	}
	if s := iss.Stats(); s.Issued != 0 {
		t.Errorf("%d leaves issued for invalid hosts", s.Issued)
	}
	for _, h := range []string{"localhost", "a-b_c.example", "trailing-.example", "xn--bcher-kva.example", strings.Repeat("a", 63) + ".com", "10.0.0.1"} {
		if _, err := iss.Certificate(context.Background(), h); err != nil {
			t.Errorf("Certificate(%q): %v", h, err)
		}
	}
}

func TestNewIssuerOptions(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	if _, err := NewIssuer(nil, IssuerOptions{}); err == nil {
		t.Error("nil CA: no error")
	}
	for _, o := range []IssuerOptions{{MaxEntries: -1}, {LeafValidity: time.Second}, {LeafValidity: -time.Hour}, {LeafValidity: 398 * 24 * time.Hour}} {
		if _, err := NewIssuer(ca, o); err == nil {
			t.Errorf("options %+v: no error", o)
		}
	}
	iss, err := NewIssuer(ca, IssuerOptions{LeafValidity: 2 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	c, err := iss.Certificate(context.Background(), "example.com")
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Leaf.NotAfter.Sub(c.Leaf.NotBefore); got != 2*time.Hour+leafBackdate {
		t.Errorf("leaf span = %s, want 2h + backdate", got)
	}
	if err := iss.SetCA(nil); err == nil {
		t.Error("SetCA(nil): no error")
	}
}

func TestConcurrentIssuanceOnce(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	const n = 64
	results := make([]*tls.Certificate, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for k := range n {
		wg.Go(func() {
			<-start
			results[k], errs[k] = iss.Certificate(context.Background(), "burst.example.com")
		})
	}
	close(start)
	wg.Wait()
	for k := range n {
		if errs[k] != nil {
			t.Fatalf("caller %d: %v", k, errs[k])
		}
		if results[k] != results[0] {
			t.Fatalf("caller %d got a different certificate", k)
		}
	}
	if got := iss.Stats().Issued; got != 1 {
		t.Fatalf("%d concurrent callers caused %d signatures, want 1", n, got)
	}

	// Many hosts at once: one signature per host, no more.
	const hosts = 16
	for k := range n {
		wg.Go(func() {
			if _, err := iss.Certificate(context.Background(), fmt.Sprintf("h%d.example.com", k%hosts)); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if got := iss.Stats().Issued; got != 1+hosts {
		t.Fatalf("issued %d, want %d", got, 1+hosts)
	}
}

func TestLRUBound(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{MaxEntries: 4})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for k := range 10 {
		if _, err := iss.Certificate(ctx, fmt.Sprintf("h%d.example", k)); err != nil {
			t.Fatal(err)
		}
	}
	if iss.Len() != 4 {
		t.Fatalf("cache holds %d leaves, want 4", iss.Len())
	}
	if s := iss.Stats(); s.Issued != 10 || s.Evicted != 6 {
		t.Fatalf("stats %+v, want 10 issued, 6 evicted", s)
	}
	// The most recent four are cached; the oldest was evicted.
	if _, err := iss.Certificate(ctx, "h9.example"); err != nil {
		t.Fatal(err)
	}
	if s := iss.Stats(); s.Issued != 10 || s.Hits != 1 {
		t.Fatalf("recent host not served from cache: %+v", s)
	}
	if _, err := iss.Certificate(ctx, "h0.example"); err != nil {
		t.Fatal(err)
	}
	if s := iss.Stats(); s.Issued != 11 {
		t.Fatalf("evicted host not re-issued: %+v", s)
	}
	// Using h6 makes it recent, so the next insert evicts h7 instead.
	if _, err := iss.Certificate(ctx, "h6.example"); err != nil {
		t.Fatal(err)
	}
	if _, err := iss.Certificate(ctx, "h10.example"); err != nil {
		t.Fatal(err)
	}
	before := iss.Stats().Issued
	if _, err := iss.Certificate(ctx, "h6.example"); err != nil {
		t.Fatal(err)
	}
	if iss.Stats().Issued != before {
		t.Error("recently used h6 was evicted")
	}
	if _, err := iss.Certificate(ctx, "h7.example"); err != nil {
		t.Fatal(err)
	}
	if iss.Stats().Issued != before+1 {
		t.Error("least recently used h7 was not evicted")
	}
}

func TestRenewalNearExpiry(t *testing.T) {
	clock := newFakeClock()
	ca, _, _ := newTestCA(t, CAOptions{Now: clock.Now})
	iss, err := NewIssuer(ca, IssuerOptions{Now: clock.Now, LeafValidity: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	first, err := iss.Certificate(ctx, "renew.example")
	if err != nil {
		t.Fatal(err)
	}
	// 9h left (more than a third of 24h): still served from the cache.
	clock.Advance(15 * time.Hour)
	c, err := iss.Certificate(ctx, "renew.example")
	if err != nil {
		t.Fatal(err)
	}
	if c != first {
		t.Fatal("leaf renewed while more than a third of its life remained")
	}
	// Less than 8h left: renewed, and the new leaf is valid for 24h from now.
	clock.Advance(time.Hour + time.Second)
	c, err = iss.Certificate(ctx, "renew.example")
	if err != nil {
		t.Fatal(err)
	}
	if c == first || c.Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 {
		t.Fatal("leaf not renewed with less than a third of its life left")
	}
	if got := c.Leaf.NotAfter.Sub(clock.Now()); got != 24*time.Hour {
		t.Errorf("renewed leaf valid for %s from now, want 24h", got)
	}
	if _, err := c.Leaf.Verify(verifyOpts(ca, "renew.example", clock.Now())); err != nil {
		t.Errorf("renewed leaf does not verify: %v", err)
	}
	if s := iss.Stats(); s.Issued != 2 || s.Renewed != 1 || iss.Len() != 1 {
		t.Errorf("stats %+v len %d, want 2 issued, 1 renewed, 1 cached", s, iss.Len())
	}
	// The renewed leaf is cached in turn.
	again, _ := iss.Certificate(ctx, "renew.example")
	if again != c {
		t.Error("renewed leaf not cached")
	}
}

func TestLeafClampedToCAExpiry(t *testing.T) {
	clock := newFakeClock()
	ca, _, _ := newTestCA(t, CAOptions{Now: clock.Now, Validity: 3 * time.Hour})
	var logs bytes.Buffer
	iss, err := NewIssuer(ca, IssuerOptions{Now: clock.Now, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "expires soon") {
		t.Errorf("no warning for a CA with 3h left; log: %q", logs.String())
	}
	c, err := iss.Certificate(context.Background(), "clamp.example")
	if err != nil {
		t.Fatal(err)
	}
	if !c.Leaf.NotAfter.Equal(ca.Certificate().NotAfter) {
		t.Errorf("leaf NotAfter %s, want the CA's %s", c.Leaf.NotAfter, ca.Certificate().NotAfter)
	}
	if c.Leaf.NotBefore.Before(ca.Certificate().NotBefore) {
		t.Error("leaf valid before its CA")
	}
	// Renewal is measured on the clamped lifetime (3h): after 2h+1s it renews.
	clock.Advance(2*time.Hour + time.Second)
	c2, err := iss.Certificate(context.Background(), "clamp.example")
	if err != nil {
		t.Fatal(err)
	}
	if c2 == c {
		t.Error("clamped leaf not renewed after two thirds of its lifetime")
	}
	// Once the CA has expired, nothing is issued: fail closed.
	clock.Advance(time.Hour)
	if _, err := iss.Certificate(context.Background(), "new.example"); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Errorf("issuance with an expired CA: err = %v", err)
	}
}

func TestSetCAFlushesCache(t *testing.T) {
	ca1, _, _ := newTestCA(t, CAOptions{})
	ca2, _, _ := newTestCA(t, CAOptions{})
	var logs bytes.Buffer
	iss, err := NewIssuer(ca1, IssuerOptions{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	old := verifyLeaf(t, iss, ca1, "rotate.example", "rotate.example")
	verifyLeaf(t, iss, ca1, "other.example", "other.example")
	if err := iss.SetCA(ca2); err != nil {
		t.Fatal(err)
	}
	if iss.Len() != 0 {
		t.Fatalf("cache holds %d leaves after rotation", iss.Len())
	}
	if !strings.Contains(logs.String(), "rotated") || !strings.Contains(logs.String(), ca2.Fingerprint()) || strings.Contains(logs.String(), "expires soon") {
		t.Errorf("rotation log %q: want the new CA's fingerprint and no expiry warning for a 5-year CA", logs.String())
	}
	if iss.CA() != ca2 {
		t.Fatal("CA() is not the new CA")
	}
	c := verifyLeaf(t, iss, ca2, "rotate.example", "rotate.example")
	if c == old {
		t.Fatal("old leaf served after rotation")
	}
	if _, err := c.Leaf.Verify(verifyOpts(ca1, "rotate.example", time.Time{})); err == nil {
		t.Error("new leaf chains to the retired CA")
	}
	if string(c.Certificate[1]) != string(ca2.Certificate().Raw) {
		t.Error("chain carries the retired CA")
	}
	if old.Leaf.PublicKeyAlgorithm == c.Leaf.PublicKeyAlgorithm && string(publicKeyDER(t, old.Leaf)) == string(publicKeyDER(t, c.Leaf)) {
		t.Error("leaf key not replaced on rotation")
	}
	if s := iss.Stats(); s.Rotations != 1 || s.Evicted != 0 || s.Issued != 3 {
		t.Errorf("stats %+v, want 1 rotation, 0 evictions, 3 issued", s)
	}
}

func publicKeyDER(t *testing.T, c *x509.Certificate) []byte {
	t.Helper()
	b, err := x509.MarshalPKIXPublicKey(c.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSetCADuringIssuance rotates while many hosts are being issued: every
// leaf that is cached or returned after the rotation must chain to the new CA.
func TestSetCADuringIssuance(t *testing.T) {
	ca1, _, _ := newTestCA(t, CAOptions{})
	ca2, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca1, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for k := range 200 {
		wg.Go(func() {
			if _, err := iss.Certificate(context.Background(), fmt.Sprintf("r%d.example", k%50)); err != nil {
				t.Error(err)
			}
		})
		if k == 100 {
			if err := iss.SetCA(ca2); err != nil {
				t.Fatal(err)
			}
		}
	}
	wg.Wait()
	for k := range 50 {
		verifyLeaf(t, iss, ca2, fmt.Sprintf("r%d.example", k), fmt.Sprintf("r%d.example", k))
	}
}

func TestCertificateContext(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := iss.Certificate(ctx, "example.com"); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if _, err := iss.ServerConfig(ctx, "example.com"); !errors.Is(err, context.Canceled) {
		t.Fatalf("ServerConfig err = %v, want context.Canceled", err)
	}
}

// TestServerConfigHandshake runs real HTTPS on 127.0.0.1: a server using
// ServerConfig for a CONNECT host, and clients that trust only the CA.
func TestServerConfigHandshake(t *testing.T) {
	ca, _, _ := newTestCA(t, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, tc := range []struct{ connectHost, serverName string }{
		{"api.sluice-test.example:443", "api.sluice-test.example"},
		{"127.0.0.1:443", "127.0.0.1"},
	} {
		t.Run(tc.serverName, func(t *testing.T) {
			cfg, err := iss.ServerConfig(ctx, tc.connectHost)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.MinVersion != tls.VersionTLS12 || len(cfg.NextProtos) != 1 || cfg.NextProtos[0] != "http/1.1" {
				t.Fatalf("config: min version %x, ALPN %v", cfg.MinVersion, cfg.NextProtos)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			srv := &http.Server{
				Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					fmt.Fprintf(w, "%s %d", r.Proto, r.TLS.Version)
				}),
				TLSConfig:         cfg,
				ReadHeaderTimeout: 5 * time.Second,
				ErrorLog:          log.New(io.Discard, "", 0), // refused handshakes are expected below
			}
			go srv.ServeTLS(ln, "", "")
			t.Cleanup(func() { srv.Close() })
			addr := ln.Addr().String()

			client := func(serverName string, tweak func(*tls.Config)) (*http.Client, *tls.Config) {
				roots := x509.NewCertPool()
				roots.AddCert(ca.Certificate())
				tc := &tls.Config{RootCAs: roots, ServerName: serverName, NextProtos: []string{"h2", "http/1.1"}}
				if tweak != nil {
					tweak(tc)
				}
				tr := &http.Transport{
					TLSClientConfig:   tc,
					ForceAttemptHTTP2: true,
					DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
						return (&net.Dialer{}).DialContext(ctx, network, addr)
					},
				}
				t.Cleanup(tr.CloseIdleConnections)
				return &http.Client{Transport: tr, Timeout: 5 * time.Second}, tc
			}

			// A client that trusts only the CA completes the handshake, gets
			// HTTP/1.1 (even though it offers h2) and TLS 1.2 or later.
			c, _ := client(tc.serverName, nil)
			resp, err := c.Get("https://" + net.JoinHostPort(tc.serverName, "443") + "/")
			if err != nil {
				t.Fatalf("GET through the intercepting server: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.TLS == nil || resp.TLS.NegotiatedProtocol != "http/1.1" || resp.ProtoMajor != 1 {
				t.Errorf("negotiated %q, proto %s, want http/1.1", resp.TLS.NegotiatedProtocol, resp.Proto)
			}
			if resp.TLS.Version < tls.VersionTLS12 || !strings.HasPrefix(string(body), "HTTP/1.1 ") {
				t.Errorf("TLS version %x, body %q", resp.TLS.Version, body)
			}
			if len(resp.TLS.VerifiedChains) != 1 || len(resp.TLS.VerifiedChains[0]) != 2 {
				t.Errorf("verified chain length unexpected: %v", resp.TLS.VerifiedChains)
			}

			// A client expecting another host refuses the leaf.
			c, _ = client("other.example", nil)
			if _, err := c.Get("https://other.example/"); err == nil {
				t.Error("client verifying another host accepted the leaf")
			}
			// A client that does not trust the CA refuses it.
			c, _ = client(tc.serverName, func(tc *tls.Config) { tc.RootCAs = x509.NewCertPool() })
			if _, err := c.Get("https://" + net.JoinHostPort(tc.serverName, "443") + "/"); err == nil {
				t.Error("client without the CA accepted the leaf")
			}
			// TLS 1.1 is refused.
			c, _ = client(tc.serverName, func(tc *tls.Config) { tc.MaxVersion = tls.VersionTLS11 })
			if _, err := c.Get("https://" + net.JoinHostPort(tc.serverName, "443") + "/"); err == nil {
				t.Error("TLS 1.1 handshake succeeded")
			}
		})
	}
}
