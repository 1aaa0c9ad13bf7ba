package certs

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"
)

func benchIssuer(b *testing.B) *Issuer {
	b.Helper()
	ca, _, _ := newTestCA(b, CAOptions{})
	iss, err := NewIssuer(ca, IssuerOptions{})
	if err != nil {
		b.Fatal(err)
	}
	return iss
}

// BenchmarkIssueNewHost is the cold path: every iteration asks for a host
// never seen before, so it pays one CA signature plus parsing (and, past 1024
// hosts, an LRU eviction). It reports the per-call median and p99 too.
func BenchmarkIssueNewHost(b *testing.B) {
	iss := benchIssuer(b)
	ctx := context.Background()
	var lat []time.Duration
	n := 0
	for b.Loop() {
		host := "h" + strconv.Itoa(n) + ".bench.example"
		n++
		t0 := time.Now()
		if _, err := iss.Certificate(ctx, host); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	if got := iss.Stats().Issued; got != uint64(n) {
		b.Fatalf("issued %d leaves for %d new hosts", got, n)
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
}

// BenchmarkCachedHost is the warm path every intercepted tunnel takes after
// the first: normalise the host, one LRU lookup.
func BenchmarkCachedHost(b *testing.B) {
	iss := benchIssuer(b)
	ctx := context.Background()
	if _, err := iss.Certificate(ctx, "cached.bench.example:443"); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := iss.Certificate(ctx, "cached.bench.example:443"); err != nil {
			b.Fatal(err)
		}
	}
	if got := iss.Stats().Issued; got != 1 {
		b.Fatalf("cached host issued %d times", got)
	}
}

// BenchmarkServerConfigCached adds building the per-tunnel tls.Config.
func BenchmarkServerConfigCached(b *testing.B) {
	iss := benchIssuer(b)
	ctx := context.Background()
	for b.Loop() {
		if _, err := iss.ServerConfig(ctx, "cached.bench.example:443"); err != nil {
			b.Fatal(err)
		}
	}
}
