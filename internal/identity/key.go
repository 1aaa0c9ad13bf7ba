package identity

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
)

// KeySize is the size in bytes of a token signing key.
const KeySize = 32

// Key is the HMAC-SHA256 key that signs sandbox tokens. Its bytes are
// unexported and every way of printing it is redacted, so that a key that ends
// up in a log line, an error or a debug dump does not give away the ability to
// mint tokens for every tenant.
type Key struct {
	b [KeySize]byte
}

const redactedKey = "identity.Key(REDACTED)"

// String implements fmt.Stringer without revealing the key.
func (Key) String() string { return redactedKey }

// GoString implements fmt.GoStringer without revealing the key (%#v).
func (Key) GoString() string { return redactedKey }

// Format implements fmt.Formatter so that every verb (%x, %v, %+v, %s, ...) is redacted.
func (Key) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, redactedKey) }

// LogValue implements slog.LogValuer so structured logs are redacted too.
func (Key) LogValue() slog.Value { return slog.StringValue(redactedKey) }

// MarshalText refuses to serialise the key (encoding/json, yaml and friends use it).
func (Key) MarshalText() ([]byte, error) {
	return nil, errors.New("identity: refusing to marshal a token key")
}

// isZero reports whether k is the zero Key, which is never a real key: signing
// with it would let anyone mint tokens.
func (k *Key) isZero() bool { return k.b == [KeySize]byte{} }

// NewKey returns a fresh random key.
func NewKey() (Key, error) {
	var k Key
	if _, err := rand.Read(k.b[:]); err != nil {
		return Key{}, fmt.Errorf("identity: generating token key: %w", err)
	}
	return k, nil
}

// GenerateKeyFile writes a fresh random key to path as exactly KeySize raw bytes,
// with mode 0600. It creates missing parent directories with mode 0700 and
// refuses to overwrite an existing file: replacing the key silently would
// invalidate every live token, and clobbering an unrelated file is worse.
func GenerateKeyFile(path string) error {
	if path == "" {
		return errors.New("identity: key file path is empty")
	}
	k, err := NewKey()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("identity: creating key directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("identity: key file %s already exists; refusing to overwrite it", path)
		}
		return fmt.Errorf("identity: creating key file: %w", err)
	}
	_, werr := f.Write(k.b[:])
	if werr == nil {
		werr = f.Sync()
	}
	cerr := f.Close()
	if werr == nil {
		werr = cerr
	}
	if werr != nil {
		// A truncated key file would be loaded as "wrong size" later; remove it now
		// so the operator can simply retry.
		_ = os.Remove(path)
		return fmt.Errorf("identity: writing key file: %w", werr)
	}
	return nil
}

// LoadKeyFile reads a key written by GenerateKeyFile. It refuses a file that is
// not a regular file, that group or others may read or write (a key anyone on the
// host can read lets them mint tokens for every tenant), or whose size is not
// exactly KeySize bytes.
func LoadKeyFile(path string) (Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return Key{}, fmt.Errorf("identity: opening key file: %w", err)
	}
	defer f.Close()
	// Stat the open descriptor, not the path, so the checks apply to the file we read.
	fi, err := f.Stat()
	if err != nil {
		return Key{}, fmt.Errorf("identity: key file %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return Key{}, fmt.Errorf("identity: key file %s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return Key{}, fmt.Errorf("identity: key file %s has mode %04o; it must not be accessible by group or others (chmod 600)", path, perm)
	}
	if fi.Size() != KeySize {
		return Key{}, fmt.Errorf("identity: key file %s has %d bytes, want exactly %d", path, fi.Size(), KeySize)
	}
	var k Key
	if _, err := io.ReadFull(f, k.b[:]); err != nil {
		return Key{}, fmt.Errorf("identity: reading key file %s: %w", path, err)
	}
	// The size could have changed between Stat and Read; insist on EOF.
	var extra [1]byte
	if n, _ := f.Read(extra[:]); n != 0 {
		return Key{}, fmt.Errorf("identity: key file %s is longer than %d bytes", path, KeySize)
	}
	return k, nil
}
