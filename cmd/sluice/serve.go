package main

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"

	"github.com/sluicehq/sluice/broker"
	"github.com/sluicehq/sluice/certs"
	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/internal/metrics"
	"github.com/sluicehq/sluice/internal/netguard"
	"github.com/sluicehq/sluice/proxy"
	"github.com/sluicehq/sluice/rules"
)

// serverOverrides maps serve's flags to the config keys they override. The
// precedence is flag > SLUICE_* environment variable > config file.
var serverOverrides = []struct {
	flag, usage string
	field       func(c *rules.Config) *string
}{
	{"listen", "proxy listen address (host:port or unix:/path)", func(c *rules.Config) *string { return &c.Server.Listen }},
	{"admin", "admin listen address for /healthz, /readyz, /metrics", func(c *rules.Config) *string { return &c.Server.Admin }},
	{"resolver", "DNS server (ip:port) for upstream names", func(c *rules.Config) *string { return &c.Server.Resolver }},
	{"upstream-ca", "extra CA file trusted for upstream TLS", func(c *rules.Config) *string { return &c.Server.UpstreamCAFile }},
	{"audit", "audit log path (- for stdout)", func(c *rules.Config) *string { return &c.Audit.Path }},
	{"ca-cert", "interception CA certificate", func(c *rules.Config) *string { return &c.CA.Cert }},
	{"ca-key", "interception CA private key", func(c *rules.Config) *string { return &c.CA.Key }},
	{"token-key", "key file for minted sandbox tokens", func(c *rules.Config) *string { return &c.Identity.TokenKeyFile }},
}

func newServeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the egress proxy",
		Long: `Run the egress proxy with the given configuration.

Settings are taken from flags, then SLUICE_* environment variables (for
example SLUICE_LISTEN, SLUICE_CA_CERT), then the config file. The config file
is watched: changes (and SIGHUP) reload the policy; a file that fails to load
never replaces the running policy.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := viper.New()
			v.SetEnvPrefix("SLUICE")
			v.SetEnvKeyReplacer(strings.NewReplacer("-", "_"))
			v.AutomaticEnv()
			if err := v.BindPFlags(cmd.Flags()); err != nil {
				return err
			}
			return runServe(cmd.Context(), v, cmd.Flags())
		},
	}
	f := cmd.Flags()
	f.StringP("config", "c", "", "configuration file (required)")
	f.String("log-level", "info", "log level: debug, info, warn, error")
	f.String("bind-tenant", "", "bind the proxy listener to this tenant: clients are not asked for credentials (use only on a listener that one sandbox alone can reach)")
	f.Bool("pprof", false, "serve Go profiling endpoints on the admin listener (debugging only)")
	f.Bool("allow-readable-ca-key", false, "accept a CA key file readable by group/other (benchmarks with throwaway CAs only)")
	for _, o := range serverOverrides {
		f.String(o.flag, "", o.usage)
	}
	return cmd
}

// loadConfig reads, decodes and compiles the config file and applies the
// flag and environment overrides.
func loadConfig(path string, v *viper.Viper) (*rules.Config, *rules.Policy, []byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reading config: %w", err)
	}
	cfg, pol, err := configFromBytes(path, data, v)
	if err != nil {
		return nil, nil, nil, err
	}
	return cfg, pol, data, nil
}

func runServe(ctx context.Context, v *viper.Viper, flags *pflag.FlagSet) error {
	path := v.GetString("config")
	if path == "" {
		return &exitError{code: 2, msg: "serve needs --config FILE (or SLUICE_CONFIG); see examples/quickstart"}
	}
	cfg, policy, raw, err := loadConfig(path, v)
	if err != nil {
		return &exitError{code: 2, msg: err.Error()}
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(v.GetString("log-level"))); err != nil {
		return &exitError{code: 2, msg: "invalid --log-level"}
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	sc := proxy.Defaults(cfg.Server)
	if sc.Listen == "" {
		sc.Listen = "127.0.0.1:3128"
	}
	if sc.Admin == "" {
		sc.Admin = "127.0.0.1:9090"
	}

	// Audit first: nothing is served that could not be recorded.
	auditPath := cfg.Audit.Path
	if auditPath == "" {
		auditPath = "-"
	}
	aw, err := audit.Open(audit.Options{
		Path: auditPath, Fsync: cfg.Audit.Fsync, QueueSize: cfg.Audit.QueueSize, OnFailure: cfg.Audit.OnFailure,
		RotateSize: int64(cfg.Audit.RotateSize), RotateAge: time.Duration(cfg.Audit.RotateAge), Compress: cfg.Audit.Compress,
		Logger: logger,
	})
	if err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := aw.Close(cctx); err != nil {
			logger.Error("closing audit log", "err", err)
		}
	}()

	ln, err := listen(sc.Listen)
	if err != nil {
		return fmt.Errorf("proxy listener: %w", err)
	}
	defer ln.Close()
	adminLn, err := net.Listen("tcp", sc.Admin)
	if err != nil {
		return fmt.Errorf("admin listener: %w", err)
	}
	defer adminLn.Close()

	guard, err := netguard.New(netguard.Options{
		Resolver: sc.Resolver, DialTimeout: time.Duration(sc.DialTimeout),
		DenyAddrs: ownAddrs(ln.Addr(), adminLn.Addr()), Logger: logger,
	})
	if err != nil {
		return fmt.Errorf("netguard: %w", err)
	}

	var tokenKey *identity.Key
	if cfg.Identity.TokenKeyFile != "" {
		k, err := identity.LoadKeyFile(cfg.Identity.TokenKeyFile)
		if err != nil {
			return fmt.Errorf("token key: %w", err)
		}
		tokenKey = &k
	}
	auth, err := identity.NewAuthenticator(identity.CredentialsFromTenants(cfg.Tenants), tokenKey, cfg.Identity.Revoked)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}

	roots, err := upstreamRoots(sc.UpstreamCAFile)
	if err != nil {
		return err
	}

	var issuer *certs.Issuer
	if cfg.CA.Cert != "" || cfg.CA.Key != "" {
		allowReadable, _ := flags.GetBool("allow-readable-ca-key")
		ca, err := certs.LoadCAWithOptions(cfg.CA.Cert, cfg.CA.Key, certs.LoadOptions{AllowReadableKey: allowReadable})
		if err != nil {
			return fmt.Errorf("interception CA: %w", err)
		}
		issuer, err = certs.NewIssuer(ca, certs.IssuerOptions{MaxEntries: cfg.CA.LeafCacheMax, Logger: logger})
		if err != nil {
			return fmt.Errorf("interception CA: %w", err)
		}
	}

	var secrets *broker.Broker
	if len(cfg.Secrets) > 0 {
		secrets, err = broker.New(cfg.Broker, cfg.Secrets, broker.Options{Logger: logger})
		if err != nil {
			return fmt.Errorf("secret broker: %w", err)
		}
		if err := secrets.Start(ctx); err != nil {
			return fmt.Errorf("secret broker: %w", err)
		}
	}

	limits, err := newLimiter(policy)
	if err != nil {
		return fmt.Errorf("limits: %w", err)
	}

	var srv *proxy.Server
	m := metrics.New(metrics.Sources{
		AuditQueueDepth: aw.QueueDepth, AuditLost: aw.Lost,
		ActiveConnections: func() int64 {
			if srv == nil {
				return 0
			}
			return srv.ActiveConnections()
		},
	})
	m.SetTenants(tenantIDs(policy))

	opts := proxy.Options{
		Logger: logger, Config: sc, Dialer: guard, Audit: aw, Limits: limits,
		Observer: m, UpstreamRoots: roots, MaxConnections: cfg.Limits.MaxConnections,
	}
	if t := v.GetString("bind-tenant"); t != "" {
		if _, ok := policy.Tenant(t); !ok {
			return &exitError{code: 2, msg: fmt.Sprintf("--bind-tenant %q: no such tenant in the config", t)}
		}
		opts.Bound = &identity.Principal{Tenant: t, Sandbox: "listener:" + ln.Addr().String(), Kind: "listener"}
		logger.Warn("proxy listener is bound to one tenant: clients are not authenticated", "tenant", t, "listen", ln.Addr().String())
	}
	if issuer != nil {
		opts.Certs = issuer
	}
	if secrets != nil {
		opts.Secrets = secrets
	}
	srv, err = proxy.New(opts, policy, auth)
	if err != nil {
		return err
	}

	r := &reloader{
		path: path, v: v, last: raw, log: logger, metrics: m, audit: aw,
		apply: func(cfg *rules.Config, pol *rules.Policy) error {
			a, err := identity.NewAuthenticator(identity.CredentialsFromTenants(cfg.Tenants), tokenKey, cfg.Identity.Revoked)
			if err != nil {
				return err
			}
			if secrets != nil {
				if err := secrets.Update(context.WithoutCancel(ctx), cfg.Secrets); err != nil {
					return err
				}
			} else if len(cfg.Secrets) > 0 {
				return errors.New("secrets were added; restart sluice to start the secret broker")
			}
			if err := limits.update(pol); err != nil {
				return err
			}
			srv.Update(pol, a)
			m.SetTenants(tenantIDs(pol))
			return nil
		},
	}

	ready := func() error {
		if err := aw.Healthy(); err != nil {
			return fmt.Errorf("audit: %w", err)
		}
		if secrets != nil {
			if err := secrets.Ready(); err != nil {
				return err
			}
		}
		return nil
	}
	adminMux := adminHandler(m, ready, issuer != nil, secrets)
	if pp, _ := flags.GetBool("pprof"); pp {
		// Profiling is opt-in: it exposes internals (never secret values,
		// but heap contents can hold them), so it stays off by default.
		adminMux.HandleFunc("/debug/pprof/", pprof.Index)
		adminMux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		logger.Warn("pprof enabled on the admin listener", "admin", adminLn.Addr().String())
	}
	admin := &http.Server{Handler: adminMux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = admin.Serve(adminLn) }()

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	go r.run(runCtx)

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	logger.Info("sluice serving", "listen", ln.Addr().String(), "admin", adminLn.Addr().String(),
		"tenants", len(policy.Tenants()), "policy", policy.Version(), "interception", issuer != nil, "secrets", len(cfg.Secrets))

	select {
	case err := <-errc:
		if err != nil {
			return fmt.Errorf("proxy: %w", err)
		}
		return nil
	case <-ctx.Done():
	}
	logger.Info("shutting down: draining connections", "timeout", time.Duration(sc.ShutdownTimeout).String())
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Duration(sc.ShutdownTimeout))
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		logger.Warn("shutdown", "err", err)
	}
	_ = admin.Shutdown(sctx)
	<-errc
	logger.Info("stopped")
	return nil
}

// resolvePaths makes the config's file paths relative to the config file's
// directory, so a config works the same from any working directory. Flags
// and environment overrides are applied afterwards and stay relative to the
// working directory, as a shell user expects.
func resolvePaths(cfg *rules.Config, dir string) {
	abs := func(p *string) {
		if *p != "" && *p != "-" && !filepath.IsAbs(*p) && !strings.HasPrefix(*p, "unix:") {
			*p = filepath.Join(dir, *p)
		}
	}
	for _, p := range []*string{
		&cfg.Server.UpstreamCAFile, &cfg.Audit.Path, &cfg.CA.Cert, &cfg.CA.Key,
		&cfg.Identity.TokenKeyFile, &cfg.Broker.File.Path,
		&cfg.Broker.Vault.TokenFile, &cfg.Broker.Vault.RoleIDFile, &cfg.Broker.Vault.SecretIDFile,
		&cfg.Broker.Vault.CACert, &cfg.Broker.Vault.ClientCert, &cfg.Broker.Vault.ClientKey,
	} {
		abs(p)
	}
	if path, ok := strings.CutPrefix(cfg.Server.Listen, "unix:"); ok && !filepath.IsAbs(path) {
		cfg.Server.Listen = "unix:" + filepath.Join(dir, path)
	}
}

func listen(addr string) (net.Listener, error) {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		_ = os.Remove(path)
		l, err := net.Listen("unix", path)
		if err != nil {
			return nil, err
		}
		// Only the owner (and the launcher running as it) may connect.
		if err := os.Chmod(path, 0o600); err != nil {
			l.Close()
			return nil, err
		}
		return l, nil
	}
	return net.Listen("tcp", addr)
}

func ownAddrs(addrs ...net.Addr) []netip.AddrPort {
	var out []netip.AddrPort
	for _, a := range addrs {
		if ta, ok := a.(*net.TCPAddr); ok {
			if ap := ta.AddrPort(); ap.IsValid() {
				out = append(out, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
			}
		}
	}
	return out
}

func upstreamRoots(extra string) (*x509.CertPool, error) {
	pool, err := x509.SystemCertPool()
	if err != nil {
		return nil, fmt.Errorf("system roots: %w", err)
	}
	if extra == "" {
		return pool, nil
	}
	pem, err := os.ReadFile(extra)
	if err != nil {
		return nil, fmt.Errorf("upstream CA file: %w", err)
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("upstream CA file %s: no PEM certificates", extra)
	}
	return pool, nil
}

func tenantIDs(p *rules.Policy) []string {
	var ids []string
	for _, t := range p.Tenants() {
		ids = append(ids, t.ID)
	}
	return ids
}

func adminHandler(m *metrics.Metrics, ready func() error, interception bool, secrets *broker.Broker) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintf(w, "ready (policy loaded, interception CA loaded: %t)\n", interception)
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		if secrets != nil {
			m.SecretAges(secrets.Ages())
		}
		m.Handler().ServeHTTP(w, r)
	})
	return mux
}
