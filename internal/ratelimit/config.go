package ratelimit

import (
	"fmt"
	"math"

	"github.com/sluicehq/sluice/rules"
)

// Rate is a token bucket: PerSecond tokens are added each second, up to Burst.
// PerSecond <= 0 means unlimited. Burst <= 0 defaults to max(1, ceil(PerSecond)).
type Rate struct {
	PerSecond float64
	Burst     int
}

// TenantConfig is everything limited for one tenant. Zero values mean unlimited.
type TenantConfig struct {
	Requests              Rate            // every request and CONNECT of the tenant
	Rules                 map[string]Rate // rule id → rate
	Secrets               map[string]Rate // secret name → this tenant's budget for it, shared by every rule and tunnel that injects it
	MaxConnections        int             // concurrent client connections
	MaxTunnels            int             // concurrent CONNECT tunnels
	EgressBytesPerSecond  int64           // sandbox → upstream
	IngressBytesPerSecond int64           // upstream → sandbox
}

// Config is the input to New and Update. Tenants absent from it are refused by
// Allow, Acquire and the byte-rate wrappers (fail closed): a request from a
// tenant the policy does not know must never be counted as unlimited.
type Config struct {
	MaxConnections int // process-wide, 0 = unlimited
	MaxTunnels     int // process-wide, 0 = unlimited
	Tenants        map[string]TenantConfig
}

// FromPolicy builds a Config from a compiled policy: the global limits, every
// tenant's limits, each allow rule's rate by rule id, and, for each tenant, the
// budget of every rate-limited secret one of its rules injects.
func FromPolicy(p *rules.Policy) Config {
	var c Config
	if pc := p.Config(); pc != nil {
		c.MaxConnections = pc.Limits.MaxConnections
		c.MaxTunnels = pc.Limits.MaxTunnels
	}
	tenants := p.Tenants()
	c.Tenants = make(map[string]TenantConfig, len(tenants))
	for _, t := range tenants {
		tc := TenantConfig{}
		if l := t.Limits; l != nil {
			tc.Requests = Rate{PerSecond: l.RequestsPerSecond, Burst: l.Burst}
			tc.MaxConnections = l.MaxConnections
			tc.MaxTunnels = l.MaxTunnels
			tc.EgressBytesPerSecond = int64(l.EgressBytesPerSecond)
			tc.IngressBytesPerSecond = int64(l.IngressBytesPerSecond)
		}
		for _, r := range t.Allow {
			if r.Limits != nil && r.Limits.RequestsPerSecond > 0 {
				if tc.Rules == nil {
					tc.Rules = make(map[string]Rate)
				}
				tc.Rules[r.ID] = Rate{PerSecond: r.Limits.RequestsPerSecond, Burst: r.Limits.Burst}
			}
			for _, name := range r.Secrets {
				s, ok := p.Secret(name)
				if !ok || s.Limits == nil || s.Limits.RequestsPerSecond <= 0 {
					continue
				}
				if tc.Secrets == nil {
					tc.Secrets = make(map[string]Rate)
				}
				tc.Secrets[name] = Rate{PerSecond: s.Limits.RequestsPerSecond, Burst: s.Limits.Burst}
			}
		}
		c.Tenants[t.ID] = tc
	}
	return c
}

// normalize validates a rate and fills in the default burst. ok is false for
// an unlimited rate.
func (r Rate) normalize() (Rate, bool, error) {
	if math.IsNaN(r.PerSecond) || math.IsInf(r.PerSecond, 0) {
		return r, false, fmt.Errorf("rate %v is not a finite number", r.PerSecond)
	}
	if r.Burst < 0 {
		return r, false, fmt.Errorf("burst %d is negative", r.Burst)
	}
	if r.PerSecond <= 0 {
		if r.PerSecond < 0 {
			return r, false, fmt.Errorf("rate %v is negative", r.PerSecond)
		}
		return Rate{}, false, nil
	}
	if r.Burst == 0 {
		r.Burst = int(math.Max(1, math.Ceil(math.Min(r.PerSecond, math.MaxInt32))))
	}
	return r, true, nil
}

// byteRate turns a bytes-per-second figure into a bucket. The burst is also the
// largest chunk the wrappers move at once: a quarter of a second's worth keeps
// the rate smooth on long transfers, with a floor so slow limits do not
// degenerate into single-byte reads.
func byteRate(bps int64) (Rate, bool, error) {
	if bps < 0 {
		return Rate{}, false, fmt.Errorf("byte rate %d is negative", bps)
	}
	if bps == 0 {
		return Rate{}, false, nil
	}
	burst := bps / 4
	if floor := min(bps, 4096); burst < floor {
		burst = floor
	}
	burst = min(burst, math.MaxInt32)
	return Rate{PerSecond: float64(bps), Burst: int(burst)}, true, nil
}
