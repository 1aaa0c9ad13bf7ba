package proxy

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/internal/netguard"
	"github.com/sluicehq/sluice/rules"
)

// benchProxy starts a real proxy (real policy, authenticator, guarded dialer
// and audit writer) in front of a loopback origin, for benchmarks that show
// what the pipeline costs per request.
func benchProxy(b *testing.B) (client *http.Client, originURL string) {
	b.Helper()
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, strings.Repeat("x", 100))
	}))
	b.Cleanup(origin.Close)
	u, _ := url.Parse(origin.URL)
	_, port, _ := net.SplitHostPort(u.Host)

	secret, err := identity.NewSecret()
	if err != nil {
		b.Fatal(err)
	}
	hash, err := identity.HashSecret(secret)
	if err != nil {
		b.Fatal(err)
	}
	cfg, err := rules.Parse([]byte(`version: 1
tenants:
  - id: bench
    credentials: [{name: c, hash: "`+hash+`"}]
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - host: 127.0.0.1
        ports: [`+port+`]
        methods: [GET]
        paths: ["/**"]
`), "bench.yaml")
	if err != nil {
		b.Fatal(err)
	}
	pol, err := rules.Compile(cfg)
	if err != nil {
		b.Fatal(err)
	}
	auth, err := identity.NewAuthenticator(identity.CredentialsFromTenants(cfg.Tenants), nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	aw, err := audit.Open(audit.Options{Path: filepath.Join(b.TempDir(), "audit.jsonl"), Fsync: "interval", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = aw.Close(context.Background()) })
	guard, err := netguard.New(netguard.Options{})
	if err != nil {
		b.Fatal(err)
	}
	srv, err := New(Options{Dialer: guard, Audit: aw}, pol, auth)
	if err != nil {
		b.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	b.Cleanup(func() { _ = srv.Shutdown(context.Background()) })
	pu := &url.URL{Scheme: "http", User: url.UserPassword("bench", secret), Host: ln.Addr().String()}
	tr := &http.Transport{Proxy: http.ProxyURL(pu), MaxIdleConnsPerHost: 64}
	b.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}, origin.URL + "/small"
}

func BenchmarkPlainHTTPKeepAlive(b *testing.B) {
	client, target := benchProxy(b)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := client.Get(target)
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
}
