// Package metrics answers one question: what is sluice doing right now, in
// numbers a Prometheus server can scrape? Label values are bounded by the
// configuration: a tenant label only ever carries a configured tenant id (or
// "unknown"), never a string a client chose.
package metrics

import (
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sluicehq/sluice/rules"
)

// Metrics holds sluice's collectors on a registry of its own (never the
// global default one).
type Metrics struct {
	reg *prometheus.Registry

	tenants atomic.Pointer[map[string]struct{}]

	requests       *prometheus.CounterVec
	latency        *prometheus.HistogramVec
	bytes          *prometheus.CounterVec
	refusals       *prometheus.CounterVec
	tunnelsActive  prometheus.Gauge
	reloads        *prometheus.CounterVec
	secretAge      *prometheus.GaugeVec
	auditQueue     prometheus.GaugeFunc
	connsActive    prometheus.GaugeFunc
	auditLost      prometheus.CounterFunc
	policyLoadedAt prometheus.Gauge
}

// Sources are the live values some gauges read when scraped.
type Sources struct {
	AuditQueueDepth   func() int
	AuditLost         func() uint64
	ActiveConnections func() int64
}

// New creates the collectors and registers them.
func New(src Sources) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	empty := map[string]struct{}{}
	m.tenants.Store(&empty)
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_requests_total", Help: "Decisions by tenant, decision and reason (requests, CONNECTs and auth failures).",
	}, []string{"tenant", "decision", "reason"})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "sluice_request_duration_seconds", Help: "Time from request to decision or end of response body.",
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
	}, []string{"tenant"})
	m.bytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_bytes_total", Help: "Body and tunnel bytes by tenant and direction (egress = to upstream).",
	}, []string{"tenant", "direction"})
	m.refusals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_limit_refusals_total", Help: "Requests and tunnels refused by a limit, by tenant and limit kind.",
	}, []string{"tenant", "limit"})
	m.tunnelsActive = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "sluice_tunnels_active", Help: "CONNECT tunnels currently open.",
	})
	m.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_config_reloads_total", Help: "Configuration reloads by result (ok, failed, unchanged).",
	}, []string{"result"})
	m.secretAge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "sluice_secret_age_seconds", Help: "Age of each secret's cached value (names only).",
	}, []string{"secret"})
	m.policyLoadedAt = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "sluice_policy_loaded_timestamp_seconds", Help: "When the policy in force was loaded.",
	})
	zeroInt := func() int { return 0 }
	if src.AuditQueueDepth == nil {
		src.AuditQueueDepth = zeroInt
	}
	if src.AuditLost == nil {
		src.AuditLost = func() uint64 { return 0 }
	}
	if src.ActiveConnections == nil {
		src.ActiveConnections = func() int64 { return 0 }
	}
	m.auditQueue = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "sluice_audit_queue_depth", Help: "Audit records waiting to be written.",
	}, func() float64 { return float64(src.AuditQueueDepth()) })
	m.auditLost = prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "sluice_audit_lost_total", Help: "Audit records that could not be written (on_failure: open only).",
	}, func() float64 { return float64(src.AuditLost()) })
	m.connsActive = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "sluice_connections_active", Help: "Client connections currently open.",
	}, func() float64 { return float64(src.ActiveConnections()) })
	m.reg.MustRegister(m.requests, m.latency, m.bytes, m.refusals, m.tunnelsActive, m.reloads,
		m.secretAge, m.auditQueue, m.auditLost, m.connsActive, m.policyLoadedAt,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// SetTenants bounds the tenant label to the configured tenants.
func (m *Metrics) SetTenants(ids []string) {
	set := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		set[id] = struct{}{}
	}
	m.tenants.Store(&set)
	m.policyLoadedAt.Set(float64(time.Now().Unix()))
}

func (m *Metrics) tenant(t string) string {
	if _, ok := (*m.tenants.Load())[t]; ok {
		return t
	}
	return "unknown"
}

// Decision counts one decision and its latency.
func (m *Metrics) Decision(tenant, decision string, reason rules.Reason, seconds float64) {
	t := m.tenant(tenant)
	m.requests.WithLabelValues(t, decision, string(reason)).Inc()
	m.latency.WithLabelValues(t).Observe(seconds)
}

// Bytes counts body or tunnel bytes.
func (m *Metrics) Bytes(tenant string, in, out int64) {
	t := m.tenant(tenant)
	if in > 0 {
		m.bytes.WithLabelValues(t, "egress").Add(float64(in))
	}
	if out > 0 {
		m.bytes.WithLabelValues(t, "ingress").Add(float64(out))
	}
}

// Refused counts a limit refusal.
func (m *Metrics) Refused(tenant, what string) {
	m.refusals.WithLabelValues(m.tenant(tenant), what).Inc()
}

// TunnelOpened and TunnelClosed track open tunnels.
func (m *Metrics) TunnelOpened() { m.tunnelsActive.Inc() }

// TunnelClosed is the counterpart of TunnelOpened.
func (m *Metrics) TunnelClosed() { m.tunnelsActive.Dec() }

// Reload counts a configuration reload by result.
func (m *Metrics) Reload(result string) { m.reloads.WithLabelValues(result).Inc() }

// SecretAges sets each secret's age; secrets no longer present are dropped.
func (m *Metrics) SecretAges(ages map[string]time.Duration) {
	m.secretAge.Reset()
	for name, age := range ages {
		m.secretAge.WithLabelValues(name).Set(age.Seconds())
	}
}
