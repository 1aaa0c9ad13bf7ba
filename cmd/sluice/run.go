package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/identity"
	"github.com/sluicehq/sluice/internal/sandbox"
	"github.com/sluicehq/sluice/rules"
)

func newRunCmd() *cobra.Command {
	var (
		tenant, proxy, workspace, key, caBundle, configPath, auditPath, root string
		memory, disk, tmpSize, stateDir                                      string
		keep, allowNoLandlock, sweep                                         bool
		timeout                                                              time.Duration
		cpus                                                                 float64
		pids, files                                                          int64
		env                                                                  []string
	)
	cmd := &cobra.Command{
		Use:   "run --tenant T [flags] -- CMD [ARGS...]",
		Short: "Run a command in a sandbox whose only way out is the proxy",
		Long: `Run a command in Linux namespaces with a read-only root, a capped workspace,
no network but a relay to the proxy at 127.0.0.1:3128 (HTTP_PROXY and friends
carry a fresh sandbox credential), resource limits, no_new_privs, Landlock and
seccomp. sluice exits with the command's status, or 124 on timeout, 137 when
the memory limit killed it, 125 when the sandbox could not be started.
See docs/launcher.md.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			stateRoot := sandbox.DefaultStateRoot()
			if stateDir != "" {
				stateRoot = stateDir
			}
			if sweep {
				n, err := sandbox.Sweep(ctx, stateRoot)
				fmt.Fprintf(cmd.ErrOrStderr(), "sluice: swept %d leftover sandbox(es)\n", n)
				return err
			}
			if len(args) == 0 {
				return &exitError{code: sandbox.ExitLaunchFailed, msg: "run needs a command after --"}
			}
			var cfg *rules.Config
			if configPath != "" {
				data, err := os.ReadFile(configPath)
				if err != nil {
					return &exitError{code: sandbox.ExitLaunchFailed, msg: fmt.Sprintf("reading config: %v", err)}
				}
				if cfg, err = rules.Parse(data, configPath); err != nil {
					return &exitError{code: sandbox.ExitLaunchFailed, msg: err.Error()}
				}
				dir := filepath.Dir(configPath)
				rel := func(p string) string {
					if p == "" || p == "-" || filepath.IsAbs(p) {
						return p
					}
					return filepath.Join(dir, p)
				}
				if key == "" {
					key = rel(cfg.Identity.TokenKeyFile)
				}
				serveAudit := rel(cfg.Audit.Path)
				if auditPath == "" {
					if auditPath, err = launcherAuditPath(serveAudit); err != nil {
						return &exitError{code: sandbox.ExitLaunchFailed, msg: err.Error()}
					}
				} else if sameFile(auditPath, serveAudit) {
					return &exitError{code: sandbox.ExitLaunchFailed, msg: fmt.Sprintf("--audit %s is the proxy's audit log (audit.path): sluice serve holds that hash chain open, and a second writer would fork it; use another file (default: %s)", auditPath, mustLauncherAuditPath(serveAudit))}
				}
				if proxy == "" && cfg.Server.Listen != "" {
					proxy = cfg.Server.Listen
					if p, ok := strings.CutPrefix(proxy, "unix:"); ok && !filepath.IsAbs(p) {
						proxy = "unix:" + filepath.Join(dir, p) // as serve resolves it
					}
				}
			}
			if auditPath == "-" {
				return &exitError{code: sandbox.ExitLaunchFailed, msg: "--audit -: stdout belongs to the sandboxed command; give a file"}
			}
			if proxy == "" {
				proxy = "127.0.0.1:3128"
			}
			if key == "" {
				return &exitError{code: sandbox.ExitLaunchFailed, msg: "run needs --key FILE (or --config with identity.token_key_file) to mint the sandbox credential"}
			}
			k, err := identity.LoadKeyFile(key)
			if err != nil {
				return &exitError{code: sandbox.ExitLaunchFailed, msg: err.Error()}
			}
			limits := sandbox.Limits{Timeout: timeout, CPUs: cpus, Pids: pids, Files: files}
			for _, s := range []struct {
				flag, v string
				dst     *int64
			}{{"memory", memory, &limits.MemoryBytes}, {"disk", disk, &limits.DiskBytes}, {"tmp-size", tmpSize, &limits.TmpBytes}} {
				if s.v == "" {
					continue
				}
				n, err := rules.ParseSize(s.v)
				if err != nil {
					return &exitError{code: sandbox.ExitLaunchFailed, msg: fmt.Sprintf("--%s: %v", s.flag, err)}
				}
				*s.dst = n.Bytes()
			}
			spec := sandbox.Spec{
				Tenant: tenant, Command: args, Proxy: proxy, Workspace: workspace,
				CABundle: caBundle, RootDir: root, Env: env, Limits: limits,
				AllowNoLandlock: allowNoLandlock,
				Stdin:           os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr,
			}
			if keep {
				spec.KeepDir = workspace
			}
			if t := os.Getenv("TERM"); isTerminal(os.Stdout) && sandbox.ValidTerm(t) {
				spec.Term = t // interactive use only; nothing else of our environment is passed
			}
			logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			l := &sandbox.Launcher{
				Minter:    keyMinter{key: k},
				Logger:    logger,
				StateRoot: stateRoot,
			}
			if auditPath != "" {
				// Open once now so a bad path fails before anything starts;
				// each record is then appended under the file's lock.
				rec := auditRecorder{path: auditPath, logger: logger}
				if err := rec.check(ctx); err != nil {
					return &exitError{code: sandbox.ExitLaunchFailed, msg: fmt.Sprintf("audit log: %v", err)}
				}
				l.Recorder = rec
			}
			if keep && workspace == "" {
				// Decide the directory now so the id in its name matches nothing secret.
				spec.KeepDir = filepath.Join(".", "sluice-workspace-"+strconv.FormatInt(time.Now().UnixNano(), 36))
			}
			l.Started = func(r sandbox.Result) {
				fmt.Fprintf(os.Stderr, "sluice: sandbox %s: limits via %s, landlock %s, seccomp on\n", r.SandboxID, r.Mechanism, r.Landlock)
			}
			res, err := l.Run(ctx, spec)
			if keep && res.Message == "" && err == nil {
				fmt.Fprintf(os.Stderr, "sluice: workspace kept in %s\n", spec.KeepDir)
			}
			if err != nil {
				return &exitError{code: sandbox.ExitLaunchFailed, msg: res.Message}
			}
			if res.ExitCode != 0 || res.Message != "" {
				return &exitError{code: res.ExitCode, msg: res.Message}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.SetInterspersed(false)
	f.StringVar(&tenant, "tenant", "", "tenant whose policy applies (required)")
	f.StringVar(&proxy, "proxy", "", "proxy address: host:port or unix:/path (default: the config's server.listen, else 127.0.0.1:3128)")
	f.StringVar(&workspace, "workspace", "", "host directory copied into /workspace (and back with --keep)")
	f.BoolVar(&keep, "keep", false, "copy /workspace out after the run (into --workspace, or a new ./sluice-workspace-* directory)")
	f.DurationVar(&timeout, "timeout", sandbox.DefaultTimeout, "wall-clock limit; the whole sandbox is killed (exit 124)")
	f.StringVar(&memory, "memory", "512MiB", "memory limit")
	f.Float64Var(&cpus, "cpus", 0, "CPU limit in cores (0: none)")
	f.Int64Var(&pids, "pids", sandbox.DefaultPids, "process/thread limit")
	f.StringVar(&disk, "disk", "256MiB", "workspace size")
	f.Int64Var(&files, "files", sandbox.DefaultFiles, "workspace file count (inodes)")
	f.StringVar(&tmpSize, "tmp-size", "64MiB", "/tmp size")
	f.StringArrayVar(&env, "env", nil, "KEY=VALUE for the sandbox (repeatable; proxy and CA variables are reserved)")
	f.StringVar(&key, "key", "", "token key file (default: the config's identity.token_key_file)")
	f.StringVar(&caBundle, "ca-bundle", "", "PEM bundle the sandbox trusts (from `sluice ca bundle`), mounted at "+sandbox.CABundlePath)
	f.StringVarP(&configPath, "config", "c", "", "configuration file for defaults (key, audit path, proxy address)")
	f.StringVar(&auditPath, "audit", "", "audit log file for launch/run records (default with --config: audit.path with .launcher before its extension; never the proxy's own file)")
	f.StringVar(&root, "root", "", "directory to use as the read-only root instead of the host's system directories")
	f.BoolVar(&allowNoLandlock, "allow-no-landlock", false, "run even if the kernel has no Landlock (default: refuse)")
	f.BoolVar(&sweep, "sweep", false, "only remove leftovers (cgroups, state) of crashed earlier runs, then exit")
	f.StringVar(&stateDir, "state-dir", "", "directory for per-run state (default /run/sluice for root)")
	_ = f.MarkHidden("state-dir")
	_ = cmd.MarkFlagRequired("tenant")
	return cmd
}

// newSandboxInitCmd names the hidden argument the launcher re-executes this
// binary with. The sandbox's init never gets here: package nsinit runs it
// from its package initialisation, before the rest of sluice is initialised,
// when the process is PID 1 of a new pid namespace. Reaching this command
// means someone typed it, so it refuses.
func newSandboxInitCmd() *cobra.Command {
	return &cobra.Command{
		Use:                sandbox.InitCommand,
		Hidden:             true,
		DisableFlagParsing: true,
		RunE: func(*cobra.Command, []string) error {
			return &exitError{code: sandbox.ExitLaunchFailed, msg: sandbox.InitCommand + " is the sandbox's init, started by `sluice run`; it is not a command"}
		},
	}
}

// keyMinter adapts identity.Mint to the launcher's TokenMinter.
type keyMinter struct{ key identity.Key }

func (m keyMinter) Mint(tenant, sandboxID string, ttl time.Duration) (string, error) {
	return identity.Mint(m.key, tenant, sandboxID, ttl, time.Now())
}

// The launcher's audit records (launch, run) never go into the proxy's
// audit file: sluice serve keeps that file's hash chain open for its whole
// life, and a second writer would fork it (`sluice logs verify` fails).
// With --config they go to a sibling of audit.path, "<name>.launcher<ext>";
// `sluice logs verify`/`sluice logs` take both files. Concurrent runs may
// share one launcher file: each record is appended by a writer opened
// under an exclusive lock on "<file>.lock", which continues the chain from
// the file's last record, and is closed again, so the chain stays linear.

// launcherAuditPath derives the launcher's audit file from the proxy's.
func launcherAuditPath(serveAudit string) (string, error) {
	switch serveAudit {
	case "":
		return "", nil // no audit configured
	case "-":
		return "", errors.New("the config's audit.path is stdout, which belongs to the sandboxed command here; give run --audit FILE")
	}
	return mustLauncherAuditPath(serveAudit), nil
}

func mustLauncherAuditPath(serveAudit string) string {
	ext := filepath.Ext(serveAudit)
	return strings.TrimSuffix(serveAudit, ext) + ".launcher" + ext
}

// sameFile reports whether a and b name one file (or, if either does not
// exist yet, the same cleaned absolute path).
func sameFile(a, b string) bool {
	if a == "" || b == "" || a == "-" || b == "-" {
		return false
	}
	fa, errA := os.Stat(a)
	fb, errB := os.Stat(b)
	if errA == nil && errB == nil {
		return os.SameFile(fa, fb)
	}
	pa, errA := filepath.Abs(a)
	pb, errB := filepath.Abs(b)
	return errA == nil && errB == nil && pa == pb
}

// auditRecorder turns launcher events into audit records, appended to path
// under its lock.
type auditRecorder struct {
	path   string
	logger *slog.Logger
}

// check opens the log once under the lock (creating it with its chain
// header if new), so an unusable path fails the launch up front.
func (a auditRecorder) check(ctx context.Context) error {
	return a.locked(ctx, func(*audit.Writer) error { return nil })
}

func (a auditRecorder) locked(ctx context.Context, fn func(*audit.Writer) error) error {
	if err := os.MkdirAll(filepath.Dir(a.path), 0o700); err != nil {
		return fmt.Errorf("audit log directory: %w", err)
	}
	lf, err := os.OpenFile(a.path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("audit lock: %w", err)
	}
	defer lf.Close()
	for {
		err = unix.Flock(int(lf.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("audit lock: %w", err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("audit lock: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	defer unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	w, err := audit.Open(audit.Options{Path: a.path, Fsync: "always", Logger: a.logger})
	if err != nil {
		return err
	}
	err = fn(w)
	if cerr := w.Close(context.WithoutCancel(ctx)); err == nil {
		err = cerr
	}
	return err
}

func (a auditRecorder) Record(ctx context.Context, ev sandbox.Event) error {
	kind := audit.KindLaunch
	if ev.Kind == sandbox.EventRun {
		kind = audit.KindRun
	}
	rec := &audit.Record{
		V: audit.SchemaVersion, Time: ev.Time, Kind: kind,
		Tenant: ev.Tenant, Sandbox: ev.Sandbox, Command: ev.Command,
		Launcher: strconv.Itoa(ev.UID) + ":" + ev.User,
		Limits: &audit.Limits{
			MemoryBytes: ev.Limits.MemoryBytes, PIDs: ev.Limits.Pids, CPUs: ev.Limits.CPUs,
			TimeoutMS: ev.Limits.Timeout.Milliseconds(), WorkspaceBytes: ev.Limits.DiskBytes,
			TmpBytes: ev.Limits.TmpBytes,
		},
		KilledBy: ev.KilledBy,
	}
	msg := []string{"limits=" + ev.Mechanism, "landlock=" + ev.Landlock}
	if len(ev.EnvNames) > 0 {
		msg = append(msg, "env="+strings.Join(ev.EnvNames, ","))
	}
	if kind == audit.KindRun {
		code := ev.ExitCode
		rec.ExitCode = &code
		rec.DurationMS = float64(ev.End.Sub(ev.Start).Microseconds()) / 1000
	}
	if ev.Error != "" {
		rec.Decision = audit.DecisionError
		msg = append(msg, "error="+ev.Error)
	}
	rec.Message = strings.Join(msg, " ")
	if err := a.locked(ctx, func(w *audit.Writer) error { return w.Write(ctx, rec) }); err != nil {
		return errors.Join(errors.New("writing audit record"), err)
	}
	return nil
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
