package broker

import (
	"fmt"
	"log/slog"
)

// Redacted is what a Value prints, encodes and logs as.
const Redacted = "[REDACTED]"

// Value is a secret's bytes. It redacts itself when printed (every fmt verb,
// including %#v and %x), JSON- or text-encoded, or logged with slog; only
// Bytes and Reveal hand out the secret, so it can only escape on purpose.
//
// The bytes sit behind a pointer to an unexported type so that fmt, printing a
// struct that holds a Value in an unexported field (where it cannot call our
// methods), shows an address rather than the bytes.
type Value struct {
	s *secretBytes
}

type secretBytes struct {
	v string
}

// NewValue wraps b; b is copied, so the caller may wipe or reuse it.
func NewValue(b []byte) Value {
	return Value{s: &secretBytes{v: string(b)}}
}

// IsZero reports whether v holds no value (never fetched, or empty).
func (v Value) IsZero() bool { return v.s == nil || v.s.v == "" }

// Len is the length of the secret in bytes (safe to log).
func (v Value) Len() int {
	if v.s == nil {
		return 0
	}
	return len(v.s.v)
}

// Reveal returns the secret as a string, for setting a header.
func (v Value) Reveal() string {
	if v.s == nil {
		return ""
	}
	return v.s.v
}

// Bytes returns a copy of the secret, for the response scrubber.
func (v Value) Bytes() []byte {
	if v.s == nil {
		return nil
	}
	return []byte(v.s.v)
}

// Equal reports whether two values hold the same secret.
func (v Value) Equal(o Value) bool { return v.Reveal() == o.Reveal() }

// String implements fmt.Stringer with a redaction.
func (Value) String() string { return Redacted }

// GoString implements fmt.GoStringer with a redaction.
func (Value) GoString() string { return "broker.Value(" + Redacted + ")" }

// Format implements fmt.Formatter so that no verb (%x, %q, %d ...) reaches the bytes.
func (Value) Format(f fmt.State, verb rune) {
	if verb == 'v' && f.Flag('#') {
		_, _ = f.Write([]byte("broker.Value(" + Redacted + ")"))
		return
	}
	_, _ = f.Write([]byte(Redacted))
}

// MarshalJSON implements json.Marshaler with a redaction.
func (Value) MarshalJSON() ([]byte, error) { return []byte(`"` + Redacted + `"`), nil }

// MarshalText implements encoding.TextMarshaler with a redaction (also used by
// YAML and slog's text handler).
func (Value) MarshalText() ([]byte, error) { return []byte(Redacted), nil }

// LogValue implements slog.LogValuer with a redaction.
func (Value) LogValue() slog.Value { return slog.StringValue(Redacted) }
