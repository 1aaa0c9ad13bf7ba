package audit

import "time"

// SchemaVersion is the value of every record's "v" field. It changes only when a
// field changes meaning or the hashed encoding changes.
const SchemaVersion = 1

// Kind says what a record describes.
type Kind string

// Record kinds.
const (
	KindRequest      Kind = "request"       // one HTTP request (plain, or inside an intercepted tunnel)
	KindTunnel       Kind = "tunnel"        // one CONNECT tunnel
	KindAuthFailure  Kind = "auth_failure"  // a client that failed to identify itself
	KindLaunch       Kind = "launch"        // a sandbox was started
	KindRun          Kind = "run"           // a sandbox finished (exit, limits, duration)
	KindConfigReload Kind = "config_reload" // the policy changed (or a reload failed)
	KindAuditGap     Kind = "audit_gap"     // records could not be written for a while; says how many
	KindChain        Kind = "chain"         // first record of every file: links it to the previous file
)

// Decision is the outcome of a policy decision.
type Decision string

// Decisions.
const (
	DecisionAllow     Decision = "allow"
	DecisionDeny      Decision = "deny"
	DecisionWouldDeny Decision = "would_deny" // report mode: denied by policy, allowed anyway
	DecisionError     Decision = "error"
)

// Chain header reasons: why a new file was started.
const (
	ChainStart       = "start"        // a fresh log with no earlier file
	ChainSize        = "rotate_size"  // the previous file reached the size limit
	ChainAge         = "rotate_age"   // the previous file reached the age limit
	ChainTornTail    = "torn_tail"    // the previous file ends in a partial line (crash mid-write)
	ChainInvalidTail = "invalid_tail" // the previous file's last lines do not verify; chain restarts from the last good one
	ChainFileMissing = "file_missing" // the file being written was removed or replaced under the writer
	ChainWriteError  = "write_error"  // a failed write could not be rolled back; the old file is left as is
)

// Record is one audit event, written as one JSON object per line. Field names
// are the JSON names; empty fields are omitted. No field ever holds a
// credential, token, secret value or header value: secrets are named, paths
// carry no query string, and Message is short and sanitised by the writer.
type Record struct {
	V        int       `json:"v"`
	Time     time.Time `json:"time"`
	Kind     Kind      `json:"kind"`
	ID       string    `json:"id,omitempty"`
	TunnelID string    `json:"tunnel_id,omitempty"`
	Tenant   string    `json:"tenant,omitempty"`
	Sandbox  string    `json:"sandbox,omitempty"`
	Client   string    `json:"client,omitempty"`

	Method string `json:"method,omitempty"`
	Scheme string `json:"scheme,omitempty"`
	Host   string `json:"host,omitempty"`
	Port   int    `json:"port,omitempty"`
	Path   string `json:"path,omitempty"`

	Decision Decision `json:"decision,omitempty"`
	Mode     string   `json:"mode,omitempty"`
	Rule     string   `json:"rule,omitempty"`
	Reason   string   `json:"reason,omitempty"`

	Status     int     `json:"status,omitempty"`
	BytesIn    int64   `json:"bytes_in,omitempty"`  // client → upstream
	BytesOut   int64   `json:"bytes_out,omitempty"` // upstream → client
	DurationMS float64 `json:"duration_ms,omitempty"`
	UpstreamIP string  `json:"upstream_ip,omitempty"`

	Intercepted        bool     `json:"intercepted,omitempty"`
	Secrets            []string `json:"secrets,omitempty"`
	ReflectionScrubbed bool     `json:"reflection_scrubbed,omitempty"`
	Exfiltration       bool     `json:"exfiltration,omitempty"`
	Policy             string   `json:"policy,omitempty"`
	Message            string   `json:"message,omitempty"`

	// Launcher fields.
	Command  []string `json:"command,omitempty"`
	Limits   *Limits  `json:"limits,omitempty"`
	ExitCode *int     `json:"exit_code,omitempty"` // a pointer because 0 is an exit code
	KilledBy string   `json:"killed_by,omitempty"` // timeout | memory | signal
	Launcher string   `json:"launcher,omitempty"`  // who launched: "uid:user"

	// Gap and chain fields, set by the writer.
	Lost     uint64 `json:"lost,omitempty"`      // audit_gap: records that were not written
	PrevFile string `json:"prev_file,omitempty"` // chain: base name of the file this one continues

	Seq  uint64 `json:"seq"`
	Prev string `json:"prev"`
	Hash string `json:"hash"`
}

// Limits are the resource limits a sandbox was launched with. Zero means unset.
type Limits struct {
	MemoryBytes    int64   `json:"memory_bytes,omitempty"`
	PIDs           int64   `json:"pids,omitempty"`
	CPUs           float64 `json:"cpus,omitempty"`
	TimeoutMS      int64   `json:"timeout_ms,omitempty"`
	WorkspaceBytes int64   `json:"workspace_bytes,omitempty"`
	TmpBytes       int64   `json:"tmp_bytes,omitempty"`
	OpenFiles      int64   `json:"open_files,omitempty"`
}
