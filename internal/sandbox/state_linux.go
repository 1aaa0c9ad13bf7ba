package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// staleStateAge is how old an unreadable state directory must be before the
// sweeper treats it as debris rather than a launcher mid-write.
const staleStateAge = time.Hour

// Each run keeps a small state directory naming its launcher (pid and start
// time, so a recycled pid is not mistaken for it), its init and its cgroups.
// It is written before any cgroup exists and removed after the last one is
// gone, so a crashed launcher always leaves enough behind for Sweep.

// DefaultStateRoot is /run/sluice for root, else $XDG_RUNTIME_DIR/sluice, else
// a per-user directory under the temporary directory.
func DefaultStateRoot() string {
	if os.Geteuid() == 0 {
		return "/run/sluice"
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "sluice")
	}
	return filepath.Join(os.TempDir(), "sluice-"+strconv.Itoa(os.Geteuid()))
}

type owner struct {
	LauncherPID   int      `json:"launcher_pid"`
	LauncherStart uint64   `json:"launcher_start"`
	InitPID       int      `json:"init_pid,omitempty"`
	InitStart     uint64   `json:"init_start,omitempty"`
	Cgroups       []string `json:"cgroups,omitempty"`
}

type state struct {
	dir string
	own owner
}

// procStart returns a process's start time in clock ticks since boot, 0 if
// the process does not exist.
func procStart(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:])
	// Fields after the command: state is field 3, starttime is field 22.
	if len(f) < 20 {
		return 0
	}
	v, _ := strconv.ParseUint(f[19], 10, 64)
	return v
}

func alive(pid int, start uint64) bool {
	return pid > 0 && start != 0 && procStart(pid) == start
}

func newState(root, id string) (*state, error) {
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	s := &state{dir: filepath.Join(root, id), own: owner{LauncherPID: os.Getpid(), LauncherStart: procStart(os.Getpid())}}
	if err := os.Mkdir(s.dir, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	return s, s.save()
}

func (s *state) save() error {
	b, err := json.Marshal(s.own)
	if err != nil {
		return err
	}
	tmp := filepath.Join(s.dir, "owner.tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(s.dir, "owner.json")); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	return nil
}

func (s *state) remove() error { return os.RemoveAll(s.dir) }

// Sweep removes what crashed launchers left behind under root: it kills the
// processes of their cgroups, removes the cgroups and the state directories.
// It only touches runs whose launcher is dead. It returns how many it swept.
func Sweep(ctx context.Context, root string) (int, error) {
	entries, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("sweep: %w", err)
	}
	n := 0
	var errs []error
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), "sb-") {
			continue
		}
		dir := filepath.Join(root, e.Name())
		b, err := os.ReadFile(filepath.Join(dir, "owner.json"))
		var own owner
		if err == nil {
			err = json.Unmarshal(b, &own)
		}
		if err != nil {
			// A launcher between mkdir and its first write; leave it unless
			// nothing in it says who owns it and it is old.
			if fi, serr := e.Info(); serr == nil && ctx.Err() == nil && fi.ModTime().Before(time.Now().Add(-staleStateAge)) {
				_ = os.RemoveAll(dir)
			}
			continue
		}
		if alive(own.LauncherPID, own.LauncherStart) {
			continue
		}
		if alive(own.InitPID, own.InitStart) {
			_ = unix.Kill(own.InitPID, unix.SIGKILL)
		}
		var cgs []string
		for _, cg := range own.Cgroups {
			// Never touch anything we would not have created.
			if strings.HasPrefix(filepath.Base(cg), cgroupPrefix) && underCgroupMount(cg) {
				killProcs(cg)
				cgs = append(cgs, cg)
			}
		}
		if err := removeCgroups(ctx, cgs); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, fmt.Errorf("sweep: %w", err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

func underCgroupMount(p string) bool {
	mounts, err := cgroupMounts()
	if err != nil || filepath.Clean(p) != p {
		return false
	}
	for _, m := range mounts {
		if strings.HasPrefix(p, m+"/") {
			return true
		}
	}
	return false
}
