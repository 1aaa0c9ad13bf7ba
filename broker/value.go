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
// The bytes are only reachable through a closure: fmt's reflection, which
// takes over where it cannot call our methods (a Value in an unexported
// struct field, or behind a bad verb), prints a func as an address.
type Value struct {
	reveal func() string
}

// NewValue wraps b; b is copied, so the caller may wipe or reuse it.
func NewValue(b []byte) Value { return valueOf(string(b)) }

func valueOf(s string) Value { return Value{reveal: func() string { return s }} }

// IsZero reports whether v holds no value (never fetched, or empty).
func (v Value) IsZero() bool { return v.Reveal() == "" }

// Len is the length of the secret in bytes (safe to log).
func (v Value) Len() int { return len(v.Reveal()) }

// Reveal returns the secret as a string, for setting a header.
func (v Value) Reveal() string {
	if v.reveal == nil {
		return ""
	}
	return v.reveal()
}

// Bytes returns a copy of the secret, for the response scrubber.
func (v Value) Bytes() []byte {
	if v.reveal == nil {
		return nil
	}
	return []byte(v.reveal())
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
