package nsinit

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// hostRootAllow lists the top-level directories of the host's / that become
// the sandbox's read-only root. Everything else (home directories, /root,
// /run, /sys, /mnt, data directories) is simply absent. A custom root
// (Spec.RootDir) contributes all its top-level entries except the ones the
// sandbox builds itself.
func hostRootAllow() map[string]bool {
	return map[string]bool{
		"bin": true, "sbin": true, "lib": true, "lib32": true, "lib64": true, "libx32": true,
		"usr": true, "etc": true, "opt": true, "var": true,
	}
}

// builtEntries are made by the sandbox itself and never taken from the root.
func builtEntries() map[string]bool {
	return map[string]bool{
		"proc": true, "sys": true, "dev": true, "run": true, "tmp": true,
		"workspace": true, "sluice": true, "home": true, "root": true, "lost+found": true,
	}
}

// skeletonMountpoint is where the init mounts the new root's tmpfs before
// pivoting into it. The mount lives only in the sandbox's private mount
// namespace; the host's directory is untouched.
const skeletonMountpoint = "/tmp"

// join is filepath.Join for the clean, slash-separated paths the init
// builds; path/filepath is avoided because it would pull its package
// initialisation into the init's start-up (see hook.go).
func join(elem ...string) string {
	out := ""
	for _, e := range elem {
		switch {
		case out == "":
			out = e
		case strings.HasSuffix(out, "/"):
			out += strings.TrimPrefix(e, "/")
		default:
			out += "/" + strings.TrimPrefix(e, "/")
		}
	}
	return out
}

func tmpfsData(size, inodes int64, mode os.FileMode) string {
	return "size=" + strconv.FormatInt(size, 10) + ",nr_inodes=" + strconv.FormatInt(inodes, 10) + ",mode=" + strconv.FormatUint(uint64(mode), 8)
}

func mountErr(what, target string, err error) error {
	return fmt.Errorf("mount %s on %s: %w", what, target, err)
}

// readOnlyBind binds src on dst, recursively, and makes the whole tree
// read-only, nosuid and nodev (mount_setattr with AT_RECURSIVE; a plain
// remount would only cover the top mount).
func readOnlyBind(src, dst string) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return mountErr(src, dst, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	err := unix.MountSetattr(unix.AT_FDCWD, dst, unix.AT_RECURSIVE|unix.AT_SYMLINK_NOFOLLOW, &attr)
	if errors.Is(err, unix.ENOSYS) {
		// Kernels before 5.12: only the top mount can be made read-only.
		err = unix.Mount("", dst, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "")
	}
	if err != nil {
		return fmt.Errorf("making %s read-only: %w", dst, err)
	}
	return nil
}

// bindDevice binds one host device node into the new /dev.
func bindDevice(root, name string) error {
	dst := join(root, "dev", name)
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o666)
	if err != nil {
		return fmt.Errorf("creating /dev/%s: %w", name, err)
	}
	f.Close()
	if err := unix.Mount("/dev/"+name, dst, "", unix.MS_BIND, ""); err != nil {
		return mountErr("/dev/"+name, dst, err)
	}
	return nil
}

// buildRoot assembles the sandbox's filesystem under skeletonMountpoint and
// pivots into it. It runs in the init, inside the new user and mount
// namespaces, before anything of the sandbox runs.
func buildRoot(cfg *Config) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	rootDir := cfg.RootDir
	if rootDir == "" {
		rootDir = "/"
	}
	// List the root before the skeleton hides the host's /tmp.
	entries, err := os.ReadDir(rootDir)
	if err != nil {
		return fmt.Errorf("reading root %s: %w", rootDir, err)
	}
	r := skeletonMountpoint
	if err := unix.Mount("sluice-root", r, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, tmpfsData(16<<20, 4096, 0o755)); err != nil {
		return mountErr("root tmpfs", r, err)
	}
	allow, built := hostRootAllow(), builtEntries()
	for _, e := range entries {
		name := e.Name()
		if built[name] || (rootDir == "/" && !allow[name]) {
			continue
		}
		src, dst := join(rootDir, name), join(r, name)
		switch {
		case e.Type()&os.ModeSymlink != 0:
			target, err := os.Readlink(src)
			if err != nil {
				return fmt.Errorf("reading link %s: %w", src, err)
			}
			if err := os.Symlink(target, dst); err != nil {
				return fmt.Errorf("linking %s: %w", dst, err)
			}
		case e.IsDir():
			if err := os.Mkdir(dst, 0o755); err != nil {
				return fmt.Errorf("mkdir %s: %w", dst, err)
			}
			if err := readOnlyBind(src, dst); err != nil {
				return err
			}
		}
	}
	for _, d := range []string{"proc", "dev", "tmp", "workspace", "sluice", "home", "root", "run"} {
		if err := os.Mkdir(join(r, d), 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("mkdir /%s: %w", d, err)
		}
	}

	// No DNS inside: an empty resolver configuration over the root's.
	resolv := join(r, "sluice", "resolv.conf")
	if err := os.WriteFile(resolv, []byte("# sluice: no DNS in the sandbox; all traffic goes through the proxy\n"), 0o644); err != nil {
		return fmt.Errorf("writing resolv.conf: %w", err)
	}
	if fi, err := os.Lstat(join(r, "etc", "resolv.conf")); err == nil && fi.Mode().IsRegular() {
		dst := join(r, "etc", "resolv.conf")
		if err := unix.Mount(resolv, dst, "", unix.MS_BIND, ""); err != nil {
			return mountErr("resolv.conf", dst, err)
		}
		if err := unix.Mount("", dst, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
			return fmt.Errorf("making resolv.conf read-only: %w", err)
		}
	}
	if len(cfg.CABundle) > 0 {
		if err := os.WriteFile(join(r, "sluice", "ca.pem"), cfg.CABundle, 0o644); err != nil {
			return fmt.Errorf("writing CA bundle: %w", err)
		}
	}

	ws := join(r, "workspace")
	if err := unix.Mount("sluice-workspace", ws, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, tmpfsData(cfg.DiskBytes, cfg.Files+1, 0o755)); err != nil {
		return mountErr("workspace tmpfs", ws, err)
	}
	tmp := join(r, "tmp")
	if err := unix.Mount("sluice-tmp", tmp, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, tmpfsData(cfg.TmpBytes, cfg.TmpFiles+1, 0o1777)); err != nil {
		return mountErr("tmp tmpfs", tmp, err)
	}

	dev := join(r, "dev")
	if err := unix.Mount("sluice-dev", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, tmpfsData(64<<10, 64, 0o755)); err != nil {
		return mountErr("dev tmpfs", dev, err)
	}
	for _, d := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		if err := bindDevice(r, d); err != nil {
			return err
		}
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, join(dev, name)); err != nil {
			return fmt.Errorf("linking /dev/%s: %w", name, err)
		}
	}
	if err := unix.Mount("", dev, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("making /dev read-only: %w", err)
	}

	proc := join(r, "proc")
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return mountErr("proc", proc, err)
	}

	// pivot_root(".", ".") stacks the old root under the new one; detaching
	// it leaves no path back to the host's tree.
	if err := unix.Chdir(r); err != nil {
		return fmt.Errorf("chdir to new root: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detaching old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("chdir /: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("making / read-only: %w", err)
	}
	return nil
}
