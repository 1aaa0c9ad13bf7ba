package nsinit

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Command is argv[1] of the init: the launcher re-executes its own binary
// as "Argv0 Command" in the new namespaces.
const (
	Command = "__sandbox-init"
	Argv0   = "sluice-init"
)

// ControlFD is the control socket the launcher hands to the init; the
// config memfd arrives over it with the first Message.
const ControlFD = 3

const (
	secbitsLocked = 1<<0 | 1<<1 | 1<<2 | 1<<3 | 1<<5 | 1<<6 | 1<<7 // NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE, all locked
)

// Main is the sandbox's PID 1. It sets up the filesystem and network of the
// namespaces it was born in, starts the command with every restriction in
// place, reaps orphans, kills what is left when the command exits and reports
// the status to the launcher. It returns the process exit status; errors go to
// the launcher over the control socket.
func Main() int {
	ctl := Conn{FD: ControlFD}
	// Nothing the init holds may reach the command.
	unix.CloseOnExec(ControlFD)
	// If the launcher died before we got here, the pid-namespace fix-up of
	// Pdeathsig could not run: ask again, then check that it is still there.
	_ = unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0)
	// The sandbox runs as the same uid: keep it out of /proc/1 (fds, environ, memory).
	_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	// As PID 1 the init only receives signals it handles; handle and ignore the
	// ones a sandboxed process could send, so it cannot end the init early.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE)
	go func() {
		for range sigs {
		}
	}()

	fail := func(stage string, err error) int {
		_ = ctl.Send(Message{Type: MsgError, Error: stage + ": " + err.Error()})
		return ExitLaunchFailed
	}
	m, fds, err := ctl.Recv()
	if err != nil || m.Type != MsgConfig || len(fds) != 1 {
		CloseFDs(fds)
		return ExitLaunchFailed
	}
	cfgFile := os.NewFile(uintptr(fds[0]), "config")
	cfg, err := readConfig(cfgFile)
	cfgFile.Close()
	if err != nil {
		return fail("config", err)
	}
	if err := buildRoot(cfg); err != nil {
		return fail("filesystem", err)
	}
	if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
		return fail("hostname", err)
	}
	lfd, err := relayListener()
	if err != nil {
		return fail("network", err)
	}
	err = ctl.Send(Message{Type: MsgReady}, lfd)
	unix.Close(lfd)
	if err != nil {
		return ExitLaunchFailed
	}
	if cfg.WaitGo {
		if m, _, err = ctl.Recv(); err != nil || m.Type != MsgGo {
			return ExitLaunchFailed
		}
	}
	return onNonLeaderThread(func() int { return superviseCommand(ctl, cfg) })
}

// onNonLeaderThread runs fn on a locked OS thread that is not the thread
// group leader. The restrictions applied for the command are per thread, and
// the kernel checks Landlock's signal scope against the leader: were the
// leader restricted, the sandbox would share a domain with its init and could
// signal it.
func onNonLeaderThread(fn func() int) int {
	release := make(chan struct{})
	defer close(release)
	for {
		res := make(chan int, 1)
		leader := make(chan bool, 1)
		go func() {
			runtime.LockOSThread()
			if unix.Gettid() == unix.Getpid() {
				leader <- true
				<-release // keep the leader occupied so the next try lands elsewhere
				runtime.UnlockOSThread()
				return
			}
			leader <- false
			// Never unlocked: this thread carries the command's restrictions.
			res <- fn()
		}()
		if !<-leader {
			return <-res
		}
	}
}

// relayListener brings up lo and listens on RelayAddr inside the namespace.
func relayListener() (int, error) {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	ifr, err := unix.NewIfreq("lo")
	if err == nil {
		ifr.SetUint16(unix.IFF_UP | unix.IFF_LOOPBACK | unix.IFF_RUNNING)
		err = unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr)
	}
	unix.Close(s)
	if err != nil {
		return -1, fmt.Errorf("bringing up lo: %w", err)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Port: RelayPort, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind %s: %w", RelayAddr, err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("listen %s: %w", RelayAddr, err)
	}
	return fd, nil
}

// lookPath finds argv0 in the sandbox's PATH (the init's own environment is empty).
func lookPath(argv0 string, env []string) (string, error) {
	if strings.Contains(argv0, "/") {
		return argv0, nil
	}
	path := PATH
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range strings.Split(path, ":") {
		if dir == "" {
			dir = "."
		}
		p := join(dir, argv0)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: command not found in PATH", argv0)
}

func setRlimits(cfg *Config) error {
	set := func(res int, v uint64) error {
		return unix.Setrlimit(res, &unix.Rlimit{Cur: v, Max: v})
	}
	if err := set(unix.RLIMIT_CORE, 0); err != nil {
		return fmt.Errorf("RLIMIT_CORE: %w", err)
	}
	if !cfg.Rlimits {
		return nil
	}
	// The weaker fallback when no cgroup could be used: address space per
	// process, processes per user, CPU seconds per process.
	if err := set(unix.RLIMIT_AS, uint64(cfg.MemoryBytes)); err != nil {
		return fmt.Errorf("RLIMIT_AS: %w", err)
	}
	if err := set(unix.RLIMIT_NPROC, uint64(cfg.Pids)); err != nil {
		return fmt.Errorf("RLIMIT_NPROC: %w", err)
	}
	if cfg.CPUSeconds > 0 {
		if err := set(unix.RLIMIT_CPU, uint64(cfg.CPUSeconds)); err != nil {
			return fmt.Errorf("RLIMIT_CPU: %w", err)
		}
	}
	return nil
}

func lastCap() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			return n
		}
	}
	return 63
}

// restrictThread applies, to the calling (locked) thread, everything the
// command inherits: no_new_privs, an empty capability bounding set, locked
// securebits, Landlock and seccomp. Order matters: seccomp last, because it
// refuses the prctl and mount calls the earlier steps might need.
func restrictThread(cfg *Config) (string, error) {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return "", fmt.Errorf("no_new_privs: %w", err)
	}
	for c := 0; c <= lastCap(); c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return "", fmt.Errorf("dropping capability %d: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return "", fmt.Errorf("clearing ambient capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, secbitsLocked, 0, 0, 0); err != nil {
		return "", fmt.Errorf("securebits: %w", err)
	}
	ll, err := applyLandlock()
	if err != nil {
		return "", err
	}
	if ll == "" {
		if !cfg.AllowNoLandlock {
			return "", errors.New("landlock is not available in this kernel (allow running without it explicitly)")
		}
		ll = "unavailable"
	}
	if err := installSeccomp(); err != nil {
		return "", err
	}
	return ll, nil
}

// superviseCommand starts the command and stays PID 1 until it has exited and
// every other process of the namespace is gone.
func superviseCommand(ctl Conn, cfg *Config) int {
	fail := func(stage string, err error) int {
		_ = ctl.Send(Message{Type: MsgError, Error: stage + ": " + err.Error()})
		return ExitLaunchFailed
	}
	path, err := lookPath(cfg.Argv[0], cfg.Env)
	if err != nil {
		return fail("command", err)
	}
	if err := setRlimits(cfg); err != nil {
		return fail("rlimits", err)
	}
	// The caller locked this thread; it carries the restrictions, forks the
	// command and is never unlocked, so no other goroutine ever runs on it.
	ll, err := restrictThread(cfg)
	if err != nil {
		return fail("restrictions", err)
	}
	pid, err := syscall.ForkExec(path, cfg.Argv, &syscall.ProcAttr{
		Dir:   WorkspacePath,
		Env:   cfg.Env,
		Files: []uintptr{0, 1, 2},
		Sys:   &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL},
	})
	cfg.Env = nil
	if err != nil {
		return fail("exec "+cfg.Argv[0], err)
	}
	if err := ctl.Send(Message{Type: MsgStarted, Landlock: ll}); err != nil {
		unix.Kill(-1, unix.SIGKILL)
		return ExitLaunchFailed
	}
	var exit, sig int
	for {
		var ws unix.WaitStatus
		wpid, err := unix.Wait4(-1, &ws, 0, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil { // ECHILD: nothing left
			break
		}
		if wpid == pid {
			switch {
			case ws.Exited():
				exit = ws.ExitStatus()
			case ws.Signaled():
				sig = int(ws.Signal())
				exit = 128 + sig
			}
			// The command is done: nothing it left running may outlive it.
			_ = unix.Kill(-1, unix.SIGKILL)
		}
	}
	if err := ctl.Send(Message{Type: MsgExited, Exit: exit, Signal: sig}); err != nil {
		return ExitLaunchFailed
	}
	if cfg.Keep {
		// Stay alive (and keep /workspace mounted) until the launcher has
		// copied the workspace out.
		_, _, _ = ctl.Recv()
	}
	return 0
}
