package broker

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicehq/sluice/rules"
)

// fakeClock is a settable clock for staleness; the refresh loop still runs on
// real timers.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// syncBuffer collects log output from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func writeSecrets(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// eventually polls cond every 10ms for at most d.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func fileSpec(name string) rules.SecretSpec {
	return rules.SecretSpec{Name: name, Source: "file", Hosts: []string{"api.example.com"}}
}

type fileEnv struct {
	path  string
	clock *fakeClock
	logs  *syncBuffer
	b     *Broker
}

func startFileBroker(t *testing.T, content string, refresh, maxStale time.Duration, specs ...rules.SecretSpec) *fileEnv {
	t.Helper()
	dir := t.TempDir()
	env := &fileEnv{path: filepath.Join(dir, "secrets.yaml"), clock: newFakeClock(), logs: &syncBuffer{}}
	if content != "" {
		writeSecrets(t, env.path, content)
	}
	cfg := rules.BrokerConfig{
		Refresh:      rules.Duration(refresh),
		MaxStaleness: rules.Duration(maxStale),
		File:         rules.FileSource{Path: env.path},
	}
	log := slog.New(slog.NewJSONHandler(env.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	b, err := New(cfg, specs, Options{Logger: log, Now: env.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); b.Wait() })
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	env.b = b
	return env
}

func getString(b *Broker, name string) string {
	v, err := b.Get(name)
	if err != nil {
		return "error: " + err.Error()
	}
	return v.Reveal()
}

func TestBrokerFileLifecycle(t *testing.T) {
	const v1, v2, v3 = "ghp_first-value-111", "ghp_second-value-222", "ghp_third-value-333"
	env := startFileBroker(t, "github: "+v1+"\nother: x-other-value\n", time.Hour, 2*time.Hour,
		fileSpec("github"), rules.SecretSpec{Name: "aliased", Source: "file", Key: "other", Hosts: []string{"h"}})
	b := env.b
	if got := getString(b, "github"); got != v1 {
		t.Fatalf("Get = %q", got)
	}
	if got := getString(b, "aliased"); got != "x-other-value" {
		t.Fatalf("Get(aliased) = %q", got)
	}
	if err := b.Ready(); err != nil {
		t.Fatalf("Ready: %v", err)
	}

	// A rotation on disk arrives through the directory watch, long before
	// the hour-long refresh interval.
	writeSecrets(t, env.path, "github: "+v2+"\nother: x-other-value\n")
	eventually(t, 5*time.Second, "rotated value", func() bool { return getString(b, "github") == v2 })

	// The file disappears: the cached value serves until max staleness.
	if err := os.Remove(env.path); err != nil {
		t.Fatal(err)
	}
	env.clock.Advance(time.Hour)
	b.Kick()
	eventually(t, 5*time.Second, "failure logged", func() bool { return strings.Contains(env.logs.String(), "serving cached value") })
	if got := getString(b, "github"); got != v2 {
		t.Fatalf("within max staleness: Get = %q", got)
	}
	env.clock.Advance(time.Hour + time.Second)
	_, err := b.Get("github")
	var se *SecretError
	if !errors.Is(err, ErrStale) || !errors.As(err, &se) || se.Name != "github" {
		t.Fatalf("after max staleness: err = %v", err)
	}
	if err := b.Ready(); !errors.Is(err, ErrStale) {
		t.Fatalf("Ready = %v", err)
	}
	if age := b.Ages()["github"]; age != 2*time.Hour+time.Second {
		t.Fatalf("Ages = %v", b.Ages())
	}
	// A refresh that fails past max staleness says so. Wait for it before
	// the file comes back, or the recovery may get there first.
	b.Kick()
	eventually(t, 5*time.Second, "stale logged", func() bool { return strings.Contains(env.logs.String(), "secret stale") })

	// The file comes back: recovery on the next refresh.
	writeSecrets(t, env.path, "github: "+v3+"\nother: x-other-value\n")
	eventually(t, 5*time.Second, "recovery", func() bool { return getString(b, "github") == v3 })
	if err := b.Ready(); err != nil {
		t.Fatalf("Ready after recovery: %v", err)
	}

	logs := env.logs.String()
	for _, v := range []string{v1, v2, v3, "x-other-value"} {
		if strings.Contains(logs, v) {
			t.Fatalf("a secret value is in the logs:\n%s", logs)
		}
	}
	for _, want := range []string{"secret rotated", "secret stale", "fresh again"} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %q:\n%s", want, logs)
		}
	}
}

func TestBrokerPeriodicRefreshWithoutWatch(t *testing.T) {
	// The periodic refresh alone picks up a change: write in place (same
	// inode) and do not kick.
	env := startFileBroker(t, "s: value-one\n", 50*time.Millisecond, time.Minute, fileSpec("s"))
	if err := os.WriteFile(env.path, []byte("s: value-two\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "refresh", func() bool { return getString(env.b, "s") == "value-two" })
}

func TestBrokerUnavailableAndUnknown(t *testing.T) {
	env := startFileBroker(t, "", time.Hour, time.Hour, fileSpec("missing"))
	_, err := env.b.Get("missing")
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), `"missing"`) {
		t.Fatalf("err = %v", err)
	}
	if _, err := env.b.Get("nope"); !errors.Is(err, ErrUnknown) {
		t.Fatalf("unknown: %v", err)
	}
	if err := env.b.Ready(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Ready = %v", err)
	}
	if len(env.b.Ages()) != 0 {
		t.Fatalf("Ages = %v", env.b.Ages())
	}
	if !strings.Contains(env.logs.String(), "secret unavailable") {
		t.Fatalf("no log of the failure: %s", env.logs.String())
	}
	writeSecrets(t, env.path, "missing: now-here\n")
	eventually(t, 5*time.Second, "arrival", func() bool { return getString(env.b, "missing") == "now-here" })
}

func TestBrokerUpdate(t *testing.T) {
	env := startFileBroker(t, "a: value-a\nb: value-b\nc: value-c\n", time.Hour, time.Hour, fileSpec("a"), fileSpec("b"))
	b := env.b
	// Remove a, keep b (new hosts only: value kept), add c, and change the
	// origin of d=(key b → key c).
	bSpec := fileSpec("b")
	bSpec.Hosts = []string{"other.example.com"}
	dSpec := rules.SecretSpec{Name: "d", Source: "file", Key: "c", Hosts: []string{"h"}}
	if err := b.Update(context.Background(), []rules.SecretSpec{bSpec, fileSpec("c"), dSpec}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Get("a"); !errors.Is(err, ErrUnknown) {
		t.Fatalf("removed secret: %v", err)
	}
	for name, want := range map[string]string{"b": "value-b", "c": "value-c", "d": "value-c"} {
		if got := getString(b, name); got != want {
			t.Fatalf("%s = %q, want %q", name, got, want)
		}
	}
	if got := b.Names(); strings.Join(got, ",") != "b,c,d" {
		t.Fatalf("Names = %v", got)
	}
	// An invalid update changes nothing.
	bad := []rules.SecretSpec{fileSpec("x"), fileSpec("x")}
	if err := b.Update(context.Background(), bad); err == nil {
		t.Fatal("duplicate names accepted")
	}
	if getString(b, "b") != "value-b" {
		t.Fatal("invalid update changed the broker")
	}
}

func TestNewRefusesBadSpecs(t *testing.T) {
	cfg := rules.BrokerConfig{Refresh: rules.Duration(time.Minute), File: rules.FileSource{Path: "/nonexistent/secrets.yaml"}}
	cases := map[string]rules.SecretSpec{
		"no name":          {Source: "file"},
		"unknown source":   {Name: "a", Source: "ldap"},
		"no source":        {Name: "a"},
		"logical path":     {Name: "a", Source: "vault", Path: "secret/ci/github", Field: "token"},
		"data last":        {Name: "a", Source: "vault", Path: "secret/data", Field: "token"},
		"dotdot":           {Name: "a", Source: "vault", Path: "secret/data/../x", Field: "token"},
		"no field":         {Name: "a", Source: "vault", Path: "secret/data/x"},
		"stale < refresh":  {Name: "a", Source: "file", MaxStaleness: rules.Duration(time.Second)},
		"vault bad auth":   {Name: "a", Source: "vault", Path: "secret/data/x", Field: "f"},
		"leading slash":    {Name: "a", Source: "vault", Path: "/secret/data/x", Field: "f"},
		"empty file path":  {Name: "a", Source: "file"},
		"duplicate secret": {Name: "dup", Source: "file"},
	}
	for name, spec := range cases {
		c := cfg
		specs := []rules.SecretSpec{spec}
		switch name {
		case "vault bad auth":
			c.Vault.Auth = "kerberos"
		case "empty file path":
			c.File.Path = ""
		case "duplicate secret":
			specs = append(specs, spec)
		}
		if _, err := New(c, specs, Options{}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	ok := rules.SecretSpec{Name: "a", Source: "vault", Path: "kv/team/data/ci/github", Field: "token"}
	if _, err := New(cfg, []rules.SecretSpec{ok}, Options{}); err != nil {
		t.Fatalf("valid nested-mount path refused: %v", err)
	}
}

func TestBrokerStartTwice(t *testing.T) {
	env := startFileBroker(t, "a: v\n", time.Hour, time.Hour, fileSpec("a"))
	if err := env.b.Start(context.Background()); err == nil {
		t.Fatal("second Start accepted")
	}
}

func TestRender(t *testing.T) {
	env := startFileBroker(t, "github: ghp_abc\nuser: octo\n", time.Hour, time.Hour, fileSpec("github"), fileSpec("user"), fileSpec("gone"))
	b := env.b
	parts := []rules.TemplatePart{{Literal: "Basic "}, {Secret: "user"}, {Literal: ":"}, {Secret: "github"}, {Literal: "/"}, {Secret: "user"}}
	r, err := b.Render(parts)
	if err != nil {
		t.Fatal(err)
	}
	if r.Value.Reveal() != "Basic octo:ghp_abc/octo" {
		t.Fatalf("Render = %q", r.Value.Reveal())
	}
	if strings.Join(r.Secrets, ",") != "user,github" {
		t.Fatalf("Secrets = %v", r.Secrets)
	}
	set := r.ScrubSet()
	if len(set) != 2 || string(set[0]) != "octo" || string(set[1]) != "ghp_abc" {
		t.Fatalf("ScrubSet = %q", set)
	}
	// Fail closed: one unavailable part fails the whole header.
	r, err = b.Render([]rules.TemplatePart{{Literal: "Bearer "}, {Secret: "gone"}})
	if !errors.Is(err, ErrUnavailable) || r.Value.Reveal() != "" || r.Secrets != nil {
		t.Fatalf("Render with unavailable secret: %q %v", r.Value.Reveal(), err)
	}
	if _, err := b.Render([]rules.TemplatePart{{Secret: "undeclared"}}); !errors.Is(err, ErrUnknown) {
		t.Fatalf("undeclared: %v", err)
	}
	if _, err := b.Render(nil); err == nil {
		t.Fatal("empty template accepted")
	}
	env.clock.Advance(2 * time.Hour)
	if _, err := b.Render(parts); !errors.Is(err, ErrStale) {
		t.Fatalf("stale: %v", err)
	}
}

func BenchmarkGet(b *testing.B) {
	dir := b.TempDir()
	path := filepath.Join(dir, "s.yaml")
	if err := os.WriteFile(path, []byte("github: ghp_abc\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	br, err := New(rules.BrokerConfig{File: rules.FileSource{Path: path}}, []rules.SecretSpec{fileSpec("github")}, Options{})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); br.Wait() }()
	if err := br.Start(ctx); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := br.Get("github"); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func TestExampleVaultConfig(t *testing.T) {
	data, err := os.ReadFile("../examples/vault/sluice.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := rules.Parse(data, "examples/vault/sluice.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rules.Compile(cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := New(cfg.Broker, cfg.Secrets, Options{}); err != nil {
		t.Fatal(err)
	}
}
