package rules

// This file is the schema of sluice's configuration file. Every section is
// decoded strictly: an unknown key, a wrong type or a value that would need weak
// typing is an error that names the key path and line. Host names and header
// names only ever appear as values, never as map keys, because viper splits keys
// on dots and lower-cases them.

// Config is the whole configuration file. Server-level sections are plain data;
// cmd/sluice overlays flags and SLUICE_* environment variables on them.
type Config struct {
	Version  int            `mapstructure:"version"`
	Server   ServerConfig   `mapstructure:"server"`
	Audit    AuditConfig    `mapstructure:"audit"`
	CA       CAConfig       `mapstructure:"ca"`
	Identity IdentityConfig `mapstructure:"identity"`
	Broker   BrokerConfig   `mapstructure:"broker"`
	Limits   GlobalLimits   `mapstructure:"limits"`
	Secrets  []SecretSpec   `mapstructure:"secrets"`
	Tenants  []TenantSpec   `mapstructure:"tenants"`

	// Set by Parse so that Compile's errors can name file and line too.
	source string
	lines  map[string]int
}

// ServerConfig holds listener addresses, timeouts and size bounds. Durations are
// Go duration strings ("30s"); sizes accept "64KiB", "5MB" or plain integers.
type ServerConfig struct {
	Listen            string   `mapstructure:"listen"`              // proxy listener, e.g. 127.0.0.1:3128, or unix:/path
	Admin             string   `mapstructure:"admin"`               // admin listener (healthz, readyz, metrics); loopback by default
	Resolver          string   `mapstructure:"resolver"`            // DNS server host:port; empty = system resolver
	UpstreamCAFile    string   `mapstructure:"upstream_ca_file"`    // extra CA trusted for upstream TLS (added to system roots)
	ReadHeaderTimeout Duration `mapstructure:"read_header_timeout"` // default 10s
	IdleTimeout       Duration `mapstructure:"idle_timeout"`        // client keep-alive idle, default 60s
	TunnelIdleTimeout Duration `mapstructure:"tunnel_idle_timeout"` // default 5m
	MaxTunnelLifetime Duration `mapstructure:"max_tunnel_lifetime"` // default 1h
	DialTimeout       Duration `mapstructure:"dial_timeout"`        // default 10s
	UpstreamTimeout   Duration `mapstructure:"upstream_timeout"`    // response header timeout, default 60s
	MaxHeaderBytes    Size     `mapstructure:"max_header_bytes"`    // default 64KiB
	MaxHeaderCount    int      `mapstructure:"max_header_count"`    // default 100
	ShutdownTimeout   Duration `mapstructure:"shutdown_timeout"`    // default 30s
}

// AuditConfig says where audit records go and what happens when they cannot be written.
type AuditConfig struct {
	Path       string   `mapstructure:"path"`        // file path, or "-" for stdout
	OnFailure  string   `mapstructure:"on_failure"`  // "closed" (default: refuse traffic) | "open" (count losses)
	Fsync      string   `mapstructure:"fsync"`       // "always" | "interval" (default) | "never"
	QueueSize  int      `mapstructure:"queue_size"`  // bounded queue, default 4096
	RotateSize Size     `mapstructure:"rotate_size"` // 0 = no size rotation
	RotateAge  Duration `mapstructure:"rotate_age"`  // 0 = no age rotation
	Compress   bool     `mapstructure:"compress"`    // gzip rotated files
}

// CAConfig locates the interception CA (ECDSA P-256, created by `sluice ca init`).
type CAConfig struct {
	Cert         string `mapstructure:"cert"`
	Key          string `mapstructure:"key"`
	LeafCacheMax int    `mapstructure:"leaf_cache_max"` // default 1024
}

// IdentityConfig configures how sandboxes authenticate to the proxy.
type IdentityConfig struct {
	TokenKeyFile string   `mapstructure:"token_key_file"` // HMAC key for minted sandbox tokens
	Revoked      []string `mapstructure:"revoked"`        // revoked sandbox ids or token ids
}

// BrokerConfig configures the secret sources.
type BrokerConfig struct {
	Refresh      Duration    `mapstructure:"refresh"`       // background refresh interval, default 1m
	MaxStaleness Duration    `mapstructure:"max_staleness"` // default for secrets, default 10m
	Vault        VaultConfig `mapstructure:"vault"`
	File         FileSource  `mapstructure:"file"`
}

// VaultConfig configures the vault source. Unset fields fall back to the usual
// VAULT_* environment variables (VAULT_ADDR, VAULT_TOKEN, VAULT_NAMESPACE, ...).
type VaultConfig struct {
	Address         string   `mapstructure:"address"`
	Namespace       string   `mapstructure:"namespace"`
	Auth            string   `mapstructure:"auth"`              // "token" | "approle"
	TokenFile       string   `mapstructure:"token_file"`        // auth: token
	RoleIDFile      string   `mapstructure:"role_id_file"`      // auth: approle
	SecretIDFile    string   `mapstructure:"secret_id_file"`    // auth: approle
	SecretIDWrapped bool     `mapstructure:"secret_id_wrapped"` // secret id file holds a response-wrapping token
	AppRoleMount    string   `mapstructure:"approle_mount"`     // default "approle"
	CACert          string   `mapstructure:"ca_cert"`
	ClientCert      string   `mapstructure:"client_cert"`
	ClientKey       string   `mapstructure:"client_key"`
	TLSServerName   string   `mapstructure:"tls_server_name"`
	Timeout         Duration `mapstructure:"timeout"`     // per call, default 10s
	MaxRetries      int      `mapstructure:"max_retries"` // default 2
}

// FileSource is a local YAML or JSON file of secret name → value, kept outside any sandbox.
type FileSource struct {
	Path string `mapstructure:"path"`
}

// GlobalLimits cap the whole process regardless of tenant.
type GlobalLimits struct {
	MaxConnections        int `mapstructure:"max_connections"`
	MaxTunnels            int `mapstructure:"max_tunnels"`
	AuthFailuresPerMinute int `mapstructure:"auth_failures_per_minute"` // per source address, default 30
}

// SecretSpec declares a secret: where it comes from and where it may ever be sent.
type SecretSpec struct {
	Name         string    `mapstructure:"name"`
	Source       string    `mapstructure:"source"` // "vault" | "file"
	Path         string    `mapstructure:"path"`   // vault: KV v2 path, e.g. secret/data/ci/github
	Field        string    `mapstructure:"field"`  // vault: field within the KV v2 data
	Key          string    `mapstructure:"key"`    // file: key in the file (default: name)
	Hosts        []string  `mapstructure:"hosts"`  // exact hosts it may be sent to
	Placeholder  string    `mapstructure:"placeholder"`
	MaxStaleness Duration  `mapstructure:"max_staleness"`
	Limits       *RateSpec `mapstructure:"limits"` // budget shared by every rule that injects it
}

// TenantSpec is one tenant's credentials, mode, rules and limits.
type TenantSpec struct {
	ID          string           `mapstructure:"id"`
	Mode        string           `mapstructure:"mode"` // "enforce" (default) | "report"
	Credentials []CredentialSpec `mapstructure:"credentials"`
	AllowCIDRs  []string         `mapstructure:"allow_private_cidrs"` // private ranges this tenant may reach
	Allow       []RuleSpec       `mapstructure:"allow"`
	Deny        []RuleSpec       `mapstructure:"deny"`
	Limits      *TenantLimits    `mapstructure:"limits"`
}

// CredentialSpec is a static per-tenant credential, stored hashed (`sluice token hash`).
type CredentialSpec struct {
	Name string `mapstructure:"name"`
	Hash string `mapstructure:"hash" sluice:"sensitive"`
}

// RuleSpec is one allow or deny rule.
type RuleSpec struct {
	ID             string       `mapstructure:"id"`      // optional; default "<tenant>/allow/<n>" or "<tenant>/deny/<n>"
	Host           string       `mapstructure:"host"`    // exact, "*.example.com" (subdomains only), or an IP literal
	Ports          []int        `mapstructure:"ports"`   // default [80, 443]
	Methods        []string     `mapstructure:"methods"` // default: any
	Paths          []string     `mapstructure:"paths"`   // "/exact", "/prefix/*" (one segment), "/prefix/**" (any depth)
	Inspect        bool         `mapstructure:"inspect"` // force interception of CONNECT tunnels
	Inject         []InjectSpec `mapstructure:"inject"`
	InjectOverHTTP bool         `mapstructure:"inject_over_http"` // allow injection over cleartext HTTP (off by default)
	Limits         *RateSpec    `mapstructure:"limits"`
}

// InjectSpec sets one header from a template that names secrets: "Bearer ${secret:github}".
type InjectSpec struct {
	Header string `mapstructure:"header"`
	Value  string `mapstructure:"value" sluice:"sensitive"` // never echoed in errors: a pasted credential must not reach a log
}

// TenantLimits bound one tenant.
type TenantLimits struct {
	RequestsPerSecond     float64 `mapstructure:"requests_per_second"`
	Burst                 int     `mapstructure:"burst"`
	MaxConnections        int     `mapstructure:"max_connections"`
	MaxTunnels            int     `mapstructure:"max_tunnels"`
	EgressBytesPerSecond  Size    `mapstructure:"egress_bytes_per_second"`
	IngressBytesPerSecond Size    `mapstructure:"ingress_bytes_per_second"`
}

// RateSpec is a request rate with burst, for a rule or a secret.
type RateSpec struct {
	RequestsPerSecond float64 `mapstructure:"requests_per_second"`
	Burst             int     `mapstructure:"burst"`
}
