package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// testClock is a settable clock for rotation by age.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *testClock {
	return &testClock{t: time.Date(2026, 1, 2, 15, 4, 5, 0, time.UTC)}
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Millisecond)
	return c.t
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func openTest(t testing.TB, opts Options) *Writer {
	t.Helper()
	w, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close(context.Background()) })
	return w
}

func sampleRecord(i int) *Record {
	code := 0
	r := &Record{
		Kind: KindRequest, ID: "req-" + strconv.Itoa(i), Tenant: "acme", Sandbox: "sb-1",
		Client: "127.0.0.1:40000", Method: "GET", Scheme: "https", Host: "api.github.com", Port: 443,
		Path: "/repos/acme/x", Decision: DecisionAllow, Mode: "enforce", Rule: "acme/allow/0",
		Reason: "allowed", Status: 200, BytesIn: 120, BytesOut: 4096, DurationMS: 12.5,
		UpstreamIP: "140.82.112.6", Intercepted: true, Secrets: []string{"github"}, Policy: "p1",
	}
	if i%7 == 3 {
		r.Kind, r.Command, r.Limits, r.ExitCode, r.Launcher = KindRun, []string{"python3", "-c", "print(1)"}, &Limits{MemoryBytes: 1 << 28, PIDs: 64}, &code, "1000:alice"
	}
	return r
}

func readLines(t testing.TB, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

func TestWriteChainAndRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	w := openTest(t, Options{Path: path, Fsync: FsyncAlways})
	ctx := context.Background()
	want := []*Record{}
	for i := range 20 {
		r := sampleRecord(i)
		r.Message = "line1\nline2\r\"quoted\"\u2028\x00 bad:\xff"
		r.Path = "/p?token=abc"
		if err := w.Write(ctx, r); err != nil {
			t.Fatal(err)
		}
		want = append(want, r)
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, sampleRecord(0)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Write after Close = %v, want ErrClosed", err)
	}
	lines := readLines(t, path)
	if len(lines) != 21 {
		t.Fatalf("got %d lines, want 21 (header + 20)", len(lines))
	}
	var prev string
	for i, l := range lines {
		if strings.Contains(l, "token=abc") {
			t.Fatalf("line %d carries the query string: %s", i+1, l)
		}
		var std map[string]any
		if err := json.Unmarshal([]byte(l), &std); err != nil {
			t.Fatalf("line %d is not JSON: %v", i+1, err)
		}
		r, err := parseLine([]byte(l))
		if err != nil {
			t.Fatalf("line %d: %v", i+1, err)
		}
		// The hand-written decoder agrees with encoding/json.
		var viaStd Record
		if err := json.Unmarshal([]byte(l), &viaStd); err != nil {
			t.Fatal(err)
		}
		a, _ := json.Marshal(r)
		b, _ := json.Marshal(&viaStd)
		if !bytes.Equal(a, b) {
			t.Fatalf("line %d decodes differently:\n%s\n%s", i+1, a, b)
		}
		if r.Seq != uint64(i+1) || r.Prev != prev || r.V != SchemaVersion {
			t.Fatalf("line %d: seq %d prev %q, want seq %d prev %q", i+1, r.Seq, r.Prev, i+1, prev)
		}
		computed, claimed, ok := lineHash([]byte(l))
		if !ok || computed != claimed || claimed != r.Hash {
			t.Fatalf("line %d: hash does not verify", i+1)
		}
		prev = r.Hash
		if i == 0 {
			if r.Kind != KindChain || r.Reason != ChainStart {
				t.Fatalf("first record = %+v, want a chain start header", r)
			}
			continue
		}
		src := want[i-1]
		if r.Tenant != src.Tenant || r.Host != src.Host || r.Path != "/p" || r.Message != strings.ToValidUTF8(src.Message, "\uFFFD") {
			t.Fatalf("line %d: round trip lost data: %+v", i+1, r)
		}
	}
}

func TestWriteRejectsBadInput(t *testing.T) {
	w := openTest(t, Options{Path: filepath.Join(t.TempDir(), "a.log")})
	ctx := context.Background()
	for _, r := range []*Record{nil, {Kind: ""}, {Kind: "bogus"}, {Kind: KindChain}, {Kind: KindAuditGap}} {
		if err := w.Write(ctx, r); err == nil {
			t.Errorf("Write(%+v) succeeded", r)
		}
	}
	for _, o := range []Options{{}, {Path: "x", Fsync: "sometimes"}, {Path: "x", OnFailure: "maybe"}, {Path: "-", RotateSize: 1 << 20}, {Path: "x", RotateSize: 10}, {Path: "x", QueueSize: -1}} {
		if _, err := Open(o); err == nil {
			t.Errorf("Open(%+v) succeeded", o)
		}
	}
}
