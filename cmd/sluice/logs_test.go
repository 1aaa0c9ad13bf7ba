package main

// Tests of the reviewer's CLI through the built binary: `sluice logs` with
// every filter, --json, `logs summary`, `logs verify` and `rules suggest`,
// against an audit set written by internal/audit's writer with a fixed
// clock (so the files, their hashes and the outputs are the same on every
// run) that spans rotated, compressed files. Outputs are compared with
// golden files in testdata/; run `go test -run TestLogsCLI ./cmd/sluice/
// -update` to rewrite them after checking a change.

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/audit"
)

var updateGolden = flag.Bool("update", false, "rewrite cmd/sluice/testdata/*.golden")

// stepClock is the writer's clock: a fixed start, one second per reading.
type stepClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Second)
	return c.t
}

// reviewFixture is a morning of traffic for two tenants: acme (enforce,
// sandboxes sb-1 and sb-2) and beta (report mode, sb-9), covering every
// record kind, decision and the fields the filters look at.
func reviewFixture() []*audit.Record {
	t0 := time.Date(2026, 3, 4, 9, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	zero := 0
	req := func(s int, tenant, sb, method, host string, port int, path string, d audit.Decision, reason string) *audit.Record {
		r := &audit.Record{Time: at(s), Kind: audit.KindRequest, ID: fmt.Sprintf("r%04d", s), Tenant: tenant, Sandbox: sb,
			Client: "127.0.0.1:40000", Method: method, Scheme: "https", Host: host, Port: port, Path: path,
			Decision: d, Mode: "enforce", Reason: reason, Policy: "5ee1"}
		switch d {
		case audit.DecisionAllow:
			r.Status, r.BytesIn, r.BytesOut, r.DurationMS, r.UpstreamIP, r.Rule = 200, 310, 4096, 12.5, "203.0.113.10", tenant+"/allow/0"
		case audit.DecisionWouldDeny:
			r.Mode, r.Status = "report", 200
		case audit.DecisionError:
			r.Status = 502
		default:
			r.Status = 403
		}
		return r
	}
	withSecrets := func(r *audit.Record, names ...string) *audit.Record { r.Secrets = names; return r }
	withStatus := func(r *audit.Record, status int) *audit.Record { r.Status = status; return r }
	recs := []*audit.Record{
		{Time: at(0), Kind: audit.KindConfigReload, Policy: "5ee1", Message: "policy loaded: 2 tenants, 9 rules"},
		{Time: at(5), Kind: audit.KindLaunch, ID: "l1", Tenant: "acme", Sandbox: "sb-1", Command: []string{"python3", "agent.py"},
			Limits: &audit.Limits{MemoryBytes: 256 << 20, PIDs: 64, CPUs: 1, TimeoutMS: 300000}, Launcher: "1000:ci"},
		withSecrets(req(10, "acme", "sb-1", "GET", "api.x.test", 443, "/v1/items", audit.DecisionAllow, "allowed"), "github"),
		withSecrets(req(11, "acme", "sb-1", "POST", "api.x.test", 443, "/v1/items", audit.DecisionAllow, "allowed"), "github"),
		req(12, "acme", "sb-1", "GET", "cdn.x.test", 443, "/lib.js", audit.DecisionAllow, "allowed"),
		req(13, "acme", "sb-1", "GET", "x.test", 443, "/", audit.DecisionAllow, "allowed"),
		req(20, "acme", "sb-1", "GET", "evil.y.test", 443, "/upload", audit.DecisionDeny, "not_allowlisted"),
		req(21, "acme", "sb-1", "GET", "gist.x.test", 443, "/", audit.DecisionDeny, "denied_by_rule"),
		req(22, "acme", "sb-1", "GET", "169.254.169.254", 80, "/latest/meta-data", audit.DecisionDeny, "destination_not_permitted"),
		{Time: at(23), Kind: audit.KindRequest, ID: "r0023", Tenant: "acme", Sandbox: "sb-1", Method: "POST", Scheme: "https",
			Host: "paste.y.test", Port: 443, Path: "/new", Decision: audit.DecisionDeny, Reason: "exfiltration_attempt",
			Secrets: []string{"github"}, Exfiltration: true, Status: 403},
		{Time: at(24), Kind: audit.KindRequest, ID: "r0024", Tenant: "acme", Sandbox: "sb-1", Method: "GET", Scheme: "https",
			Host: "api.x.test", Port: 443, Path: "/user", Decision: audit.DecisionAllow, Mode: "enforce", Rule: "acme/allow/0", Reason: "allowed",
			Secrets: []string{"github"}, ReflectionScrubbed: true, Status: 200, BytesOut: 900},
		req(25, "acme", "sb-1", "GET", "down.x.test", 443, "/", audit.DecisionError, "upstream_error"),
		{Time: at(30), Kind: audit.KindTunnel, ID: "t0030", Tenant: "acme", Sandbox: "sb-2", Client: "127.0.0.1:40001", Method: "CONNECT",
			Scheme: "https", Host: "files.pythonhosted.test", Port: 443, Decision: audit.DecisionAllow, Mode: "enforce", Rule: "acme/allow/3",
			Reason: "allowed", Status: 200, BytesIn: 2048, BytesOut: 3 << 20, DurationMS: 850},
		req(31, "acme", "sb-2", "GET", "pypi.test", 443, "/simple/", audit.DecisionAllow, "allowed"),
		withStatus(req(32, "acme", "sb-2", "GET", "api.x.test", 443, "/v1/items", audit.DecisionDeny, "rate_limited"), 429),
		{Time: at(40), Kind: audit.KindTunnel, ID: "t0040", Tenant: "beta", Sandbox: "sb-9", Method: "CONNECT", Host: "registry.npm.test",
			Port: 443, Decision: audit.DecisionWouldDeny, Mode: "report", Reason: "not_allowlisted", Status: 200, BytesIn: 700, BytesOut: 1 << 20},
		req(41, "beta", "sb-9", "GET", "a.cdn.z.test", 443, "/a.js", audit.DecisionWouldDeny, "not_allowlisted"),
		req(42, "beta", "sb-9", "HEAD", "b.cdn.z.test", 443, "/b.js", audit.DecisionWouldDeny, "not_allowlisted"),
		req(43, "beta", "sb-9", "GET", "c.cdn.z.test", 8443, "/c.js", audit.DecisionWouldDeny, "not_allowlisted"),
		req(44, "beta", "sb-9", "PUT", "gist.x.test", 443, "/", audit.DecisionWouldDeny, "denied_by_rule"),
		// A hostile sandbox's bytes in a record must not reach the
		// reviewer's terminal as escape sequences.
		req(45, "beta", "sb-9", "GET", "bad\x1b[31m.z.test", 443, "/\u202eevil", audit.DecisionWouldDeny, "not_allowlisted"),
		{Time: at(50), Kind: audit.KindAuthFailure, Client: "127.0.0.1:40002", Reason: "auth_invalid", Message: "unknown credential"},
		{Time: at(60), Kind: audit.KindRun, ID: "l1", Tenant: "acme", Sandbox: "sb-1", Command: []string{"python3", "agent.py"},
			ExitCode: &zero, DurationMS: 55000, Launcher: "1000:ci"},
		withSecrets(req(3600, "acme", "sb-1", "GET", "api.x.test", 443, "/v1/later", audit.DecisionAllow, "allowed"), "github"),
	}
	return recs
}

// writeReviewLog writes records to dir/audit.log through the real writer,
// rotating at the 4 KiB minimum with compression, and returns the active
// path and the ordered set.
func writeReviewLog(t *testing.T, dir string, recs []*audit.Record, now func() time.Time) (string, []string) {
	t.Helper()
	path := filepath.Join(dir, "audit.log")
	w, err := audit.Open(audit.Options{Path: path, Fsync: audit.FsyncNever, RotateSize: 4096, Compress: true, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, r := range recs {
		if err := w.Write(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	files, err := audit.ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	return path, files
}

// checkGolden compares got with testdata/<name>.golden (rewriting it with
// -update).
func checkGolden(t *testing.T, name string, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *updateGolden {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from %s (run with -update after checking):\n--- got\n%s\n--- want\n%s", name, path, got, want)
	}
}

// sluiceOK runs the binary and requires exit status 0 and a quiet stderr.
func sluiceOK(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, code := runSluice(t, "", args...)
	if code != 0 || errOut != "" {
		t.Fatalf("sluice %s: exit %d\nstderr: %s", strings.Join(args, " "), code, errOut)
	}
	return out
}

// idsOf returns the id (or kind, for records without one) of every JSON
// line in out.
func idsOf(t *testing.T, out string) []string {
	t.Helper()
	var ids []string
	for _, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if line == "" {
			continue
		}
		var r audit.Record
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("--json line is not a record: %v: %q", err, line)
		}
		id := r.ID
		if id == "" {
			id = string(r.Kind)
		}
		ids = append(ids, id)
	}
	return ids
}

func TestLogsCLI(t *testing.T) {
	dir := t.TempDir()
	clk := &stepClock{t: time.Date(2026, 3, 4, 10, 0, 0, 0, time.UTC)}
	path, files := writeReviewLog(t, dir, reviewFixture(), clk.Now)
	if len(files) < 3 || !strings.HasSuffix(files[0], ".gz") {
		t.Fatalf("the fixture should span rotated, compressed files: %v", files)
	}

	listings := []struct {
		golden string
		args   []string
	}{
		{"logs_all", nil},
		{"logs_tenant", []string{"--tenant", "beta"}},
		{"logs_sandbox", []string{"--sandbox", "sb-2"}},
		{"logs_decision", []string{"--decision", "deny"}},
		{"logs_reason", []string{"--reason", "not_allowlisted"}},
		{"logs_host", []string{"--host", "*.x.test"}},
		{"logs_secret", []string{"--secret", "github"}},
		{"logs_since_until", []string{"--since", "2026-03-04T09:00:30Z", "--until", "2026-03-04T09:00:45Z"}},
		{"logs_kind", []string{"--kind", "tunnel"}},
		{"logs_combined", []string{"--tenant", "acme", "--decision", "allow", "--host", "api.x.test", "--since", "2026-03-04T09:00:11Z"}},
		{"logs_chain", []string{"--kind", "chain"}},
	}
	for _, l := range listings {
		t.Run(l.golden, func(t *testing.T) {
			out := sluiceOK(t, append(append([]string{"logs"}, l.args...), path)...)
			if strings.ContainsAny(out, "\x1b\u202e") {
				t.Error("the listing carries a terminal escape or bidi control from a record")
			}
			checkGolden(t, l.golden, out)
		})
	}

	t.Run("filters select the right records", func(t *testing.T) {
		// The goldens pin the format; this pins the selection in words.
		cases := []struct {
			args []string
			want string
		}{
			{[]string{"--tenant", "beta"}, "t0040 r0041 r0042 r0043 r0044 r0045"},
			{[]string{"--sandbox", "sb-2"}, "t0030 r0031 r0032"},
			{[]string{"--decision", "deny"}, "r0020 r0021 r0022 r0023 r0032"},
			{[]string{"--decision", "error"}, "r0025"},
			{[]string{"--reason", "denied_by_rule"}, "r0021 r0044"},
			{[]string{"--host", "*.x.test"}, "r0010 r0011 r0012 r0021 r0024 r0025 r0032 r0044 r3600"},
			{[]string{"--host", "*.CDN.z.test"}, "r0041 r0042 r0043"},
			{[]string{"--host", "x.test"}, "r0013"},
			{[]string{"--secret", "github"}, "r0010 r0011 r0023 r0024 r3600"},
			{[]string{"--since", "2026-03-04T09:00:45Z"}, "r0045 auth_failure l1 r3600"},
			{[]string{"--until", "2026-03-04T09:00:10Z"}, "config_reload l1"},
			{[]string{"--kind", "run"}, "l1"},
			{[]string{"--kind", "auth_failure"}, "auth_failure"},
			{[]string{"--tenant", "nobody"}, ""},
		}
		for _, c := range cases {
			out := sluiceOK(t, append(append([]string{"logs", "--json"}, c.args...), path)...)
			if got := strings.Join(idsOf(t, out), " "); got != c.want {
				t.Errorf("logs %s: %q, want %q", strings.Join(c.args, " "), got, c.want)
			}
		}
	})

	t.Run("json is the records as written", func(t *testing.T) {
		out := sluiceOK(t, "logs", "--json", "--kind", "chain", path)
		out += sluiceOK(t, "logs", "--json", path)
		var raw bytes.Buffer
		for _, f := range files {
			raw.Write(readMaybeGzip(t, f))
		}
		// Every printed line is a line of the files, byte for byte, and
		// every line of the files was printed exactly once.
		lines := strings.Split(strings.TrimSuffix(raw.String(), "\n"), "\n")
		printed := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
		if len(printed) != len(lines) {
			t.Fatalf("--json printed %d lines for %d in the files", len(printed), len(lines))
		}
		have := map[string]int{}
		for _, l := range lines {
			have[l]++
		}
		for _, l := range printed {
			if have[l] == 0 {
				t.Fatalf("--json printed a line that is not in the files: %s", l)
			}
			have[l]--
		}
		checkGolden(t, "logs_json_acme_allow", sluiceOK(t, "logs", "--json", "--tenant", "acme", "--decision", "allow", path))
	})

	t.Run("config names the log", func(t *testing.T) {
		cfg := filepath.Join(dir, "sluice.yaml")
		if err := os.WriteFile(cfg, []byte("version: 1\naudit:\n  path: audit.log\ntenants:\n  - id: acme\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		byPath := sluiceOK(t, "logs", "--tenant", "acme", path)
		if got := sluiceOK(t, "logs", "-c", cfg, "--tenant", "acme"); got != byPath {
			t.Errorf("logs -c CONFIG differs from logs PATH:\n%s\n---\n%s", got, byPath)
		}
		if got := sluiceOK(t, "logs", "summary", "--config", cfg); got != sluiceOK(t, "logs", "summary", path) {
			t.Error("logs summary --config differs from logs summary PATH")
		}
	})

	t.Run("summary", func(t *testing.T) {
		checkGolden(t, "logs_summary", sluiceOK(t, "logs", "summary", path))
		checkGolden(t, "logs_summary_json", sluiceOK(t, "logs", "summary", "--json", path))
		checkGolden(t, "logs_summary_beta_top2", sluiceOK(t, "logs", "summary", "--tenant", "beta", "--top", "2", path))
	})

	t.Run("verify", func(t *testing.T) {
		checkGolden(t, "logs_verify", sluiceOK(t, "logs", "verify", path))
		// Named out of order, the files are still verified as a set.
		args := []string{"logs", "verify"}
		for i := len(files) - 1; i >= 0; i-- {
			args = append(args, files[i])
		}
		if got := sluiceOK(t, args...); !strings.HasPrefix(got, "OK: ") {
			t.Errorf("verify of the files named newest first: %q", got)
		}
	})

	t.Run("suggest", func(t *testing.T) {
		for _, tenant := range []string{"acme", "beta"} {
			draft := sluiceOK(t, "rules", "suggest", "--tenant", tenant, path)
			checkGolden(t, "suggest_"+tenant, draft)
			// Pasted under the tenant, the draft is a valid config.
			var b strings.Builder
			b.WriteString("version: 1\ntenants:\n  - id: " + tenant + "\n")
			for _, l := range strings.Split(strings.TrimSuffix(draft, "\n"), "\n") {
				b.WriteString("    " + l + "\n")
			}
			cfg := filepath.Join(dir, "suggested-"+tenant+".yaml")
			if err := os.WriteFile(cfg, []byte(b.String()), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, errOut, code := runSluice(t, "", "rules", "check", cfg); code != 0 {
				t.Errorf("the draft for %s fails `sluice rules check`: exit %d\n%s%s\n%s", tenant, code, out, errOut, b.String())
			}
		}
		// Time bounds and the wildcard threshold are honoured.
		late := sluiceOK(t, "rules", "suggest", "--tenant", "acme", "--since", "2026-03-04T09:30:00Z", path)
		if !strings.Contains(late, `host: "api.x.test"`) || strings.Contains(late, "cdn.x.test") || strings.Contains(late, "pypi.test") {
			t.Errorf("suggest --since keeps records before the bound:\n%s", late)
		}
		if beta := sluiceOK(t, "rules", "suggest", "--tenant", "beta", "--min-wildcard", "4", path); strings.Contains(beta, `"*.cdn.z.test"`) {
			t.Errorf("suggest --min-wildcard 4 grouped 3 siblings into a wildcard:\n%s", beta)
		}
		js := sluiceOK(t, "rules", "suggest", "--tenant", "beta", "--json", path)
		if !strings.Contains(js, `"host": "*.cdn.z.test"`) || !strings.Contains(js, "gist.x.test") {
			t.Errorf("suggest --json: %s", js)
		}
	})

	t.Run("bad input", func(t *testing.T) {
		cases := []struct {
			args []string
			want string
		}{
			{[]string{"logs", "--decision", "maybe", path}, `--decision "maybe"`},
			{[]string{"logs", "--kind", "gossip", path}, `--kind "gossip"`},
			{[]string{"logs", "--reason", "because", path}, `--reason "because"`},
			{[]string{"logs", "--since", "yesterday", path}, "--since"},
			{[]string{"logs", "--until", "-2h", path}, "--until"},
			{[]string{"logs", "summary", "--top", "0", path}, "--top"},
			{[]string{"logs", filepath.Join(dir, "nothing.log")}, "nothing.log"},
			{[]string{"logs"}, "--config"},
			{[]string{"rules", "suggest", path}, "--tenant"},
			{[]string{"rules", "suggest", "--tenant", "acme", "--min-wildcard", "1", path}, "--min-wildcard"},
		}
		for _, c := range cases {
			out, errOut, code := runSluice(t, "", c.args...)
			if code != 2 || !strings.Contains(errOut, c.want) || out != "" {
				t.Errorf("sluice %s: exit %d, stdout %q, stderr %q; want exit 2 naming %s", strings.Join(c.args, " "), code, out, errOut, c.want)
			}
		}
		if _, errOut, code := runSluice(t, "", "logs", "verify"); code == 0 {
			t.Errorf("logs verify without a path succeeded: %s", errOut)
		}
	})
}

// TestLogsCLIRelativeTimes checks --since and --until given as durations
// before now, on records written minutes and hours ago.
func TestLogsCLIRelativeTimes(t *testing.T) {
	now := time.Now().UTC()
	mk := func(id string, ago time.Duration) *audit.Record {
		return &audit.Record{Time: now.Add(-ago), Kind: audit.KindRequest, ID: id, Tenant: "acme", Method: "GET",
			Host: "api.x.test", Port: 443, Decision: audit.DecisionAllow, Reason: "allowed", Status: 200}
	}
	path, _ := writeReviewLog(t, t.TempDir(), []*audit.Record{mk("3h", 3*time.Hour), mk("90m", 90*time.Minute), mk("10m", 10*time.Minute)}, nil)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--since", "2h"}, "90m 10m"},
		{[]string{"--until", "1h"}, "3h 90m"},
		{[]string{"--since", "2h", "--until", "30m"}, "90m"},
		{[]string{"--since", now.Add(-100 * time.Minute).Format(time.RFC3339), "--until", "5m"}, "90m 10m"},
	}
	for _, c := range cases {
		out := sluiceOK(t, append(append([]string{"logs", "--json"}, c.args...), path)...)
		if got := strings.Join(idsOf(t, out), " "); got != c.want {
			t.Errorf("logs %s: %q, want %q", strings.Join(c.args, " "), got, c.want)
		}
	}
	if draft := sluiceOK(t, "rules", "suggest", "--tenant", "acme", "--until", "2h", path); !strings.Contains(draft, "from 1 records") {
		t.Errorf("suggest --until 2h:\n%s", draft)
	}
}

// TestLogsCLIDamagedLog shows what a reviewer sees on a damaged log: the
// listing skips what it cannot read and says so, and verify names the line.
func TestLogsCLIDamagedLog(t *testing.T) {
	dir := t.TempDir()
	clk := &stepClock{t: time.Date(2026, 3, 4, 10, 0, 0, 0, time.UTC)}
	recs := reviewFixture()[:6]
	path := filepath.Join(dir, "audit.log")
	w, err := audit.Open(audit.Options{Path: path, Fsync: audit.FsyncNever, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if err := w.Write(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.SplitAfter(string(data), "\n")
	// Line 4 becomes garbage; the file keeps its other lines.
	lines[3] = "this is not a record\n"
	if err := os.WriteFile(path, []byte(strings.Join(lines, "")), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runSluice(t, "", "logs", "--json", path)
	if code != 0 || len(idsOf(t, out)) != len(recs)-1 || !strings.Contains(errOut, "skipped 1 malformed") {
		t.Errorf("logs on a damaged file: exit %d, %d records, stderr %q", code, len(idsOf(t, out)), errOut)
	}
	out, code = audVerifyCLI(t, path)
	if code != 1 || !strings.Contains(out, path+":4: malformed") {
		t.Errorf("verify on a damaged file: exit %d\n%s", code, out)
	}
}

func readMaybeGzip(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(path, ".gz") {
		return b
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	out, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	return out
}
