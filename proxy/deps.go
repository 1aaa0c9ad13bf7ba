package proxy

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"time"

	"github.com/sluicehq/sluice/broker"
	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/rules"
)

// The proxy consumes its collaborators through these small interfaces, so the
// pipeline can be read without knowing how each one is built.

// Dialer opens upstream connections; in production it is netguard's guarded
// dialer, which checks the resolved IP and takes per-tenant exceptions from
// the context.
type Dialer interface {
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
}

// Auditor records one line per decision. Write returns once the record is
// written, so a response is never completed before its record exists.
type Auditor interface {
	Write(ctx context.Context, r *audit.Record) error
	Healthy() error
}

// Authenticator turns a Proxy-Authorization value into a principal.
type Authenticator interface {
	Authenticate(header string, now time.Time) (identity.Principal, error)
}

// SecretStore hands out secret values from an in-memory snapshot: it never
// does I/O on the request path.
type SecretStore interface {
	Get(name string) (broker.Value, error)
}

// CertIssuer provides the server-side TLS configuration for an intercepted
// tunnel to host.
type CertIssuer interface {
	ServerConfig(ctx context.Context, host string) (*tls.Config, error)
}

// Limiter enforces rate limits and concurrency caps. Its keys are always
// names from the configuration (tenant, rule id, secret name).
type Limiter interface {
	// AllowRequest spends one request token for the tenant, the rule and
	// each secret the request carries.
	AllowRequest(tenant, rule string, secrets []string) (ok bool, retryAfter time.Duration)
	// AcquireTunnel reserves one concurrent tunnel for the tenant.
	AcquireTunnel(tenant string) (release func(), ok bool)
	// AcquireConnection reserves one client connection for the tenant; the
	// proxy holds it until the connection closes.
	AcquireConnection(tenant string) (release func(), ok bool)
	// Reader applies the tenant's byte rate in one direction.
	Reader(ctx context.Context, tenant string, egress bool, r io.Reader) io.Reader
	// AuthAllowed says whether a source address may try to authenticate;
	// AuthFailed charges it for a failure.
	AuthAllowed(addr netip.Addr) bool
	AuthFailed(addr netip.Addr)
}

// Observer receives metrics events.
type Observer interface {
	Decision(tenant string, decision string, reason rules.Reason, seconds float64)
	Bytes(tenant string, in, out int64)
	Refused(tenant string, what string)
	TunnelOpened()
	TunnelClosed()
}

type nopLimiter struct{}

func (nopLimiter) AllowRequest(string, string, []string) (bool, time.Duration) { return true, 0 }
func (nopLimiter) AcquireTunnel(string) (func(), bool)                         { return func() {}, true }
func (nopLimiter) AcquireConnection(string) (func(), bool)                     { return func() {}, true }
func (nopLimiter) AuthAllowed(netip.Addr) bool                                 { return true }
func (nopLimiter) AuthFailed(netip.Addr)                                       {}
func (nopLimiter) Reader(_ context.Context, _ string, _ bool, r io.Reader) io.Reader {
	return r
}

type nopObserver struct{}

func (nopObserver) Decision(string, string, rules.Reason, float64) {}
func (nopObserver) Bytes(string, int64, int64)                     {}
func (nopObserver) Refused(string, string)                         {}
func (nopObserver) TunnelOpened()                                  {}
func (nopObserver) TunnelClosed()                                  {}
