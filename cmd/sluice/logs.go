package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/rules"
)

// logFilter holds the reviewer's filter flags, shared by `logs` and `logs summary`.
type logFilter struct {
	tenant, sandbox, kind, decision, reason, host, secret, since, until string
}

func (f *logFilter) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.tenant, "tenant", "", "only this tenant")
	fs.StringVar(&f.sandbox, "sandbox", "", "only this sandbox")
	fs.StringVar(&f.kind, "kind", "", "only this record kind (request, tunnel, auth_failure, launch, run, config_reload, audit_gap, chain)")
	fs.StringVar(&f.decision, "decision", "", "only this decision (allow, deny, would_deny, error)")
	fs.StringVar(&f.reason, "reason", "", "only this reason code")
	fs.StringVar(&f.host, "host", "", "only this destination host; * matches any run of characters (*.github.com)")
	fs.StringVar(&f.secret, "secret", "", "only records that used this secret (by name)")
	fs.StringVar(&f.since, "since", "", "only records at or after this time (a duration like 2h, or RFC 3339)")
	fs.StringVar(&f.until, "until", "", "only records before this time (a duration like 30m, or RFC 3339)")
}

func (f *logFilter) build(now time.Time) (audit.Filter, error) {
	out := audit.Filter{Tenant: f.tenant, Sandbox: f.sandbox, Kind: audit.Kind(f.kind), Decision: audit.Decision(f.decision), Reason: f.reason, Host: f.host, Secret: f.secret}
	kinds := []audit.Kind{audit.KindRequest, audit.KindTunnel, audit.KindAuthFailure, audit.KindLaunch, audit.KindRun, audit.KindConfigReload, audit.KindAuditGap, audit.KindChain}
	if f.kind != "" && !slices.Contains(kinds, out.Kind) {
		return out, fmt.Errorf("--kind %q: not a record kind", f.kind)
	}
	decisions := []audit.Decision{audit.DecisionAllow, audit.DecisionDeny, audit.DecisionWouldDeny, audit.DecisionError}
	if f.decision != "" && !slices.Contains(decisions, out.Decision) {
		return out, fmt.Errorf("--decision %q: want allow, deny, would_deny or error", f.decision)
	}
	chainReasons := []string{audit.ChainStart, audit.ChainSize, audit.ChainAge, audit.ChainTornTail, audit.ChainInvalidTail, audit.ChainFileMissing, audit.ChainWriteError}
	if f.reason != "" && !rules.Reason(f.reason).Valid() && !slices.Contains(chainReasons, f.reason) {
		return out, fmt.Errorf("--reason %q: not a reason code (see docs/audit.md)", f.reason)
	}
	var err error
	if out.Since, err = audit.ParseTimeBound(f.since, now); err != nil {
		return out, fmt.Errorf("--since: %w", err)
	}
	if out.Until, err = audit.ParseTimeBound(f.until, now); err != nil {
		return out, fmt.Errorf("--until: %w", err)
	}
	return out, nil
}

// auditFiles resolves the files to read: the named paths, or the audit path
// of the --config file (or SLUICE_CONFIG), each expanded to its rotated set.
func auditFiles(configPath string, args []string) ([]string, error) {
	if len(args) == 0 {
		p, err := auditPathFromConfig(configPath)
		if err != nil {
			return nil, err
		}
		args = []string{p}
	}
	return audit.ResolveSet(args)
}

func auditPathFromConfig(configPath string) (string, error) {
	if configPath == "" {
		configPath = os.Getenv("SLUICE_CONFIG")
	}
	if configPath == "" {
		return "", errors.New("name the audit log files, or give --config FILE (or SLUICE_CONFIG) to use its audit.path")
	}
	data, err := os.ReadFile(configPath)
	if err != nil {
		return "", fmt.Errorf("reading config: %w", err)
	}
	cfg, err := rules.Parse(data, configPath)
	if err != nil {
		return "", err
	}
	p := cfg.Audit.Path
	switch {
	case p == "" || p == "-":
		return "", fmt.Errorf("%s: audit.path is stdout; name the files your log pipeline stored", configPath)
	case !filepath.IsAbs(p):
		p = filepath.Join(filepath.Dir(configPath), p)
	}
	return p, nil
}

func newLogsCmd() *cobra.Command {
	var (
		f          logFilter
		configPath string
		asJSON     bool
		follow     bool
	)
	cmd := &cobra.Command{
		Use:   "logs [PATH...]",
		Short: "List audit records, filtered; summarise or verify them",
		Long: `List audit records as a table (or --json lines), oldest first.

A path to the active log (e.g. /var/log/sluice/audit.log) also reads its rotated
and compressed files, in order. Without paths, the audit.path of --config is used.
--follow keeps reading the live log across rotations until interrupted.`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			filter, err := f.build(time.Now())
			if err != nil {
				return &exitError{code: 2, msg: err.Error()}
			}
			out := cmd.OutOrStdout()
			var table *audit.Table
			var line []byte
			emit := func(r *audit.Record, _ audit.Location) error {
				if !filter.Match(r) {
					return nil
				}
				if asJSON {
					line = audit.AppendJSON(line[:0], r)
					_, err := out.Write(line)
					return err
				}
				if table == nil {
					table = audit.NewTable(out)
				}
				return table.Write(r)
			}
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			if follow {
				path, err := followPath(configPath, args)
				if err != nil {
					return &exitError{code: 2, msg: err.Error()}
				}
				return audit.Follow(ctx, path, 0, emit)
			}
			files, err := auditFiles(configPath, args)
			if err != nil {
				return &exitError{code: 2, msg: err.Error()}
			}
			st, err := audit.Scan(ctx, files, emit)
			if err != nil {
				return err
			}
			reportSkipped(cmd.ErrOrStderr(), st)
			return nil
		},
	}
	fs := cmd.Flags()
	f.register(fs)
	fs.StringVarP(&configPath, "config", "c", "", "configuration file whose audit.path to read")
	fs.BoolVar(&asJSON, "json", false, "print JSON lines (the records as written)")
	fs.BoolVarP(&follow, "follow", "f", false, "keep reading the live log (across rotations) until interrupted")
	cmd.AddCommand(newLogsSummaryCmd(), newLogsVerifyCmd())
	return cmd
}

func followPath(configPath string, args []string) (string, error) {
	switch len(args) {
	case 0:
		return auditPathFromConfig(configPath)
	case 1:
		return args[0], nil
	}
	return "", errors.New("--follow reads one live log: give its path (or --config)")
}

func reportSkipped(w io.Writer, st audit.ScanStats) {
	if st.Malformed > 0 || st.Torn > 0 {
		fmt.Fprintf(w, "sluice: skipped %d malformed lines and %d partial final lines; run `sluice logs verify`\n", st.Malformed, st.Torn)
	}
}

func newLogsSummaryCmd() *cobra.Command {
	var (
		f          logFilter
		configPath string
		asJSON     bool
		top        int
	)
	cmd := &cobra.Command{
		Use:   "summary [PATH...]",
		Short: "Summarise audit records: traffic per tenant, denials, secrets, exfiltration attempts",
		Args:  cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			filter, err := f.build(time.Now())
			if err != nil {
				return &exitError{code: 2, msg: err.Error()}
			}
			if top <= 0 {
				return &exitError{code: 2, msg: "--top must be positive"}
			}
			files, err := auditFiles(configPath, args)
			if err != nil {
				return &exitError{code: 2, msg: err.Error()}
			}
			z := audit.NewSummarizer(top)
			st, err := audit.Scan(cmd.Context(), files, func(r *audit.Record, _ audit.Location) error {
				if filter.Match(r) {
					z.Add(r)
				}
				return nil
			})
			if err != nil {
				return err
			}
			reportSkipped(cmd.ErrOrStderr(), st)
			s := z.Result()
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(&s)
			}
			return s.WriteText(cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	f.register(fs)
	fs.StringVarP(&configPath, "config", "c", "", "configuration file whose audit.path to read")
	fs.BoolVar(&asJSON, "json", false, "print the summary as JSON")
	fs.IntVar(&top, "top", 10, "how many entries each ranking shows")
	return cmd
}

func newLogsVerifyCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "verify PATH...",
		Short: "Verify the hash chain of an audit log set (exit status 1 if it is broken)",
		Long: `Verify the hash chain across an audit log set. A path to the active log also
verifies its rotated and compressed files. Reports OK with the record count and the
last hash (keep it elsewhere to detect a cut-off end), or the first modified, deleted,
inserted or reordered record with its file and line. A partial final line left by a
crash is reported but is not tampering.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			files, err := audit.ResolveSet(args)
			if err != nil {
				return &exitError{code: 2, msg: err.Error()}
			}
			rep, err := audit.VerifyContext(cmd.Context(), files)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			for _, n := range rep.Notes {
				fmt.Fprintln(out, "note:", n)
			}
			if rep.TornTail != nil {
				fmt.Fprintf(out, "note: %s: partial final line (a crash during a write; that record was never acknowledged)\n", rep.TornTail)
			}
			if !rep.OK() {
				fmt.Fprintf(out, "FAILED after %d good records: %s\n", rep.Records, rep.Problem)
				return &exitError{code: 1, msg: "audit log verification failed"}
			}
			fmt.Fprintf(out, "OK: %d records in %d files, seq %d to %d, last hash %s\n",
				rep.Records, len(files), rep.FirstSeq, rep.LastSeq, rep.LastHash)
			return nil
		},
	}
}
