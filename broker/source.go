package broker

import (
	"context"
	"errors"
	"strings"

	"github.com/sluicehq/sluice/rules"
)

// Source fetches the current value of one secret. Fetch is called from the
// broker's background refresh, never on a request's path; it must honour ctx
// and must never put the value (or any credential) in its error.
type Source interface {
	Name() string
	Fetch(ctx context.Context, spec rules.SecretSpec) (Value, error)
}

// runner is implemented by sources with background work (watching a file,
// keeping a Vault token alive). The broker runs it from Start until ctx ends;
// changed asks the broker for an early refresh.
type runner interface {
	Run(ctx context.Context, changed func())
}

// sanitizeErr returns err unless its text contains one of the sensitive
// strings, in which case it returns a new error with them replaced and no
// chain (the wrapped errors would still carry them). It is a second line of
// defence around third-party errors that might echo what they were sent.
func sanitizeErr(err error, sensitive ...string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	clean := msg
	for _, s := range sensitive {
		if s != "" {
			clean = strings.ReplaceAll(clean, s, Redacted)
		}
	}
	if clean == msg {
		return err
	}
	return errors.New(clean)
}
