package identity

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"hash"
	"sort"
	"sync"
	"time"

	"github.com/sluicehq/sluice/rules"
)

// Principal kinds.
const (
	KindStatic = "static"
	KindToken  = "token"
)

// StaticSandboxPrefix prefixes Principal.Sandbox for static credentials.
const StaticSandboxPrefix = "static:"

// Principal is an authenticated sandbox: the tenant whose policy applies and
// which sandbox (or static credential) is speaking.
type Principal struct {
	Tenant         string
	Sandbox        string    // sandbox id; "static:<credential name>" for a static credential
	Expiry         time.Time // zero for a static credential
	Kind           string    // KindStatic or KindToken
	CredentialName string    // static credentials only
	TokenID        string    // tokens only
}

// Authentication failures. Every error Authenticate returns matches exactly one
// of these with errors.Is; the proxy answers all of them with 407. Messages name
// the kind of failure, never the credential.
var (
	ErrMissing        = errors.New("identity: no proxy credentials")
	ErrMalformed      = errors.New("identity: malformed proxy credentials")
	ErrUnknown        = errors.New("identity: unknown tenant or credential")
	ErrExpired        = errors.New("identity: token expired")
	ErrRevoked        = errors.New("identity: token revoked")
	ErrTenantMismatch = errors.New("identity: token was minted for another tenant")
)

var (
	errNotBasic  = fmt.Errorf("%w: scheme is not Basic", ErrMalformed)
	errTooLong   = fmt.Errorf("%w: header too long", ErrMalformed)
	errBase64    = fmt.Errorf("%w: credentials are not valid base64", ErrMalformed)
	errNoColon   = fmt.Errorf("%w: credentials have no user:password separator", ErrMalformed)
	errEmptyUser = fmt.Errorf("%w: empty user", ErrMalformed)
	errNoKey     = fmt.Errorf("%w: tokens are not accepted (no token key configured)", ErrUnknown)
)

// maxDecoded bounds the decoded "user:password": a tenant id, a colon and the
// longest password we accept.
const maxDecoded = MaxIDLen + 1 + max(MaxSecretLen, maxTokenLength)

type staticCred struct {
	name    string
	sandbox string // StaticSandboxPrefix + name, precomputed so success does not allocate
	sum     [sha256.Size]byte
}

// macState is an HMAC-SHA256 keyed with the token key plus a scratch buffer.
// The token is copied into buf before hashing because anything passed to a
// hash.Hash (an interface) escapes, which would move the request's decode
// buffer to the heap.
type macState struct {
	h   hash.Hash
	buf []byte
	sum [sha256.Size]byte
}

type tenantCreds struct {
	id    string
	creds []staticCred
}

// Authenticator checks proxy credentials against one policy generation. It is
// immutable once built and safe for concurrent use; build a new one on every
// policy reload.
type Authenticator struct {
	tenants map[string]*tenantCreds
	hasKey  bool
	macs    sync.Pool // of *macState, to avoid allocating an HMAC per request
	revoked map[string]struct{}
	dummy   [sha256.Size]byte
}

// CredentialsFromTenants returns the credentials map NewAuthenticator wants, with
// an entry for every tenant (tenants without static credentials included, so
// tokens minted for them are accepted).
func CredentialsFromTenants(tenants []rules.TenantSpec) map[string][]rules.CredentialSpec {
	m := make(map[string][]rules.CredentialSpec, len(tenants))
	for _, t := range tenants {
		m[t.ID] = t.Credentials
	}
	return m
}

// NewAuthenticator builds an Authenticator. creds maps every tenant id to its
// static credentials (possibly none): a token is only accepted for a tenant
// present in creds. key may be nil, in which case every token is refused.
// revoked lists sandbox ids and token ids whose tokens are refused; it applies to
// every tenant, and a "static:<name>" entry revokes that static credential in
// every tenant.
//
// It refuses invalid tenant ids, unnamed or duplicate credentials, malformed
// hashes, and the same hash in two places (one secret must not unlock two
// credentials or two tenants).
func NewAuthenticator(creds map[string][]rules.CredentialSpec, key *Key, revoked []string) (*Authenticator, error) {
	a := &Authenticator{
		tenants: make(map[string]*tenantCreds, len(creds)),
		revoked: make(map[string]struct{}, len(revoked)),
	}
	// Iterate in a fixed order so errors are deterministic.
	ids := make([]string, 0, len(creds))
	for id := range creds {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	seen := make(map[[sha256.Size]byte]string)
	for _, id := range ids {
		if !ValidID(id) {
			return nil, fmt.Errorf("identity: tenant id %q is not valid (1-%d characters of A-Z a-z 0-9 . _ -)", id, MaxIDLen)
		}
		tc := &tenantCreds{id: id}
		names := make(map[string]bool)
		for i, c := range creds[id] {
			if c.Name == "" {
				return nil, fmt.Errorf("identity: tenant %q: credentials[%d]: name is empty", id, i)
			}
			if names[c.Name] {
				return nil, fmt.Errorf("identity: tenant %q: credentials[%d]: duplicate credential name %q", id, i, c.Name)
			}
			names[c.Name] = true
			sum, err := parseHash(c.Hash)
			if err != nil {
				return nil, fmt.Errorf("identity: tenant %q: credential %q: %w", id, c.Name, err)
			}
			where := fmt.Sprintf("tenant %q credential %q", id, c.Name)
			if prev, dup := seen[sum]; dup {
				return nil, fmt.Errorf("identity: %s has the same hash as %s; give each credential its own secret", where, prev)
			}
			seen[sum] = where
			tc.creds = append(tc.creds, staticCred{name: c.Name, sandbox: StaticSandboxPrefix + c.Name, sum: sum})
		}
		a.tenants[id] = tc
	}
	for i, r := range revoked {
		if r == "" {
			return nil, fmt.Errorf("identity: revoked[%d] is empty", i)
		}
		a.revoked[r] = struct{}{}
	}
	if key != nil {
		if key.isZero() {
			return nil, errors.New("identity: token key is all zeros (not loaded?)")
		}
		a.hasKey = true
		k := key.b // copy: the caller's Key may be reused or zeroed
		a.macs.New = func() any {
			return &macState{h: hmac.New(sha256.New, k[:]), buf: make([]byte, 0, maxTokenLength)}
		}
	}
	// The dummy hash is compared against when the tenant is unknown or has no
	// static credentials, so that such a lookup costs about as much as a real one.
	a.dummy = sha256.Sum256([]byte("sluice identity dummy credential"))
	return a, nil
}

// Authenticate checks a raw Proxy-Authorization header value at time now.
// The error, if any, matches one of ErrMissing, ErrMalformed, ErrUnknown,
// ErrExpired, ErrRevoked or ErrTenantMismatch.
func (a *Authenticator) Authenticate(header string, now time.Time) (Principal, error) {
	if header == "" {
		return Principal{}, ErrMissing
	}
	if len(header) > len("Basic ")+base64.StdEncoding.EncodedLen(maxDecoded)+16 {
		return Principal{}, errTooLong
	}
	// RFC 7617: the scheme is case-insensitive, followed by one or more spaces.
	if len(header) < 6 || !asciiEqualFold(header[:5], "basic") || header[5] != ' ' {
		return Principal{}, errNotBasic
	}
	enc := header[6:]
	for len(enc) > 0 && enc[0] == ' ' {
		enc = enc[1:]
	}
	for len(enc) > 0 && enc[len(enc)-1] == ' ' {
		enc = enc[:len(enc)-1]
	}
	var buf [maxDecoded + 3]byte
	if base64.StdEncoding.DecodedLen(len(enc)) > len(buf) {
		return Principal{}, errTooLong
	}
	n, err := base64.StdEncoding.Decode(buf[:], []byte(enc))
	if err != nil {
		return Principal{}, errBase64
	}
	dec := buf[:n]
	colon := bytes.IndexByte(dec, ':')
	if colon < 0 {
		return Principal{}, errNoColon
	}
	user, pass := dec[:colon], dec[colon+1:]
	if len(user) == 0 {
		return Principal{}, errEmptyUser
	}
	if bytes.HasPrefix(pass, []byte(tokenPrefix)) {
		return a.authToken(user, pass, now)
	}
	return a.authStatic(user, pass)
}

func (a *Authenticator) authStatic(user, pass []byte) (Principal, error) {
	sum := sha256.Sum256(pass)
	tc := a.tenants[string(user)] // no allocation: the compiler special-cases map[string(b)]
	if tc == nil || len(tc.creds) == 0 {
		subtle.ConstantTimeCompare(sum[:], a.dummy[:])
		return Principal{}, ErrUnknown
	}
	// Visit every credential whatever matches, so the time taken does not depend
	// on which one (if any) was right.
	match := -1
	for i := range tc.creds {
		if subtle.ConstantTimeCompare(sum[:], tc.creds[i].sum[:]) == 1 {
			match = i
		}
	}
	if match < 0 {
		return Principal{}, ErrUnknown
	}
	c := &tc.creds[match]
	if _, ok := a.revoked[c.sandbox]; ok {
		return Principal{}, ErrRevoked
	}
	return Principal{Tenant: tc.id, Sandbox: c.sandbox, Kind: KindStatic, CredentialName: c.name}, nil
}

func (a *Authenticator) authToken(user, tok []byte, now time.Time) (Principal, error) {
	signed, payload, mac, err := splitToken(tok)
	if err != nil {
		return Principal{}, err
	}
	if !a.hasKey {
		return Principal{}, errNoKey
	}
	var got, want [sha256.Size]byte
	if n, err := base64.RawURLEncoding.Decode(got[:], mac); err != nil || n != sha256.Size {
		return Principal{}, errTokenSyntax
	}
	ms := a.macs.Get().(*macState)
	ms.buf = append(ms.buf[:0], signed...)
	computeMAC(ms.h, ms.buf, &ms.sum)
	want = ms.sum
	a.macs.Put(ms)
	if !hmac.Equal(got[:], want[:]) {
		return Principal{}, errTokenMAC
	}
	var pbuf [maxPayloadLen]byte
	c, err := parsePayload(payload, &pbuf)
	if err != nil {
		return Principal{}, err
	}
	if !bytes.Equal(c.tenant, user) {
		return Principal{}, ErrTenantMismatch
	}
	tc := a.tenants[string(c.tenant)]
	if tc == nil {
		return Principal{}, ErrUnknown
	}
	if _, ok := a.revoked[string(c.sandbox)]; ok {
		return Principal{}, ErrRevoked
	}
	if _, ok := a.revoked[string(c.id)]; ok {
		return Principal{}, ErrRevoked
	}
	expiry := time.Unix(c.expires, 0)
	if !now.Before(expiry) {
		return Principal{}, ErrExpired
	}
	return Principal{
		Tenant:  tc.id,
		Sandbox: string(c.sandbox),
		Expiry:  expiry,
		Kind:    KindToken,
		TokenID: string(c.id),
	}, nil
}

func asciiEqualFold(s, lower string) bool {
	if len(s) != len(lower) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'A' && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != lower[i] {
			return false
		}
	}
	return true
}
