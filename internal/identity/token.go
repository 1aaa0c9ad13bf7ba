package identity

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"time"
)

// A minted sandbox token is
//
//	slt1.<base64url(payload)>.<base64url(HMAC-SHA256(key, "slt1.<base64url(payload)>"))>
//
// with unpadded base64url and payload "tenant|sandbox|issued|expires|tokenid"
// (times in Unix seconds). The MAC covers the version prefix, so a future format
// cannot be confused with this one, and it is checked before the payload is
// decoded, so nothing unauthenticated is ever parsed. '|' cannot occur in an id
// (see ValidID), so the fields are unambiguous.
const (
	tokenPrefix = "slt1."
	// MaxTokenTTL bounds how long a minted token may live. Tokens are meant for
	// one sandbox run; revocation lists should not have to remember them for long.
	MaxTokenTTL = 30 * 24 * time.Hour
	// MaxIDLen bounds tenant and sandbox ids.
	MaxIDLen       = 64
	tokenIDBytes   = 16
	macB64Len      = 43 // base64.RawURLEncoding.EncodedLen(sha256.Size)
	maxPayloadLen  = 2*MaxIDLen + 2*20 + 2*tokenIDBytes + 4
	payloadSep     = '|'
	maxTokenLength = len(tokenPrefix) + (maxPayloadLen*4+2)/3 + 1 + macB64Len
)

// ValidID reports whether s may be used as a tenant, sandbox or token id:
// 1 to MaxIDLen characters from [A-Za-z0-9._-], starting with a letter or digit.
// The restriction keeps ids safe to put in a token, a log line, an audit record
// and a Basic user name (which cannot contain ':').
func ValidID(s string) bool { return validID(s) }

func validID[T string | []byte](s T) bool {
	if len(s) == 0 || len(s) > MaxIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case (c == '.' || c == '_' || c == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

// Mint returns a sandbox token for tenant and sandbox, issued at now and valid
// for ttl (at least one second, at most MaxTokenTTL; expiry is truncated to whole
// seconds). It carries a random token id so that one token can be revoked
// without revoking the whole sandbox.
func Mint(key Key, tenant, sandbox string, ttl time.Duration, now time.Time) (string, error) {
	if !ValidID(tenant) {
		return "", fmt.Errorf("identity: mint: tenant id %q is not valid (1-%d characters of A-Z a-z 0-9 . _ -)", tenant, MaxIDLen)
	}
	if !ValidID(sandbox) {
		return "", fmt.Errorf("identity: mint: sandbox id %q is not valid (1-%d characters of A-Z a-z 0-9 . _ -)", sandbox, MaxIDLen)
	}
	if ttl < time.Second || ttl > MaxTokenTTL {
		return "", fmt.Errorf("identity: mint: ttl %s is out of range [1s, %s]", ttl, MaxTokenTTL)
	}
	if key.isZero() {
		return "", errors.New("identity: mint: token key is all zeros (not loaded?)")
	}
	if now.IsZero() {
		return "", errors.New("identity: mint: issue time is zero")
	}
	var rnd [tokenIDBytes]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return "", fmt.Errorf("identity: mint: generating token id: %w", err)
	}
	payload := make([]byte, 0, maxPayloadLen)
	payload = append(payload, tenant...)
	payload = append(payload, payloadSep)
	payload = append(payload, sandbox...)
	payload = append(payload, payloadSep)
	payload = strconv.AppendInt(payload, now.Unix(), 10)
	payload = append(payload, payloadSep)
	payload = strconv.AppendInt(payload, now.Add(ttl).Unix(), 10)
	payload = append(payload, payloadSep)
	payload = hex.AppendEncode(payload, rnd[:])

	tok := make([]byte, 0, maxTokenLength)
	tok = append(tok, tokenPrefix...)
	tok = base64.RawURLEncoding.AppendEncode(tok, payload)
	var sum [sha256.Size]byte
	computeMAC(hmac.New(sha256.New, key.b[:]), tok, &sum)
	tok = append(tok, '.')
	tok = base64.RawURLEncoding.AppendEncode(tok, sum[:])
	return string(tok), nil
}

func computeMAC(h hash.Hash, signed []byte, out *[sha256.Size]byte) {
	h.Reset()
	h.Write(signed)
	h.Sum(out[:0])
}

// tokenClaims is a verified token's payload. The []byte fields alias a buffer
// owned by the caller.
type tokenClaims struct {
	tenant, sandbox, id []byte
	issued, expires     int64
}

// Sentinel details for malformed tokens; they never include the token itself.
var (
	errTokenSyntax  = fmt.Errorf("%w: token syntax", ErrMalformed)
	errTokenPayload = fmt.Errorf("%w: token payload", ErrMalformed)
	errTokenMAC     = fmt.Errorf("%w: token signature does not verify", ErrUnknown)
)

// splitToken checks the outer syntax of a token and returns the signed part, the
// encoded payload and the encoded MAC.
func splitToken(tok []byte) (signed, payload, mac []byte, err error) {
	if len(tok) > maxTokenLength || len(tok) < len(tokenPrefix)+1+1+macB64Len {
		return nil, nil, nil, errTokenSyntax
	}
	dot := len(tok) - macB64Len - 1
	if tok[dot] != '.' {
		return nil, nil, nil, errTokenSyntax
	}
	signed, mac = tok[:dot], tok[dot+1:]
	payload = signed[len(tokenPrefix):]
	for _, part := range [][]byte{payload, mac} {
		for _, c := range part {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return nil, nil, nil, errTokenSyntax
			}
		}
	}
	return signed, payload, mac, nil
}

// parsePayload decodes an already authenticated payload into buf.
func parsePayload(enc []byte, buf *[maxPayloadLen]byte) (tokenClaims, error) {
	var c tokenClaims
	if base64.RawURLEncoding.DecodedLen(len(enc)) > len(buf) {
		return c, errTokenPayload
	}
	n, err := base64.RawURLEncoding.Decode(buf[:], enc)
	if err != nil {
		return c, errTokenPayload
	}
	p := buf[:n]
	var fields [5][]byte
	for i := range fields {
		j := 0
		for j < len(p) && p[j] != payloadSep {
			j++
		}
		fields[i] = p[:j]
		if i < len(fields)-1 {
			if j == len(p) {
				return c, errTokenPayload
			}
			p = p[j+1:]
		} else if j != len(p) {
			return c, errTokenPayload
		}
	}
	c.tenant, c.sandbox, c.id = fields[0], fields[1], fields[4]
	var ok1, ok2 bool
	c.issued, ok1 = parseUnix(fields[2])
	c.expires, ok2 = parseUnix(fields[3])
	if !ok1 || !ok2 || c.expires <= c.issued || !validID(c.tenant) || !validID(c.sandbox) || !validID(c.id) {
		return c, errTokenPayload
	}
	return c, nil
}

// parseUnix parses a non-negative decimal without allocating.
func parseUnix(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 18 {
		return 0, false
	}
	var v int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		v = v*10 + int64(c-'0')
	}
	return v, true
}
