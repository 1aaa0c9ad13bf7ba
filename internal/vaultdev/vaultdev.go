// Package vaultdev answers one question for tests: where is a real Vault
// server to test against? It finds the binary scripts/build-vault.sh builds and
// caches outside the repository, and starts `vault server -dev` on loopback,
// killed by PID when the test ends. Only tests import it.
package vaultdev

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// Version is the Vault release scripts/build-vault.sh builds.
const Version = "v1.21.0"

// Binary returns the Vault server binary: SLUICE_VAULT_BIN, else the one
// scripts/build-vault.sh caches. Without one the test is skipped, except when
// CI is set: CI must run the Vault tests, so there it fails.
func Binary(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("SLUICE_VAULT_BIN"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("SLUICE_VAULT_BIN=%s: %v", p, err)
		}
		return p
	}
	cache := os.Getenv("SLUICE_CACHE")
	if cache == "" {
		base := os.Getenv("XDG_CACHE_HOME")
		if base == "" {
			home, _ := os.UserHomeDir()
			base = filepath.Join(home, ".cache")
		}
		cache = filepath.Join(base, "sluice")
	}
	p := filepath.Join(cache, "vault-"+Version, "vault")
	if _, err := os.Stat(p); err != nil {
		msg := fmt.Sprintf("no Vault server binary at %s: run scripts/build-vault.sh or set SLUICE_VAULT_BIN", p)
		if os.Getenv("CI") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}

// Server is one `vault server -dev` process on loopback.
type Server struct {
	Addr string // 127.0.0.1:port
	Root string // root token
	Log  string // the server's log file

	cmd  *exec.Cmd
	done chan struct{}
}

// URL is the server's address for a Vault client.
func (s *Server) URL() string { return "http://" + s.Addr }

// Start starts an in-memory dev server on addr (empty: a free loopback port)
// with root as its root token, and waits until it is healthy and KV v2 at
// secret/ takes writes (the dev server upgrades that mount asynchronously).
// The server gets an environment of its own: no VAULT_* or proxy settings
// from the host. It is killed at cleanup, or by Stop.
func Start(t testing.TB, addr, root string) *Server {
	t.Helper()
	bin := Binary(t)
	if addr == "" {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr = l.Addr().String()
		l.Close()
	}
	dir := t.TempDir()
	s := &Server{Addr: addr, Root: root, Log: filepath.Join(dir, "vault.log"), done: make(chan struct{})}
	logf, err := os.Create(s.Log)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "server", "-dev", "-dev-listen-address="+addr, "-dev-root-token-id="+root,
		"-dev-no-store-token", "-log-level=warn")
	cmd.Dir = dir
	cmd.Env = []string{"HOME=" + dir, "PATH=" + os.Getenv("PATH"), "TMPDIR=" + dir}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("starting vault: %v", err)
	}
	s.cmd = cmd
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(s.done)
	}()
	t.Cleanup(s.Stop)

	client := &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 5 * time.Second}
	deadline := time.Now().Add(90 * time.Second)
	ready := func(do func() (*http.Response, error)) bool {
		resp, err := do()
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode/100 == 2
	}
	health := func() (*http.Response, error) { return client.Get(s.URL() + "/v1/sys/health") }
	probe := func() (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, s.URL()+"/v1/secret/data/vaultdev-probe", bytes.NewReader([]byte(`{"data":{"ok":"1"}}`)))
		if err != nil {
			return nil, err
		}
		req.Header.Set("X-Vault-Token", root)
		return client.Do(req)
	}
	for _, step := range []struct {
		what string
		do   func() (*http.Response, error)
	}{{"healthy", health}, {"serving KV v2 at secret/", probe}} {
		for !ready(step.do) {
			select {
			case <-s.done:
				out, _ := os.ReadFile(s.Log)
				t.Fatalf("vault on %s exited before it was %s:\n%s", addr, step.what, out)
			default:
			}
			if time.Now().After(deadline) {
				out, _ := os.ReadFile(s.Log)
				t.Fatalf("vault on %s not %s after 90s:\n%s", addr, step.what, out)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return s
}

// Stop kills the server by PID and waits for it; safe to call twice.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}
