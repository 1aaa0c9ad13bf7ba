package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/rules"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// fixtureRecords is a small, fixed day of traffic covering every kind.
func fixtureRecords() []*Record {
	t0 := time.Date(2026, 3, 4, 9, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	zero, one := 0, 137
	req := func(s int, tenant, sb, method, host string, port int, path string, d Decision, reason string) *Record {
		r := &Record{Time: at(s), Kind: KindRequest, ID: fmt.Sprintf("r%03d", s), Tenant: tenant, Sandbox: sb,
			Client: "127.0.0.1:5000", Method: method, Scheme: "https", Host: host, Port: port, Path: path,
			Decision: d, Mode: "enforce", Reason: reason, Policy: "9f2c"}
		if d == DecisionAllow {
			r.Status, r.BytesIn, r.BytesOut, r.DurationMS, r.UpstreamIP, r.Rule = 200, 300, 5120, 41.5, "203.0.113.7", tenant+"/allow/0"
		} else {
			r.Status = 403
		}
		if d == DecisionWouldDeny {
			r.Mode = "report"
		}
		return r
	}
	recs := []*Record{
		{Time: at(0), Kind: KindConfigReload, Policy: "9f2c", Message: "policy loaded: 2 tenants, 7 rules"},
		{Time: at(5), Kind: KindLaunch, ID: "l1", Tenant: "acme", Sandbox: "sb-1", Command: []string{"python3", "agent.py"}, Limits: &Limits{MemoryBytes: 512 << 20, PIDs: 128, CPUs: 1.5, TimeoutMS: 600000}, Launcher: "1000:ci"},
		req(10, "acme", "sb-1", "GET", "api.github.com", 443, "/repos/acme/app", DecisionAllow, "allowed"),
		req(11, "acme", "sb-1", "POST", "api.github.com", 443, "/repos/acme/app/issues", DecisionAllow, "allowed"),
		req(12, "acme", "sb-1", "GET", "files.pythonhosted.org", 443, "/packages/a.whl", DecisionAllow, "allowed"),
		req(13, "acme", "sb-1", "GET", "evil.example.net", 443, "/upload", DecisionDeny, "not_allowlisted"),
		req(14, "acme", "sb-1", "GET", "evil.example.net", 443, "/upload", DecisionDeny, "not_allowlisted"),
		req(15, "acme", "sb-1", "GET", "gist.github.com", 443, "/", DecisionDeny, "denied_by_rule"),
		req(16, "acme", "sb-1", "GET", "169.254.169.254", 80, "/latest/meta-data", DecisionDeny, "destination_not_permitted"),
		{Time: at(20), Kind: KindTunnel, ID: "t1", Tenant: "beta", Sandbox: "sb-9", Client: "127.0.0.1:5001", Method: "CONNECT", Host: "registry.npmjs.org", Port: 443, Decision: DecisionWouldDeny, Mode: "report", Reason: "not_allowlisted", BytesIn: 2048, BytesOut: 1 << 20, DurationMS: 900},
		{Time: at(21), Kind: KindTunnel, ID: "t2", Tenant: "beta", Sandbox: "sb-9", Method: "CONNECT", Host: "a.cdn.example.org", Port: 443, Decision: DecisionAllow, Mode: "report", Reason: "allowed", Intercepted: true, BytesIn: 100, BytesOut: 200},
		{Time: at(22), Kind: KindRequest, ID: "r22", TunnelID: "t2", Tenant: "beta", Sandbox: "sb-9", Method: "GET", Scheme: "https", Host: "a.cdn.example.org", Port: 443, Path: "/lib.js", Decision: DecisionAllow, Mode: "report", Reason: "allowed", Status: 200, BytesOut: 150},
		{Time: at(23), Kind: KindRequest, ID: "r23", Tenant: "beta", Sandbox: "sb-9", Method: "GET", Scheme: "https", Host: "b.cdn.example.org", Port: 443, Path: "/x", Decision: DecisionWouldDeny, Mode: "report", Reason: "not_allowlisted", Status: 200},
		{Time: at(24), Kind: KindRequest, ID: "r24", Tenant: "beta", Sandbox: "sb-9", Method: "HEAD", Scheme: "https", Host: "c.cdn.example.org", Port: 8443, Path: "/y", Decision: DecisionWouldDeny, Mode: "report", Reason: "not_allowlisted", Status: 200},
		{Time: at(25), Kind: KindRequest, ID: "r25", Tenant: "beta", Sandbox: "sb-9", Method: "GET", Scheme: "https", Host: "bad_host\x1b[31m.example", Port: 443, Decision: DecisionWouldDeny, Mode: "report", Reason: "not_allowlisted"},
		{Time: at(26), Kind: KindRequest, ID: "r26", Tenant: "beta", Sandbox: "sb-9", Method: "PUT", Scheme: "https", Host: "gist.github.com", Port: 443, Decision: DecisionWouldDeny, Mode: "report", Reason: "denied_by_rule"},
		{Time: at(30), Kind: KindRequest, ID: "r30", Tenant: "acme", Sandbox: "sb-1", Method: "POST", Scheme: "https", Host: "paste.example.com", Port: 443, Path: "/new", Decision: DecisionDeny, Reason: "exfiltration_attempt", Exfiltration: true, Secrets: []string{"github"}, Status: 403},
		{Time: at(31), Kind: KindRequest, ID: "r31", Tenant: "acme", Sandbox: "sb-1", Method: "GET", Scheme: "https", Host: "api.github.com", Port: 443, Path: "/user", Decision: DecisionAllow, Reason: "allowed", Secrets: []string{"github"}, ReflectionScrubbed: true, Status: 200, BytesOut: 900},
		{Time: at(40), Kind: KindAuthFailure, Client: "127.0.0.1:5002", Reason: "auth_invalid", Message: "unknown credential"},
		{Time: at(50), Kind: KindRun, ID: "l1", Tenant: "acme", Sandbox: "sb-1", Command: []string{"python3", "agent.py"}, ExitCode: &one, KilledBy: "timeout", DurationMS: 600000, Launcher: "1000:ci"},
		{Time: at(51), Kind: KindRun, ID: "l2", Tenant: "acme", Sandbox: "sb-2", Command: []string{"true"}, ExitCode: &zero, DurationMS: 3, Launcher: "1000:ci"},
	}
	return recs
}

// writeFixture writes the fixture through a rotating writer with a fixed
// clock, so the files (and their hashes) are the same on every run.
func writeFixture(t testing.TB, dir string) (string, []string) {
	path := filepath.Join(dir, "audit.log")
	clk := &testClock{t: time.Date(2026, 3, 4, 10, 0, 0, 0, time.UTC)}
	w, err := Open(Options{Path: path, Fsync: FsyncNever, RotateSize: 4096, Compress: true, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, r := range fixtureRecords() {
		if err := w.Write(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	files, err := ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	return path, files
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the golden file (run with -update after checking):\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestGoldenLogs(t *testing.T) {
	_, files := writeFixture(t, t.TempDir())
	if len(files) < 2 || !strings.HasSuffix(files[0], ".gz") {
		t.Fatalf("fixture should span rotated, compressed files: %v", files)
	}
	verifyOK(t, files)
	list := func(f Filter) []byte {
		var buf bytes.Buffer
		tab := NewTable(&buf)
		if _, err := Scan(context.Background(), files, func(r *Record, _ Location) error {
			if f.Match(r) {
				return tab.Write(r)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	golden(t, "logs", list(Filter{}))
	golden(t, "logs_acme_github", list(Filter{Tenant: "acme", Host: "*.github.com"}))
	golden(t, "logs_would_deny_since", list(Filter{Decision: DecisionWouldDeny, Since: time.Date(2026, 3, 4, 9, 0, 23, 0, time.UTC)}))
	if out := list(Filter{}); bytes.ContainsRune(out, 0x1b) {
		t.Fatal("table output carries a terminal escape from a record")
	}

	// --json reproduces the written lines byte for byte.
	var raw, re bytes.Buffer
	for _, f := range files {
		rc, err := openRecords(f)
		if err != nil {
			t.Fatal(err)
		}
		raw.ReadFrom(rc)
		rc.Close()
	}
	var line []byte
	Scan(context.Background(), files, func(r *Record, _ Location) error {
		line = AppendJSON(line[:0], r)
		re.Write(line)
		return nil
	})
	if !bytes.Equal(raw.Bytes(), re.Bytes()) {
		t.Fatal("AppendJSON does not reproduce the written lines")
	}
}

func TestGoldenSummary(t *testing.T) {
	_, files := writeFixture(t, t.TempDir())
	z := NewSummarizer(10)
	Scan(context.Background(), files, func(r *Record, _ Location) error { z.Add(r); return nil })
	s := z.Result()
	var buf bytes.Buffer
	if err := s.WriteText(&buf); err != nil {
		t.Fatal(err)
	}
	golden(t, "summary", buf.Bytes())
	js, _ := json.MarshalIndent(&s, "", "  ")
	golden(t, "summary_json", append(js, '\n'))
}

func TestGoldenSuggest(t *testing.T) {
	_, files := writeFixture(t, t.TempDir())
	for _, tenant := range []string{"acme", "beta", "nobody"} {
		g := NewSuggester(tenant, 3)
		Scan(context.Background(), files, func(r *Record, _ Location) error { g.Add(r); return nil })
		s := g.Result()
		var buf bytes.Buffer
		if err := s.WriteYAML(&buf); err != nil {
			t.Fatal(err)
		}
		golden(t, "suggest_"+tenant, buf.Bytes())
		checkSuggestionIsValidConfig(t, tenant, buf.String())
	}
}

// checkSuggestionIsValidConfig pastes the draft under a tenant and runs the
// real config parser and compiler on it.
func checkSuggestionIsValidConfig(t *testing.T, tenant, draft string) {
	t.Helper()
	var b strings.Builder
	b.WriteString("version: 1\ntenants:\n  - id: " + tenant + "\n")
	for _, l := range strings.Split(strings.TrimSuffix(draft, "\n"), "\n") {
		b.WriteString("    " + l + "\n")
	}
	cfg, err := rules.Parse([]byte(b.String()), "suggest.yaml")
	if err != nil {
		t.Fatalf("draft for %s does not parse as config: %v\n%s", tenant, err, b.String())
	}
	if _, err := rules.Compile(cfg); err != nil {
		t.Fatalf("draft for %s does not compile: %v\n%s", tenant, err, b.String())
	}
}
