package audit

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkWrite measures Write throughput with concurrent writers (group
// commit). Run: go test -run '^$' -bench Write -benchtime=20000x ./internal/audit/
func BenchmarkWrite(b *testing.B) {
	for _, fsync := range []string{FsyncNever, FsyncAlways} {
		b.Run("fsync="+fsync, func(b *testing.B) {
			w, err := Open(Options{Path: filepath.Join(b.TempDir(), "audit.log"), Fsync: fsync})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			rec := sampleRecord(1)
			b.SetParallelism(16) // many proxy goroutines per core
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := w.Write(ctx, rec); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
			w.Close(ctx)
		})
	}
}

// BenchmarkEncode measures the hand-written encoder alone.
func BenchmarkEncode(b *testing.B) {
	r := sampleRecord(1)
	r.Time = time.Now()
	buf := make([]byte, 0, 1024)
	b.ReportAllocs()
	for b.Loop() {
		body := appendBody(buf[:0], r)
		appendLine(make([]byte, 0, 1024), 1, "", body)
	}
}

// writeBig writes n generated request records to one file, chained, quickly
// (without the Writer's per-record wait).
func writeBig(b *testing.B, path string, n int) {
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	t0 := time.Date(2026, 3, 4, 0, 0, 0, 0, time.UTC)
	var line []byte
	prev := ""
	line, prev = appendLine(line[:0], 1, prev, appendBody(nil, &Record{Time: t0, Kind: KindChain, Reason: ChainStart}))
	bw.Write(line)
	tenants := []string{"acme", "beta", "gamma", "delta"}
	decisions := []Decision{DecisionAllow, DecisionAllow, DecisionAllow, DecisionDeny, DecisionWouldDeny}
	reasons := map[Decision]string{DecisionAllow: "allowed", DecisionDeny: "not_allowlisted", DecisionWouldDeny: "not_allowlisted"}
	var body []byte
	for i := range n {
		d := decisions[i%len(decisions)]
		r := Record{Time: t0.Add(time.Duration(i) * time.Millisecond), Kind: KindRequest, ID: fmt.Sprintf("r%d", i),
			Tenant: tenants[i%len(tenants)], Sandbox: fmt.Sprintf("sb-%d", i%97), Client: "127.0.0.1:40000",
			Method: "GET", Scheme: "https", Host: fmt.Sprintf("h%d.example.com", i%1000), Port: 443, Path: "/v1/items",
			Decision: d, Mode: "enforce", Reason: reasons[d], Status: 200, BytesIn: int64(i % 4096), BytesOut: int64(i % 65536),
			DurationMS: 12.25, UpstreamIP: "203.0.113.9", Policy: "9f2c"}
		if i%10 == 0 {
			r.Secrets = []string{"github"}
		}
		if i%5000 == 0 {
			r.Exfiltration = true
		}
		body = appendBody(body[:0], &r)
		line, prev = appendLine(line[:0], uint64(i+2), prev, body)
		bw.Write(line)
	}
	if err := bw.Flush(); err != nil {
		b.Fatal(err)
	}
	f.Close()
}

// BenchmarkSummary1M reads and summarises 1,000,000 records (~330 MB).
// Run: go test -run '^$' -bench Summary1M -benchtime=1x ./internal/audit/
func BenchmarkSummary1M(b *testing.B) {
	path := filepath.Join(b.TempDir(), "audit.log")
	const n = 1_000_000
	writeBig(b, path, n)
	fi, _ := os.Stat(path)
	b.SetBytes(fi.Size())
	b.ResetTimer()
	for range b.N {
		z := NewSummarizer(10)
		st, err := Scan(context.Background(), []string{path}, func(r *Record, _ Location) error { z.Add(r); return nil })
		if err != nil {
			b.Fatal(err)
		}
		if s := z.Result(); st.Records != n+1 || s.Records != n {
			b.Fatalf("read %d records, summarised %d", st.Records, s.Records)
		}
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "records/s")
}

// BenchmarkVerify1M verifies the chain of 1,000,000 records.
func BenchmarkVerify1M(b *testing.B) {
	path := filepath.Join(b.TempDir(), "audit.log")
	const n = 1_000_000
	writeBig(b, path, n)
	b.ResetTimer()
	for range b.N {
		rep, err := Verify([]string{path})
		if err != nil || !rep.OK() || rep.Records != n+1 {
			b.Fatalf("%+v %v", rep, err)
		}
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "records/s")
}
