package broker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/vault/api"
	"github.com/hashicorp/vault/api/auth/approle"

	"github.com/sluicehq/sluice/rules"
)

// Vault client defaults for unset VaultConfig fields.
const (
	DefaultVaultTimeout    = 10 * time.Second
	DefaultVaultMaxRetries = 2
	maxCredentialFile      = 4 << 10
	reloginMinBackoff      = 200 * time.Millisecond
	reloginMaxBackoff      = 30 * time.Second
)

// VaultSource reads KV v2 secrets from HashiCorp Vault.
//
// spec.Path is the full KV v2 API path, "<mount>/data/<name>" (for the secret
// the CLI calls secret/ci/github, that is secret/data/ci/github); spec.Field
// is the key inside the version's data, whose value must be a string.
//
// Auth is "token" (broker.vault.token_file, else VAULT_TOKEN) or "approle"
// (role id and secret id files; with secret_id_wrapped the secret id file
// holds a response-wrapping token that is unwrapped first). Renewable tokens
// are kept alive with a LifetimeWatcher while Run runs; when renewal ends
// (max TTL, or failure) the source logs in again with bounded backoff, and a
// permission-denied read also triggers one re-login. A wrapping token is
// single-use: re-login with secret_id_wrapped needs a fresh one in the file
// (as Vault Agent or an orchestrator would place), else it fails and is
// retried until the file is refreshed.
//
// Unset fields fall back to the VAULT_* environment (VAULT_ADDR,
// VAULT_CACERT, VAULT_NAMESPACE, ...). The client never uses a proxy from the
// environment: Vault is reached directly, not through the egress guard.
type VaultSource struct {
	cfg     rules.VaultConfig
	log     *slog.Logger
	client  *api.Client
	timeout time.Duration

	loginMu sync.Mutex
	authed  atomic.Bool
	authCh  chan *api.Secret // latest login, for Run to watch (capacity 1, newest wins)
}

// NewVaultSource builds the client; it does not contact Vault.
func NewVaultSource(cfg rules.VaultConfig, log *slog.Logger) (*VaultSource, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	switch cfg.Auth {
	case "", "token":
		cfg.Auth = "token"
	case "approle":
		if cfg.RoleIDFile == "" || cfg.SecretIDFile == "" {
			return nil, errors.New("broker: vault: auth approle needs broker.vault.role_id_file and broker.vault.secret_id_file")
		}
	default:
		return nil, fmt.Errorf("broker: vault: auth %q: want token or approle", cfg.Auth)
	}
	if cfg.AppRoleMount == "" {
		cfg.AppRoleMount = "approle"
	}
	timeout := cfg.Timeout.Std()
	if timeout <= 0 {
		timeout = DefaultVaultTimeout
	}
	retries := cfg.MaxRetries
	if retries <= 0 {
		retries = DefaultVaultMaxRetries
	}

	conf := api.DefaultConfig() // reads VAULT_ADDR, VAULT_CACERT, ...
	if conf.Error != nil {
		return nil, fmt.Errorf("broker: vault: client config from environment: %w", conf.Error)
	}
	if cfg.Address != "" {
		conf.Address = cfg.Address
	}
	if cfg.CACert != "" || cfg.ClientCert != "" || cfg.ClientKey != "" || cfg.TLSServerName != "" {
		if err := conf.ConfigureTLS(&api.TLSConfig{
			CACert:        cfg.CACert,
			ClientCert:    cfg.ClientCert,
			ClientKey:     cfg.ClientKey,
			TLSServerName: cfg.TLSServerName,
		}); err != nil {
			return nil, fmt.Errorf("broker: vault: TLS settings: %w", err)
		}
	}
	tr, ok := conf.HttpClient.Transport.(*http.Transport)
	if !ok {
		return nil, fmt.Errorf("broker: vault: unexpected transport %T", conf.HttpClient.Transport)
	}
	// Never through HTTP(S)_PROXY or VAULT_HTTP_PROXY: the token must go
	// straight to Vault, not to whatever the environment names.
	tr.Proxy = nil
	conf.Timeout = timeout
	conf.MaxRetries = retries
	conf.MinRetryWait = 250 * time.Millisecond
	conf.MaxRetryWait = time.Second

	client, err := api.NewClient(conf)
	if err != nil {
		return nil, fmt.Errorf("broker: vault: %w", err)
	}
	// NewClient picked up VAULT_TOKEN; the token is chosen at login instead.
	client.ClearToken()
	if cfg.Namespace != "" {
		client.SetNamespace(cfg.Namespace)
	}
	return &VaultSource{
		cfg:     cfg,
		log:     log,
		client:  client,
		timeout: timeout,
		authCh:  make(chan *api.Secret, 1),
	}, nil
}

// Name implements Source.
func (*VaultSource) Name() string { return "vault" }

// Fetch implements Source.
func (v *VaultSource) Fetch(ctx context.Context, spec rules.SecretSpec) (Value, error) {
	if err := validateKVPath(spec.Path); err != nil {
		return Value{}, fmt.Errorf("broker: vault: %w", err)
	}
	if err := v.ensureAuth(ctx); err != nil {
		return Value{}, err
	}
	val, err := v.read(ctx, spec)
	if isPermissionDenied(err) && !v.tokenValid(ctx) {
		// The token was revoked, expired, or Vault restarted without it: log
		// in once more before giving up. (A valid token denied one path is a
		// policy problem; logging in again would not help and, with a
		// single-use wrapped secret id, would lose the login for every secret.)
		v.authed.Store(false)
		if err := v.ensureAuth(ctx); err != nil {
			return Value{}, err
		}
		val, err = v.read(ctx, spec)
	}
	return val, err
}

// tokenValid reports whether Vault still accepts the client's token.
func (v *VaultSource) tokenValid(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, v.timeout)
	defer cancel()
	_, err := v.client.Auth().Token().LookupSelfWithContext(ctx)
	return err == nil
}

func (v *VaultSource) read(ctx context.Context, spec rules.SecretSpec) (Value, error) {
	ctx, cancel := context.WithTimeout(ctx, v.timeout)
	defer cancel()
	sec, err := v.client.Logical().ReadWithContext(ctx, spec.Path)
	if err != nil {
		return Value{}, fmt.Errorf("broker: vault: read %s: %w", spec.Path, sanitizeErr(err, v.client.Token()))
	}
	if sec == nil {
		return Value{}, fmt.Errorf("broker: vault: read %s: no secret at this path", spec.Path)
	}
	data, ok := sec.Data["data"].(map[string]any)
	if !ok || data == nil {
		return Value{}, fmt.Errorf("broker: vault: read %s: no KV v2 data (a deleted or destroyed version, or not a KV v2 mount)", spec.Path)
	}
	raw, ok := data[spec.Field]
	if !ok {
		return Value{}, fmt.Errorf("broker: vault: read %s: no field %q", spec.Path, spec.Field)
	}
	s, ok := raw.(string)
	if !ok {
		return Value{}, fmt.Errorf("broker: vault: read %s: field %q is a %T, want a string", spec.Path, spec.Field, raw)
	}
	if s == "" {
		return Value{}, fmt.Errorf("broker: vault: read %s: field %q is empty", spec.Path, spec.Field)
	}
	return NewValue([]byte(s)), nil
}

func isPermissionDenied(err error) bool {
	var re *api.ResponseError
	return errors.As(err, &re) && re.StatusCode == http.StatusForbidden
}

// ensureAuth logs in unless the client holds a token believed valid.
func (v *VaultSource) ensureAuth(ctx context.Context) error {
	if v.authed.Load() {
		return nil
	}
	v.loginMu.Lock()
	defer v.loginMu.Unlock()
	if v.authed.Load() {
		return nil
	}
	sec, err := v.login(ctx)
	if err != nil {
		v.client.ClearToken()
		return err
	}
	v.authed.Store(true)
	select { // newest login wins: drop an unwatched older one
	case <-v.authCh:
	default:
	}
	v.authCh <- sec
	return nil
}

func (v *VaultSource) login(ctx context.Context) (*api.Secret, error) {
	ctx, cancel := context.WithTimeout(ctx, v.timeout)
	defer cancel()
	if v.cfg.Auth == "token" {
		return v.loginToken(ctx)
	}
	return v.loginAppRole(ctx)
}

func (v *VaultSource) loginToken(ctx context.Context) (*api.Secret, error) {
	var tok, from string
	if v.cfg.TokenFile != "" {
		t, err := readCredentialFile(v.cfg.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("broker: vault: token: %w", err)
		}
		tok, from = t, v.cfg.TokenFile
	} else {
		tok, from = strings.TrimSpace(os.Getenv(api.EnvVaultToken)), api.EnvVaultToken
	}
	if tok == "" {
		return nil, fmt.Errorf("broker: vault: token auth: no token (set broker.vault.token_file or %s)", api.EnvVaultToken)
	}
	v.client.SetToken(tok)
	// lookup-self checks the token and tells whether it can be renewed.
	self, err := v.client.Auth().Token().LookupSelfWithContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("broker: vault: token from %s: lookup-self: %w", from, sanitizeErr(err, tok))
	}
	ttl, _ := self.TokenTTL()
	renewable, _ := self.TokenIsRenewable()
	v.log.Info("broker: vault token accepted", "from", from, "ttl", ttl.String(), "renewable", renewable)
	return &api.Secret{Auth: &api.SecretAuth{ClientToken: tok, Renewable: renewable, LeaseDuration: int(ttl / time.Second)}}, nil
}

func (v *VaultSource) loginAppRole(ctx context.Context) (*api.Secret, error) {
	roleID, err := readCredentialFile(v.cfg.RoleIDFile)
	if err != nil {
		return nil, fmt.Errorf("broker: vault: approle role id: %w", err)
	}
	secretID, err := readCredentialFile(v.cfg.SecretIDFile)
	if err != nil {
		return nil, fmt.Errorf("broker: vault: approle secret id: %w", err)
	}
	opts := []approle.LoginOption{approle.WithMountPath(v.cfg.AppRoleMount)}
	if v.cfg.SecretIDWrapped {
		opts = append(opts, approle.WithWrappingToken())
	}
	auth, err := approle.NewAppRoleAuth(roleID, &approle.SecretID{FromString: secretID}, opts...)
	if err != nil {
		return nil, fmt.Errorf("broker: vault: approle: %w", sanitizeErr(err, roleID, secretID))
	}
	// Unwrapping uses the wrapping token as the request token when none is set.
	v.client.ClearToken()
	sec, err := v.client.Auth().Login(ctx, auth)
	if err != nil {
		return nil, fmt.Errorf("broker: vault: approle login (mount %q, wrapped secret id %v): %w",
			v.cfg.AppRoleMount, v.cfg.SecretIDWrapped, sanitizeErr(err, roleID, secretID, v.client.Token()))
	}
	v.log.Info("broker: vault approle login", "mount", v.cfg.AppRoleMount,
		"ttl", (time.Duration(sec.Auth.LeaseDuration) * time.Second).String(), "renewable", sec.Auth.Renewable)
	return sec, nil
}

// readCredentialFile reads a small file holding one credential. Its content
// never appears in an error.
func readCredentialFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	buf := make([]byte, maxCredentialFile+1)
	n, err := io.ReadFull(f, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("read %s: %w", path, err)
	}
	if n > maxCredentialFile {
		return "", fmt.Errorf("%s: larger than %d bytes", path, maxCredentialFile)
	}
	s := strings.TrimSpace(string(buf[:n]))
	clear(buf)
	if s == "" {
		return "", fmt.Errorf("%s: empty", path)
	}
	return s, nil
}

// Run implements runner: it keeps the current login token alive with a
// LifetimeWatcher and logs in again when the watcher gives up.
func (v *VaultSource) Run(ctx context.Context, _ func()) {
	var cur *api.Secret
	for {
		if cur == nil {
			select {
			case <-ctx.Done():
				return
			case cur = <-v.authCh:
			}
		}
		if cur.Auth == nil || !cur.Auth.Renewable || cur.Auth.LeaseDuration <= 0 {
			// Root or non-renewable token: nothing to renew. A 403 on read
			// makes Fetch log in again.
			cur = nil
			continue
		}
		cur = v.watch(ctx, cur)
	}
}

// watch renews sec until its watcher ends, then logs in again. It returns the
// next login to watch, or nil when ctx has ended.
func (v *VaultSource) watch(ctx context.Context, sec *api.Secret) *api.Secret {
	w, err := v.client.NewLifetimeWatcher(&api.LifetimeWatcherInput{Secret: sec})
	if err != nil {
		v.log.Warn("broker: vault token cannot be watched; re-login on demand", "err", err)
		return v.waitLogin(ctx)
	}
	done := make(chan struct{})
	go func() { defer close(done); w.Start() }()
	stop := func() { w.Stop(); <-done }
	for {
		select {
		case <-ctx.Done():
			stop()
			return nil
		case next := <-v.authCh:
			// Fetch logged in again meanwhile (e.g. after a 403): watch that.
			stop()
			return next
		case r := <-w.RenewCh():
			if r != nil && r.Secret != nil && r.Secret.Auth != nil {
				v.log.Debug("broker: vault token renewed", "ttl", (time.Duration(r.Secret.Auth.LeaseDuration) * time.Second).String())
			}
		case err := <-w.DoneCh():
			stop()
			if err != nil {
				v.log.Warn("broker: vault token renewal failed; logging in again", "err", sanitizeErr(err, sec.Auth.ClientToken))
			} else {
				v.log.Info("broker: vault token at end of its lifetime; logging in again")
			}
			v.authed.Store(false)
			return v.relogin(ctx)
		}
	}
}

// relogin logs in with exponential backoff (200ms doubling, at most 30s
// between attempts) until it succeeds or ctx ends.
func (v *VaultSource) relogin(ctx context.Context) *api.Secret {
	backoff := reloginMinBackoff
	for {
		err := v.ensureAuth(ctx)
		if err == nil {
			return v.waitLogin(ctx)
		}
		v.log.Warn("broker: vault login failed; will retry", "err", err, "retry_in", backoff.String())
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, reloginMaxBackoff)
	}
}

// waitLogin returns the next published login, or nil when ctx ends.
func (v *VaultSource) waitLogin(ctx context.Context) *api.Secret {
	select {
	case <-ctx.Done():
		return nil
	case s := <-v.authCh:
		return s
	}
}

// validateKVPath checks that p is a KV v2 API path "<mount>/data/<name>".
func validateKVPath(p string) error {
	hint := fmt.Sprintf("vault path %q: want the KV v2 API path <mount>/data/<name>, e.g. secret/data/ci/github", p)
	if p == "" || strings.HasPrefix(p, "/") || strings.HasSuffix(p, "/") {
		return errors.New(hint)
	}
	segs := strings.Split(p, "/")
	for _, s := range segs {
		if s == "" || s == "." || s == ".." {
			return errors.New(hint)
		}
	}
	for i := 1; i < len(segs)-1; i++ {
		if segs[i] == "data" {
			return nil
		}
	}
	return errors.New(hint)
}
