package certs

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"golang.org/x/sync/singleflight"
)

const (
	// DefaultLeafCacheMax bounds the leaf cache (rules.CAConfig.LeafCacheMax).
	DefaultLeafCacheMax = 1024
	// DefaultLeafValidity is short on purpose: a leaf that leaks is useless
	// a day later, and re-issuing costs one signature.
	DefaultLeafValidity = 24 * time.Hour

	minLeafValidity = time.Minute
	// maxLeafValidity follows the public-web ceiling of 397 days; clients
	// such as Apple's reject longer-lived server certificates.
	maxLeafValidity = 397 * 24 * time.Hour
	maxLeafCacheMax = 1 << 20
	// leafBackdate tolerates sandboxes whose clock runs a little behind.
	leafBackdate = time.Hour
)

// IssuerOptions tune NewIssuer. The zero value is valid.
type IssuerOptions struct {
	// MaxEntries bounds the number of cached leaves; zero means
	// DefaultLeafCacheMax. The least recently used leaf is evicted first.
	MaxEntries int
	// LeafValidity is the lifetime of a leaf (clamped to the CA's own
	// expiry); zero means DefaultLeafValidity. A cached leaf is renewed once
	// less than a third of its lifetime remains.
	LeafValidity time.Duration
	// Now is the clock; nil means time.Now. Tests move it forward.
	Now func() time.Time
	// Logger receives issuance and rotation events; nil discards them.
	Logger *slog.Logger
}

// IssuerStats are cumulative counters, for metrics.
type IssuerStats struct {
	Issued    uint64 // leaf certificates signed (one CA signature each)
	Hits      uint64 // Certificate calls answered from the cache
	Renewed   uint64 // cached leaves replaced because they were near expiry
	Evicted   uint64 // leaves dropped because the cache was full
	Rotations uint64 // SetCA calls
}

// Issuer issues and caches leaf certificates for intercepted hosts. It is safe
// for concurrent use.
//
// All leaves of one Issuer share one ECDSA P-256 key pair, generated afresh
// for every CA (at NewIssuer and at each SetCA). Per-host keys would buy
// nothing here: the key never leaves this process, each leaf is still signed
// by the CA for exactly one host, and a client trusts a leaf because of that
// signature, not because its key is unique. Sharing the key makes issuing a
// leaf cost one ECDSA signature instead of a key generation plus a signature.
type Issuer struct {
	validity time.Duration
	now      func() time.Time
	log      *slog.Logger

	// mu orders SetCA's swap-and-purge against the insertion of a freshly
	// issued leaf, so that a leaf signed by a retired CA is never cached.
	mu    sync.Mutex
	state atomic.Pointer[issuerState]
	cache *lru.Cache[string, *leafEntry]
	group singleflight.Group

	issued, hits, renewed, evicted, rotations atomic.Uint64
}

// issuerState is everything that changes together on rotation.
type issuerState struct {
	gen     uint64
	ca      *CA
	leafKey *ecdsa.PrivateKey
}

type leafEntry struct {
	gen     uint64
	cert    *tls.Certificate
	renewAt time.Time
}

// NewIssuer returns an Issuer signing with ca.
func NewIssuer(ca *CA, opts IssuerOptions) (*Issuer, error) {
	if ca == nil || ca.cert == nil || ca.key == nil {
		return nil, errors.New("certs: new issuer: no CA")
	}
	maxEntries := opts.MaxEntries
	if maxEntries == 0 {
		maxEntries = DefaultLeafCacheMax
	}
	if maxEntries < 1 || maxEntries > maxLeafCacheMax {
		return nil, fmt.Errorf("certs: new issuer: max cache entries %d is outside [1, %d]", maxEntries, maxLeafCacheMax)
	}
	validity := opts.LeafValidity
	if validity == 0 {
		validity = DefaultLeafValidity
	}
	if validity < minLeafValidity || validity > maxLeafValidity {
		return nil, fmt.Errorf("certs: new issuer: leaf validity %s is outside [%s, %s]", validity, minLeafValidity, maxLeafValidity)
	}
	i := &Issuer{validity: validity, now: opts.Now, log: opts.Logger}
	if i.now == nil {
		i.now = time.Now
	}
	if i.log == nil {
		i.log = slog.New(slog.DiscardHandler)
	}
	cache, err := lru.New[string, *leafEntry](maxEntries)
	if err != nil {
		return nil, fmt.Errorf("certs: new issuer: %w", err)
	}
	i.cache = cache
	st, err := newIssuerState(ca, 1)
	if err != nil {
		return nil, fmt.Errorf("certs: new issuer: %w", err)
	}
	i.state.Store(st)
	i.warnIfExpiring(ca)
	return i, nil
}

// caExpiryWarning is how early an operator hears that the CA needs rotating:
// once it expires, interception fails closed.
const caExpiryWarning = 30 * 24 * time.Hour

func (i *Issuer) warnIfExpiring(ca *CA) {
	if left := ca.cert.NotAfter.Sub(i.now()); left < caExpiryWarning {
		i.log.Warn("certs: interception CA expires soon; rotate it", slog.Any("ca", ca), slog.Duration("remaining", left))
	}
}

func newIssuerState(ca *CA, gen uint64) (*issuerState, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate leaf key: %w", err)
	}
	return &issuerState{gen: gen, ca: ca, leafKey: k}, nil
}

// SetCA switches to a new CA (rotation): later leaves are signed by ca with a
// new leaf key, and every cached leaf is dropped, including any leaf signed by
// the old CA whose issuance is still in flight.
func (i *Issuer) SetCA(ca *CA) error {
	if ca == nil || ca.cert == nil || ca.key == nil {
		return errors.New("certs: set CA: no CA")
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	st, err := newIssuerState(ca, i.state.Load().gen+1)
	if err != nil {
		return fmt.Errorf("certs: set CA: %w", err)
	}
	i.state.Store(st)
	n := i.cache.Len()
	i.cache.Purge()
	i.rotations.Add(1)
	i.log.Info("certs: interception CA rotated", slog.Any("ca", ca), slog.Int("flushed_leaves", n))
	i.warnIfExpiring(ca)
	return nil
}

// CA returns the CA currently signing leaves.
func (i *Issuer) CA() *CA { return i.state.Load().ca }

// Stats returns cumulative counters.
func (i *Issuer) Stats() IssuerStats {
	return IssuerStats{
		Issued:    i.issued.Load(),
		Hits:      i.hits.Load(),
		Renewed:   i.renewed.Load(),
		Evicted:   i.evicted.Load(),
		Rotations: i.rotations.Load(),
	}
}

// Len returns the number of cached leaves.
func (i *Issuer) Len() int { return i.cache.Len() }

// Certificate returns a leaf certificate for host, from the cache when a
// fresh one is there. host is a DNS name or an IP literal, optionally with a
// ":port" (as goproxy passes it), which is ignored; a DNS name becomes a DNS
// SAN, an IP literal an IP SAN. Concurrent calls for the same host share one
// issuance. The chain is [leaf, CA] and Leaf is set. The returned value is
// shared with other callers and the cache: read it, never modify it.
func (i *Issuer) Certificate(ctx context.Context, host string) (*tls.Certificate, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("certs: certificate for %q: %w", host, err)
	}
	name, ip, err := normalizeLeafHost(host)
	if err != nil {
		return nil, fmt.Errorf("certs: certificate for %q: %w", host, err)
	}
	st := i.state.Load()
	now := i.now()
	renewing := false
	if e, ok := i.cache.Get(name); ok && e.gen == st.gen {
		if now.Before(e.renewAt) {
			i.hits.Add(1)
			return e.cert, nil
		}
		renewing = true
	}
	// The flight key carries the CA generation so that a caller arriving
	// after a rotation never joins a flight signing with the retired CA.
	key := strconv.FormatUint(st.gen, 10) + "|" + name
	ch := i.group.DoChan(key, func() (any, error) {
		// Another flight may have stored a fresh leaf since our lookup.
		if e, ok := i.cache.Peek(name); ok && e.gen == st.gen && i.now().Before(e.renewAt) {
			return e.cert, nil
		}
		e, err := i.issue(st, name, ip)
		if err != nil {
			return nil, err
		}
		if renewing {
			i.renewed.Add(1)
		}
		i.mu.Lock()
		if i.state.Load().gen == st.gen && i.cache.Add(name, e) {
			i.evicted.Add(1)
		}
		i.mu.Unlock()
		return e.cert, nil
	})
	select {
	case res := <-ch:
		if res.Err != nil {
			return nil, fmt.Errorf("certs: certificate for %q: %w", name, res.Err)
		}
		return res.Val.(*tls.Certificate), nil
	case <-ctx.Done():
		// The flight carries on and caches its result for the next caller.
		return nil, fmt.Errorf("certs: certificate for %q: %w", name, ctx.Err())
	}
}

// issue signs one leaf for name (a DNS name, or ip when ip is valid).
func (i *Issuer) issue(st *issuerState, name string, ip netip.Addr) (*leafEntry, error) {
	now := i.now()
	caCert := st.ca.cert
	if !now.Before(caCert.NotAfter) {
		return nil, fmt.Errorf("interception CA expired at %s", caCert.NotAfter.UTC().Format(time.RFC3339))
	}
	notBefore := now.Add(-leafBackdate)
	if notBefore.Before(caCert.NotBefore) {
		notBefore = caCert.NotBefore
	}
	notAfter := now.Add(i.validity)
	if notAfter.After(caCert.NotAfter) {
		notAfter = caCert.NotAfter
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"Sluice interception"}},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  false,
	}
	// RFC 5280 caps a CommonName at 64 characters; clients match SANs anyway.
	if len(name) <= 64 {
		tmpl.Subject.CommonName = name
	}
	if ip.IsValid() {
		tmpl.IPAddresses = []net.IP{net.IP(ip.AsSlice())}
	} else {
		tmpl.DNSNames = []string{name}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &st.leafKey.PublicKey, st.ca.key)
	if err != nil {
		return nil, fmt.Errorf("sign leaf: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse leaf: %w", err)
	}
	i.issued.Add(1)
	i.log.Debug("certs: issued leaf", slog.String("host", name), slog.Time("not_after", notAfter))
	// Renew once less than a third of the lifetime remains (measured from
	// issuance, so a leaf clamped to the CA's expiry renews sooner).
	renewAt := notAfter.Add(-notAfter.Sub(now) / 3)
	return &leafEntry{
		gen: st.gen,
		cert: &tls.Certificate{
			Certificate: [][]byte{der, caCert.Raw},
			PrivateKey:  st.leafKey,
			Leaf:        leaf,
		},
		renewAt: renewAt,
	}, nil
}

// ServerConfig returns the TLS configuration for the client side of an
// intercepted tunnel to host (the CONNECT target, not the client's SNI, which
// the proxy checks on its own): the leaf for host, TLS 1.2 or later, and
// HTTP/1.1 only, since the proxy parses HTTP/1.1 inside the tunnel.
func (i *Issuer) ServerConfig(ctx context.Context, host string) (*tls.Config, error) {
	cert, err := i.Certificate(ctx, host)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: []tls.Certificate{*cert},
		MinVersion:   tls.VersionTLS12,
		NextProtos:   []string{"http/1.1"},
	}, nil
}

// normalizeLeafHost turns a CONNECT host (with or without ":port") into the
// cache key and SAN: a lower-case DNS name without a trailing dot, or the
// canonical form of an IP literal. Wildcards, zones and anything that is not a
// plausible host name are refused, so the CA never signs what it should not.
func normalizeLeafHost(host string) (string, netip.Addr, error) {
	h := host
	if hh, port, err := net.SplitHostPort(host); err == nil {
		p, perr := strconv.Atoi(port)
		if perr != nil || p < 1 || p > 65535 {
			return "", netip.Addr{}, fmt.Errorf("invalid port %q", port)
		}
		h = hh
	} else if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		h = h[1 : len(h)-1]
	}
	if h == "" {
		return "", netip.Addr{}, errors.New("empty host")
	}
	if strings.ContainsAny(h, ":%") || isDigitsAndDots(h) {
		ip, err := netip.ParseAddr(h)
		if err != nil {
			return "", netip.Addr{}, fmt.Errorf("invalid IP literal: %w", err)
		}
		if ip.Zone() != "" {
			return "", netip.Addr{}, errors.New("IP literal with a zone is not allowed")
		}
		return ip.String(), ip, nil
	}
	h = strings.ToLower(strings.TrimSuffix(h, "."))
	if err := checkDNSName(h); err != nil {
		return "", netip.Addr{}, err
	}
	return h, netip.Addr{}, nil
}

func isDigitsAndDots(s string) bool {
	for i := 0; i < len(s); i++ {
		if (s[i] < '0' || s[i] > '9') && s[i] != '.' {
			return false
		}
	}
	return true
}

// checkDNSName accepts an ASCII (already IDNA-encoded) host name of letters,
// digits, '-' and '_' (seen in real service names), in labels of 1 to 63
// octets that do not start with '-', at most 253 octets in all. A trailing
// '-' is tolerated because real sites use it.
func checkDNSName(h string) error {
	if len(h) > 253 {
		return fmt.Errorf("host name is %d octets, longer than 253", len(h))
	}
	if strings.Contains(h, "*") {
		return errors.New("wildcard host names are not issued")
	}
	for label := range strings.SplitSeq(h, ".") {
		if label == "" {
			return errors.New("host name has an empty label")
		}
		if len(label) > 63 {
			return errors.New("host name has a label longer than 63 octets")
		}
		if label[0] == '-' {
			return errors.New("host name has a label that starts with '-'")
		}
		for j := 0; j < len(label); j++ {
			c := label[j]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Errorf("host name has an invalid character %q (want ASCII letters, digits, '-', '_'; IDNA-encode first)", c)
			}
		}
	}
	return nil
}
