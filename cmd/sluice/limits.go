package main

import (
	"context"
	"io"
	"net/netip"
	"time"

	"github.com/sluicehq/sluice/internal/ratelimit"
	"github.com/sluicehq/sluice/rules"
)

// limiter adapts the ratelimit package to the proxy's Limiter interface: the
// proxy speaks in tenants, rule ids and secret names; ratelimit in keys.
type limiter struct {
	limits   *ratelimit.Limits
	failures *ratelimit.FailureThrottle
}

func newLimiter(p *rules.Policy) (*limiter, error) {
	l, err := ratelimit.New(ratelimit.FromPolicy(p))
	if err != nil {
		return nil, err
	}
	perMinute := p.Config().Limits.AuthFailuresPerMinute
	if perMinute == 0 {
		perMinute = 30
	}
	ft, err := ratelimit.NewFailureThrottle(perMinute, 0)
	if err != nil {
		return nil, err
	}
	return &limiter{limits: l, failures: ft}, nil
}

func (l *limiter) update(p *rules.Policy) error {
	return l.limits.Update(ratelimit.FromPolicy(p))
}

func (l *limiter) AllowRequest(tenant, rule string, secrets []string) (bool, time.Duration) {
	var buf [8]ratelimit.Key
	keys := append(buf[:0], ratelimit.TenantKey(tenant))
	if rule != "" {
		keys = append(keys, ratelimit.RuleKey(tenant, rule))
	}
	for _, s := range secrets {
		keys = append(keys, ratelimit.SecretKey(tenant, s))
	}
	ok, retry, _ := l.limits.AllowAll(time.Now(), keys...)
	return ok, retry
}

func (l *limiter) AcquireTunnel(tenant string) (func(), bool) {
	return l.limits.Acquire(ratelimit.Tunnels, tenant)
}

func (l *limiter) AcquireConnection(tenant string) (func(), bool) {
	return l.limits.Acquire(ratelimit.Connections, tenant)
}

func (l *limiter) Reader(ctx context.Context, tenant string, egress bool, r io.Reader) io.Reader {
	dir := ratelimit.Ingress
	if egress {
		dir = ratelimit.Egress
	}
	return l.limits.Reader(ctx, tenant, dir, r)
}

func (l *limiter) AuthAllowed(addr netip.Addr) bool { return l.failures.Allowed(addr) }
func (l *limiter) AuthFailed(addr netip.Addr)       { l.failures.Failed(addr) }
