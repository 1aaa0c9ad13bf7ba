package broker

import (
	"errors"
	"slices"
	"strings"

	"github.com/sluicehq/sluice/rules"
)

// Rendered is an expanded injection template. It prints redacted.
type Rendered struct {
	// Value is the header value; Reveal it to set the header.
	Value Value
	// Secrets names the secrets used, in order of first use (for the audit record).
	Secrets []string
	values  []Value
}

// ScrubSet returns the values of the secrets used, for NewScrubber and
// ScrubHeader. They are the values actually injected, even if a refresh has
// rotated a secret since.
func (r Rendered) ScrubSet() [][]byte {
	out := make([][]byte, len(r.values))
	for i, v := range r.values {
		out[i] = v.Bytes()
	}
	return out
}

// Render expands an injection template from one snapshot, so every part sees
// the same generation of secrets. It fails closed: any unknown, unavailable
// or stale secret is an error (a *SecretError naming it) and no value.
func (b *Broker) Render(parts []rules.TemplatePart) (Rendered, error) {
	snap, now := b.snap.Load(), b.now()
	var sb strings.Builder
	var r Rendered
	for _, p := range parts {
		if p.Secret == "" {
			sb.WriteString(p.Literal)
			continue
		}
		v, err := snap.get(p.Secret, now)
		if err != nil {
			return Rendered{}, err
		}
		if !slices.Contains(r.Secrets, p.Secret) {
			r.Secrets = append(r.Secrets, p.Secret)
			r.values = append(r.values, v)
		}
		sb.WriteString(v.Reveal())
	}
	if sb.Len() == 0 {
		return Rendered{}, errors.New("broker: template renders to an empty value")
	}
	r.Value = valueOf(sb.String())
	return r, nil
}
