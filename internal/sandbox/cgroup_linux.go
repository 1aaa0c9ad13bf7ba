package sandbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// cgroupPrefix names every cgroup the launcher creates, so the sweeper can
// recognise them.
const cgroupPrefix = "sluice-"

const cfsPeriodUS = 100000

// limiter is the resource-limit mechanism chosen for one sandbox.
type limiter interface {
	mechanism() string
	dirs() []string
	add(pid int) error
	oomKills() int64
	kill()
	remove(ctx context.Context) error
}

// rlimitLimiter is the fallback: the init sets rlimits instead.
type rlimitLimiter struct{}

func (rlimitLimiter) mechanism() string            { return MechRlimit }
func (rlimitLimiter) dirs() []string               { return nil }
func (rlimitLimiter) add(int) error                { return nil }
func (rlimitLimiter) oomKills() int64              { return 0 }
func (rlimitLimiter) kill()                        {}
func (rlimitLimiter) remove(context.Context) error { return nil }

// cgroupMounts maps each v1 controller (and "" for cgroup2) to its mount point.
func cgroupMounts() (map[string]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 {
			continue
		}
		switch qf[0] {
		case "cgroup2":
			if pf[3] == "/" {
				out[""] = pf[4]
			}
		case "cgroup":
			if pf[3] != "/" {
				continue
			}
			for _, o := range strings.Split(qf[2], ",") {
				switch o {
				case "memory", "pids", "cpu":
					out[o] = pf[4]
				}
			}
		}
	}
	return out, sc.Err()
}

// ownCgroups maps each v1 controller (and "" for cgroup2) to this process's path.
func ownCgroups() (map[string]string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[1] == "" {
			out[""] = parts[2]
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			out[c] = parts[2]
		}
	}
	return out, nil
}

func writeFile(path, v string) error {
	if err := os.WriteFile(path, []byte(v), 0); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// newLimiter picks cgroup v2 when a delegated hierarchy with the memory and
// pids controllers is available to us, cgroup v1 when its memory and pids
// hierarchies are writable, and rlimits otherwise.
func newLimiter(id string, l Limits) (limiter, error) {
	mounts, err := cgroupMounts()
	if err != nil {
		return rlimitLimiter{}, nil
	}
	own, err := ownCgroups()
	if err != nil {
		return rlimitLimiter{}, nil
	}
	if m, ok := mounts[""]; ok {
		if p, ok := own[""]; ok {
			if cg, err := newCgroupV2(filepath.Join(m, p), id, l); err == nil {
				return cg, nil
			}
		}
	}
	if mounts["memory"] != "" && mounts["pids"] != "" {
		cg, err := newCgroupV1(mounts, own, id, l)
		if err == nil {
			return cg, nil
		}
		if !errors.Is(err, os.ErrPermission) && !errors.Is(err, unix.EROFS) {
			return nil, err
		}
	}
	return rlimitLimiter{}, nil
}

type cgroupV1 struct {
	memory, pids, cpu string
}

func newCgroupV1(mounts, own map[string]string, id string, l Limits) (*cgroupV1, error) {
	dir := func(c string) string { return filepath.Join(mounts[c], own[c], cgroupPrefix+id) }
	cg := &cgroupV1{memory: dir("memory"), pids: dir("pids")}
	if l.CPUs > 0 {
		if mounts["cpu"] == "" {
			return nil, errors.New("cgroup v1: no cpu hierarchy for the cpu limit")
		}
		cg.cpu = dir("cpu")
	}
	for _, d := range cg.dirs() {
		if err := os.Mkdir(d, 0o755); err != nil {
			cg.remove(context.Background())
			return nil, fmt.Errorf("cgroup v1: %w", err)
		}
	}
	mem := strconv.FormatInt(l.MemoryBytes, 10)
	err := writeFile(filepath.Join(cg.memory, "memory.limit_in_bytes"), mem)
	if err == nil {
		// With swap the limit would only move the pages; memsw caps both.
		if _, serr := os.Stat(filepath.Join(cg.memory, "memory.memsw.limit_in_bytes")); serr == nil {
			err = writeFile(filepath.Join(cg.memory, "memory.memsw.limit_in_bytes"), mem)
		}
	}
	if err == nil {
		err = writeFile(filepath.Join(cg.pids, "pids.max"), strconv.FormatInt(l.Pids, 10))
	}
	if err == nil && cg.cpu != "" {
		err = writeFile(filepath.Join(cg.cpu, "cpu.cfs_period_us"), strconv.Itoa(cfsPeriodUS))
		if err == nil {
			err = writeFile(filepath.Join(cg.cpu, "cpu.cfs_quota_us"), strconv.FormatInt(int64(l.CPUs*cfsPeriodUS), 10))
		}
	}
	if err != nil {
		cg.remove(context.Background())
		return nil, fmt.Errorf("cgroup v1: %w", err)
	}
	return cg, nil
}

func (c *cgroupV1) mechanism() string { return MechCgroupV1 }

func (c *cgroupV1) dirs() []string {
	d := []string{c.memory, c.pids}
	if c.cpu != "" {
		d = append(d, c.cpu)
	}
	return d
}

func (c *cgroupV1) add(pid int) error {
	for _, d := range c.dirs() {
		if err := writeFile(filepath.Join(d, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return fmt.Errorf("cgroup v1: %w", err)
		}
	}
	return nil
}

func (c *cgroupV1) oomKills() int64 {
	return counter(filepath.Join(c.memory, "memory.oom_control"), "oom_kill")
}

func (c *cgroupV1) kill() { killProcs(c.pids) }

func (c *cgroupV1) remove(ctx context.Context) error { return removeCgroups(ctx, c.dirs()) }

type cgroupV2 struct{ dir string }

func newCgroupV2(parent, id string, l Limits) (*cgroupV2, error) {
	b, err := os.ReadFile(filepath.Join(parent, "cgroup.subtree_control"))
	if err != nil {
		return nil, err
	}
	ctrl := " " + strings.TrimSpace(string(b)) + " "
	if !strings.Contains(ctrl, " memory ") || !strings.Contains(ctrl, " pids ") || (l.CPUs > 0 && !strings.Contains(ctrl, " cpu ")) {
		return nil, errors.New("cgroup v2: memory/pids/cpu not delegated")
	}
	cg := &cgroupV2{dir: filepath.Join(parent, cgroupPrefix+id)}
	if err := os.Mkdir(cg.dir, 0o755); err != nil {
		return nil, fmt.Errorf("cgroup v2: %w", err)
	}
	err = writeFile(filepath.Join(cg.dir, "memory.max"), strconv.FormatInt(l.MemoryBytes, 10))
	if err == nil {
		if _, serr := os.Stat(filepath.Join(cg.dir, "memory.swap.max")); serr == nil {
			err = writeFile(filepath.Join(cg.dir, "memory.swap.max"), "0")
		}
	}
	if err == nil {
		err = writeFile(filepath.Join(cg.dir, "pids.max"), strconv.FormatInt(l.Pids, 10))
	}
	if err == nil && l.CPUs > 0 {
		err = writeFile(filepath.Join(cg.dir, "cpu.max"), fmt.Sprintf("%d %d", int64(l.CPUs*cfsPeriodUS), cfsPeriodUS))
	}
	if err != nil {
		cg.remove(context.Background())
		return nil, fmt.Errorf("cgroup v2: %w", err)
	}
	return cg, nil
}

func (c *cgroupV2) mechanism() string { return MechCgroupV2 }
func (c *cgroupV2) dirs() []string    { return []string{c.dir} }
func (c *cgroupV2) add(pid int) error {
	return writeFile(filepath.Join(c.dir, "cgroup.procs"), strconv.Itoa(pid))
}
func (c *cgroupV2) oomKills() int64 {
	return counter(filepath.Join(c.dir, "memory.events"), "oom_kill")
}
func (c *cgroupV2) kill() {
	if writeFile(filepath.Join(c.dir, "cgroup.kill"), "1") != nil {
		killProcs(c.dir)
	}
}
func (c *cgroupV2) remove(ctx context.Context) error { return removeCgroups(ctx, c.dirs()) }

// counter reads "name N" from a flat-keyed cgroup file.
func counter(path, name string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// killProcs SIGKILLs every process listed in dir's cgroup.procs, a few
// rounds in case one forked meanwhile (pids.max bounds how many).
func killProcs(dir string) {
	for range 10 {
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil || len(strings.TrimSpace(string(b))) == 0 {
			return
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
				_ = unix.Kill(pid, unix.SIGKILL)
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// removeCgroups removes the directories, retrying while the killed
// processes are still being torn down.
func removeCgroups(ctx context.Context, dirs []string) error {
	var errs []error
	for _, d := range dirs {
		delay := time.Millisecond
		deadline := time.Now().Add(5 * time.Second)
		for {
			err := unix.Rmdir(d)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) || ctx.Err() != nil {
				errs = append(errs, fmt.Errorf("removing cgroup %s: %w", d, err))
				break
			}
			killProcs(d)
			time.Sleep(delay)
			delay = min(2*delay, 50*time.Millisecond)
		}
	}
	return errors.Join(errs...)
}
