package sandbox

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/user"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sluicehq/sluice/internal/sandbox/nsinit"
)

// InitCommand is the hidden argument the launcher re-executes its binary
// with; package nsinit takes the process over when it sees it.
const InitCommand = nsinit.Command

// DefaultHostID is the host uid and gid the sandbox's root is mapped to when
// the launcher runs as root: an unprivileged id, so that even a process that
// escaped every namespace would hold no rights on the host.
const DefaultHostID = 65534

// Launcher starts sandboxes. The zero value is not usable: Minter is required.
type Launcher struct {
	// InitPath is the sluice binary to re-execute as the init; default /proc/self/exe.
	InitPath string
	Minter   TokenMinter
	Recorder Recorder // optional
	Logger   *slog.Logger
	// StateRoot holds per-run state for the sweeper; default DefaultStateRoot().
	StateRoot string
	// HostUID and HostGID are the ids the sandbox's root maps to when the
	// launcher is root; 0 means DefaultHostID. Unprivileged launchers map to
	// their own ids.
	HostUID, HostGID int
	// Started, if set, is called once the command runs, with the sandbox id,
	// the limit mechanism and the Landlock status filled in.
	Started func(Result)
}

// NewSandboxID returns a random sandbox id ("sb-" + 16 hex digits).
func NewSandboxID() (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("sandbox id: %w", err)
	}
	return "sb-" + hex.EncodeToString(b[:]), nil
}

func (l *Launcher) logger() *slog.Logger {
	if l.Logger != nil {
		return l.Logger
	}
	return slog.Default()
}

func (l *Launcher) stateRoot() string {
	if l.StateRoot != "" {
		return l.StateRoot
	}
	return DefaultStateRoot()
}

func (l *Launcher) idMaps() ([]syscall.SysProcIDMap, []syscall.SysProcIDMap) {
	uid, gid := os.Geteuid(), os.Getegid()
	if uid == 0 {
		uid, gid = l.HostUID, l.HostGID
		if uid == 0 {
			uid = DefaultHostID
		}
		if gid == 0 {
			gid = DefaultHostID
		}
	}
	return []syscall.SysProcIDMap{{ContainerID: 0, HostID: uid, Size: 1}},
		[]syscall.SysProcIDMap{{ContainerID: 0, HostID: gid, Size: 1}}
}

func launcherIdentity() (int, string) {
	uid := os.Getuid()
	name := ""
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		name = u.Username
	}
	return uid, name
}

func readCABundle(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("CA bundle: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxCABundleBytes+1))
	if err != nil {
		return nil, fmt.Errorf("CA bundle: %w", err)
	}
	if len(b) > maxCABundleBytes {
		return nil, fmt.Errorf("CA bundle %s is larger than %d bytes", path, maxCABundleBytes)
	}
	if !bytes.Contains(b, []byte("-----BEGIN CERTIFICATE-----")) {
		return nil, fmt.Errorf("CA bundle %s holds no PEM certificate", path)
	}
	return b, nil
}

// LandlockStatus describes what Landlock this kernel offers, for the
// launch record written before the command starts.
func LandlockStatus() string {
	abi := nsinit.LandlockABI()
	if abi < 1 {
		return "unavailable"
	}
	return "abi " + strconv.Itoa(abi)
}

// Run starts spec's command in a new sandbox and waits for it. The error is
// non-nil only when the sandbox could not be started (Result.ExitCode is then
// ExitLaunchFailed); how the command ended is in the Result.
func (l *Launcher) Run(ctx context.Context, spec Spec) (Result, error) {
	id, err := NewSandboxID()
	if err != nil {
		return Result{ExitCode: ExitLaunchFailed, Message: err.Error()}, err
	}
	r := &run{l: l, spec: spec, id: id, log: l.logger().With("sandbox", id, "tenant", spec.Tenant)}
	r.spec.Limits = spec.Limits.withDefaults()
	res, err := r.run(ctx)
	if err != nil {
		res.ExitCode = ExitLaunchFailed
		res.Message = "launch failed: " + err.Error()
	}
	res.SandboxID = id
	return res, err
}

type run struct {
	l    *Launcher
	spec Spec
	id   string
	log  *slog.Logger

	start    time.Time
	limiter  limiter
	launched bool // the launch record was written
}

func (r *run) event(kind string) Event {
	uid, name := launcherIdentity()
	names, _ := ValidateEnv(r.spec.Env)
	ev := Event{
		Kind: kind, Time: time.Now(), UID: uid, User: name,
		Tenant: r.spec.Tenant, Sandbox: r.id, Command: r.spec.Command,
		EnvNames: sortedCopy(names), Limits: r.spec.Limits, Start: r.start,
		Landlock: LandlockStatus(),
	}
	if r.limiter != nil {
		ev.Mechanism = r.limiter.mechanism()
	}
	return ev
}

func (r *run) record(ctx context.Context, ev Event) error {
	if r.l.Recorder == nil {
		return nil
	}
	// The record must be written even when ctx is already cancelled.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := r.l.Recorder.Record(rctx, ev); err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	return nil
}

func (r *run) run(ctx context.Context) (res Result, err error) {
	r.start = time.Now()
	res.Start = r.start
	defer func() {
		res.End = time.Now()
		if r.l.Recorder == nil {
			return
		}
		ev := r.event(EventRun)
		ev.End, ev.ExitCode, ev.KilledBy = res.End, res.ExitCode, res.KilledBy
		if res.Landlock != "" {
			ev.Landlock = res.Landlock
		}
		if err != nil {
			ev.ExitCode = ExitLaunchFailed
			ev.Error = err.Error()
			if !r.launched {
				lev := r.event(EventLaunch)
				lev.Error = ev.Error
				_ = r.record(ctx, lev)
			}
		}
		if rerr := r.record(ctx, ev); rerr != nil {
			r.log.Error("sandbox run record not written", "err", rerr)
		}
	}()

	spec := &r.spec
	if err := spec.validate(); err != nil {
		return res, err
	}
	if r.l.Minter == nil {
		return res, errors.New("no token minter configured")
	}
	var ca []byte
	if spec.CABundle != "" {
		if ca, err = readCABundle(spec.CABundle); err != nil {
			return res, err
		}
	}
	// Start the init first: its start-up overlaps the cgroup and credential
	// work below. It waits for the config message before doing anything.
	parentSock, childSock, err := nsinit.Socketpair()
	if err != nil {
		return res, err
	}
	defer parentSock.Close()
	ctl := nsinit.Conn{FD: int(parentSock.Fd())}

	initPath := r.l.InitPath
	if initPath == "" {
		initPath = "/proc/self/exe"
	}
	uidMap, gidMap := r.l.idMaps()
	cmd := &exec.Cmd{
		Path:       initPath,
		Args:       []string{nsinit.Argv0, nsinit.Command},
		Env:        []string{}, // nothing of the launcher's environment crosses over
		Stdin:      spec.Stdin,
		Stdout:     spec.Stdout,
		Stderr:     spec.Stderr,
		ExtraFiles: []*os.File{childSock},
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: unix.CLONE_NEWUSER | unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET |
				unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWCGROUP,
			UidMappings:                uidMap,
			GidMappings:                gidMap,
			GidMappingsEnableSetgroups: false,
			// Become the namespace's root before exec, or exec would drop the
			// capabilities the init needs to build the sandbox.
			Credential: &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
			Setsid:     true,
		},
	}
	initExited := true // nothing to stop until the init has started
	var waitDone chan error
	stopInit := func() {
		if !initExited {
			_ = cmd.Process.Kill()
			<-waitDone
			initExited = true
		}
	}
	defer stopInit()
	// The kernel sends the init's parent-death signal when the *thread* that
	// forked it exits, and Go ends a thread whose locked goroutine returns.
	// Fork from a thread this run holds until it is over, so no other code's
	// locked goroutine can take that thread down with the sandbox.
	startErr := make(chan error, 1)
	releaseThread := make(chan struct{})
	defer close(releaseThread)
	go func() {
		runtime.LockOSThread()
		err := cmd.Start()
		childSock.Close()
		startErr <- err
		<-releaseThread
		runtime.UnlockOSThread()
	}()
	// While the kernel builds the namespaces and the init starts up, prepare
	// the host side. The init waits for the config message before it does
	// anything, and that is only sent once it is in its cgroup.
	st, prepErr := r.prepareHost(ctx)
	if st != nil {
		defer func() {
			if rerr := st.remove(); rerr != nil {
				r.log.Error("removing sandbox state", "err", rerr)
			}
		}()
	}
	if r.limiter != nil {
		defer func() {
			stopInit()
			r.limiter.kill()
			if rerr := r.limiter.remove(context.Background()); rerr != nil {
				r.log.Error("removing sandbox cgroups", "err", rerr)
			}
		}()
	}
	if err := <-startErr; err != nil {
		return res, fmt.Errorf("starting sandbox init: %w", err)
	}
	initExited = false
	waitDone = make(chan error, 1)
	go func() { waitDone <- cmd.Wait() }()
	if prepErr != nil {
		return res, prepErr
	}
	res.Mechanism = r.limiter.mechanism()
	initPID := cmd.Process.Pid
	st.own.InitPID, st.own.InitStart = initPID, procStart(initPID)
	if err := st.save(); err != nil {
		return res, err
	}
	if err := r.limiter.add(initPID); err != nil {
		return res, err
	}

	// The credential lives as long as the sandbox may.
	token, err := r.l.Minter.Mint(spec.Tenant, r.id, spec.Limits.Timeout)
	if err != nil {
		return res, fmt.Errorf("minting sandbox credential: %w", err)
	}
	cfg := &nsinit.Config{
		Hostname:        "sluice-" + r.id[3:11],
		RootDir:         spec.RootDir,
		Argv:            spec.Command,
		Env:             BuildEnv(spec.Tenant, token, len(ca) > 0, spec.Term, spec.Env),
		CABundle:        ca,
		DiskBytes:       spec.Limits.DiskBytes,
		Files:           spec.Limits.Files,
		TmpBytes:        spec.Limits.TmpBytes,
		TmpFiles:        spec.Limits.TmpFiles,
		Rlimits:         r.limiter.mechanism() == MechRlimit,
		MemoryBytes:     spec.Limits.MemoryBytes,
		Pids:            spec.Limits.Pids,
		AllowNoLandlock: spec.AllowNoLandlock,
		WaitGo:          spec.Workspace != "",
		Keep:            spec.KeepDir != "",
	}
	if cfg.Rlimits {
		cfg.CPUSeconds = int64(spec.Limits.Timeout.Seconds()*max(spec.Limits.CPUs, 1)) + 1
	}
	token = ""
	cfgFile, err := nsinit.WriteConfig(cfg)
	cfg.Env = nil
	if err != nil {
		return res, err
	}
	// The launch record comes before the command can start: without a
	// workspace to copy in, the init goes straight from its setup to the
	// command, with no further round trip.
	if r.l.Recorder != nil {
		err = r.record(ctx, r.event(EventLaunch))
	}
	if err != nil {
		cfgFile.Close()
		return res, err // fail closed: nothing runs unrecorded
	}
	r.launched = true
	err = ctl.Send(nsinit.Message{Type: nsinit.MsgConfig}, int(cfgFile.Fd()))
	cfgFile.Close()
	if err != nil {
		return res, err
	}

	msgs := make(chan received, 4)
	go func() {
		for {
			m, fds, err := ctl.Recv()
			msgs <- received{m, fds, err}
			if err != nil {
				return
			}
		}
	}()

	runCtx, cancel := context.WithTimeout(ctx, spec.Limits.Timeout)
	defer cancel()
	next := func(want string) (received, error) {
		select {
		case m := <-msgs:
			if m.err != nil {
				return m, fmt.Errorf("sandbox init: %w", m.err)
			}
			if m.m.Type == nsinit.MsgError {
				return m, fmt.Errorf("sandbox init: %s", m.m.Error)
			}
			if m.m.Type != want {
				nsinit.CloseFDs(m.fds)
				return m, fmt.Errorf("sandbox init: unexpected %q message, want %q", m.m.Type, want)
			}
			return m, nil
		case <-runCtx.Done():
			return received{}, fmt.Errorf("sandbox setup: %w", runCtx.Err())
		}
	}

	m, err := next(nsinit.MsgReady)
	if err != nil {
		return res, err
	}
	if len(m.fds) != 1 {
		nsinit.CloseFDs(m.fds)
		return res, errors.New("sandbox init: ready without the relay socket")
	}
	lf := os.NewFile(uintptr(m.fds[0]), "sandbox-relay")
	ln, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		return res, fmt.Errorf("relay listener: %w", err)
	}
	rl := newRelay(ln, spec.Proxy, r.log)
	rl.serve(runCtx)
	defer rl.close()

	if cfg.WaitGo {
		if err := r.copyIn(initPID); err != nil {
			return res, err
		}
		if err := ctl.Send(nsinit.Message{Type: nsinit.MsgGo}); err != nil {
			return res, err
		}
	}
	m, err = next(nsinit.MsgStarted)
	if err != nil {
		return res, err
	}
	res.Landlock = m.m.Landlock
	if r.l.Started != nil {
		r.l.Started(Result{SandboxID: r.id, Mechanism: res.Mechanism, Landlock: res.Landlock, Start: r.start})
	}

	// The command runs. It ends by exiting, by the timeout, by the caller
	// cancelling, or by the init dying (memory limit, kill).
	var exited *nsinit.Message
	select {
	case m := <-msgs:
		if m.err == nil && m.m.Type == nsinit.MsgExited {
			exited = &m.m
		}
	case <-runCtx.Done():
	case <-waitDone:
		initExited = true
		// Without --keep the init exits right after reporting, so its
		// "exited" may still be on its way through the reader goroutine.
		exited = lastExited(msgs)
	}
	switch {
	case exited != nil:
		res.ExitCode = exited.Exit
		if exited.Signal != 0 {
			res.KilledBy = KilledBySignal
		}
		if spec.KeepDir != "" {
			if err := r.copyOut(initPID); err != nil {
				res.Message = "workspace not kept: " + err.Error()
			}
			_ = ctl.Send(nsinit.Message{Type: nsinit.MsgDone})
		}
		// The init exits by itself: at once, or after "done" with --keep.
		if !initExited {
			select {
			case <-waitDone:
				initExited = true
			case <-time.After(5 * time.Second):
			}
		}
	case ctx.Err() != nil:
		res.ExitCode, res.KilledBy = 130, KilledBySignal
		res.Message = "interrupted: sandbox killed"
	case runCtx.Err() != nil:
		res.ExitCode, res.KilledBy = ExitTimeout, KilledByTimeout
		res.Message = fmt.Sprintf("timeout: sandbox killed after %s", spec.Limits.Timeout)
	default:
		res.ExitCode, res.KilledBy = 128+int(unix.SIGKILL), KilledBySignal
		res.Message = "sandbox init was killed"
	}
	stopInit()
	r.limiter.kill()
	if res.KilledBy != KilledByTimeout && res.ExitCode == 128+int(unix.SIGKILL) && r.limiter.oomKills() > 0 {
		res.ExitCode, res.KilledBy = ExitOOM, KilledByMemory
		res.Message = fmt.Sprintf("out of memory: sandbox killed at its %d-byte memory limit", spec.Limits.MemoryBytes)
	}
	return res, nil
}

// lastExited returns the init's "exited" report once the init is gone, or
// nil if it died without one. The init's end of the control socket closed
// with it, so the reader delivers what was sent and then an error; the
// timer only guards against a descriptor leaked to another process.
func lastExited(msgs <-chan received) *nsinit.Message {
	timeout := time.After(5 * time.Second)
	for {
		select {
		case m := <-msgs:
			if m.err != nil {
				return nil
			}
			nsinit.CloseFDs(m.fds)
			if m.m.Type == nsinit.MsgExited {
				return &m.m
			}
		case <-timeout:
			return nil
		}
	}
}

type received struct {
	m   nsinit.Message
	fds []int
	err error
}

// copyIn fills the sandbox's /workspace (reached through the init's root)
// with the host workspace directory, before anything of the sandbox runs.
func (r *run) copyIn(initPID int) error {
	src, err := os.OpenRoot(r.spec.Workspace)
	if err != nil {
		return fmt.Errorf("workspace: %w", err)
	}
	defer src.Close()
	dst, err := os.OpenRoot("/proc/" + strconv.Itoa(initPID) + "/root" + WorkspacePath)
	if err != nil {
		return fmt.Errorf("sandbox workspace: %w", err)
	}
	defer dst.Close()
	uidMap, gidMap := r.l.idMaps()
	w, err := newFSIDWorker(uidMap[0].HostID, gidMap[0].HostID)
	if err != nil {
		return fmt.Errorf("copying workspace in: %w", err)
	}
	defer w.close()
	if err := copyTree(src, dst, w.do); err != nil {
		return fmt.Errorf("copying workspace in: %w", err)
	}
	return nil
}

// copyOut copies /workspace to KeepDir after the command and every other
// process of the sandbox are gone (only the init remains).
func (r *run) copyOut(initPID int) error {
	if err := os.MkdirAll(r.spec.KeepDir, 0o700); err != nil {
		return err
	}
	dst, err := os.OpenRoot(r.spec.KeepDir)
	if err != nil {
		return err
	}
	defer dst.Close()
	src, err := os.OpenRoot("/proc/" + strconv.Itoa(initPID) + "/root" + WorkspacePath)
	if err != nil {
		return err
	}
	defer src.Close()
	return copyTree(src, dst, direct)
}

// prepareHost sweeps leftovers of crashed runs, then creates this run's
// state directory and cgroups (in that order, so a crash always leaves the
// sweeper enough to clean up). It sets r.limiter once cgroups exist; the
// caller removes whatever it returns or set, also on error.
func (r *run) prepareHost(ctx context.Context) (*state, error) {
	if n, err := Sweep(ctx, r.l.stateRoot()); err != nil {
		r.log.Warn("sweeping earlier sandboxes", "err", err)
	} else if n > 0 {
		r.log.Info("swept leftovers of crashed sandboxes", "count", n)
	}
	st, err := newState(r.l.stateRoot(), r.id)
	if err != nil {
		return nil, err
	}
	lim, err := newLimiter(r.id, r.spec.Limits)
	if err != nil {
		return st, err
	}
	r.limiter = lim
	st.own.Cgroups = lim.dirs()
	if err := st.save(); err != nil {
		return st, err
	}
	return st, nil
}
