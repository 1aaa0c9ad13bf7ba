package nsinit

import (
	"fmt"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Landlock is applied with the raw system calls, on one locked OS thread,
// right before that thread forks the command: the ruleset is inherited by the
// command and everything it starts, while the init's other threads stay free.

const (
	llFSv1 = unix.LANDLOCK_ACCESS_FS_EXECUTE | unix.LANDLOCK_ACCESS_FS_WRITE_FILE |
		unix.LANDLOCK_ACCESS_FS_READ_FILE | unix.LANDLOCK_ACCESS_FS_READ_DIR |
		unix.LANDLOCK_ACCESS_FS_REMOVE_DIR | unix.LANDLOCK_ACCESS_FS_REMOVE_FILE |
		unix.LANDLOCK_ACCESS_FS_MAKE_CHAR | unix.LANDLOCK_ACCESS_FS_MAKE_DIR |
		unix.LANDLOCK_ACCESS_FS_MAKE_REG | unix.LANDLOCK_ACCESS_FS_MAKE_SOCK |
		unix.LANDLOCK_ACCESS_FS_MAKE_FIFO | unix.LANDLOCK_ACCESS_FS_MAKE_BLOCK |
		unix.LANDLOCK_ACCESS_FS_MAKE_SYM
	llRead      = unix.LANDLOCK_ACCESS_FS_EXECUTE | unix.LANDLOCK_ACCESS_FS_READ_FILE | unix.LANDLOCK_ACCESS_FS_READ_DIR
	llFileWrite = unix.LANDLOCK_ACCESS_FS_WRITE_FILE | unix.LANDLOCK_ACCESS_FS_TRUNCATE
	llDirWrite  = unix.LANDLOCK_ACCESS_FS_WRITE_FILE | unix.LANDLOCK_ACCESS_FS_REMOVE_DIR |
		unix.LANDLOCK_ACCESS_FS_REMOVE_FILE | unix.LANDLOCK_ACCESS_FS_MAKE_DIR |
		unix.LANDLOCK_ACCESS_FS_MAKE_REG | unix.LANDLOCK_ACCESS_FS_MAKE_SOCK |
		unix.LANDLOCK_ACCESS_FS_MAKE_FIFO | unix.LANDLOCK_ACCESS_FS_MAKE_SYM |
		unix.LANDLOCK_ACCESS_FS_REFER | unix.LANDLOCK_ACCESS_FS_TRUNCATE

	llRuleNetPort = 2
)

// rulesetAttr is the ABI 6 layout; later fields are left out so older
// kernels accept the size.
type llRulesetAttr struct {
	fs, net, scoped uint64
}

type llNetPortAttr struct {
	allowed uint64
	port    uint64
}

// LandlockABI returns the kernel's Landlock ABI version, 0 when unavailable.
func LandlockABI() int {
	v, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
	if errno != 0 {
		return 0
	}
	return int(v)
}

// handledFS is every filesystem right the kernel's ABI knows.
func handledFS(abi int) uint64 {
	h := uint64(llFSv1)
	if abi >= 2 {
		h |= unix.LANDLOCK_ACCESS_FS_REFER
	}
	if abi >= 3 {
		h |= unix.LANDLOCK_ACCESS_FS_TRUNCATE
	}
	if abi >= 5 {
		h |= unix.LANDLOCK_ACCESS_FS_IOCTL_DEV
	}
	return h
}

type llRule struct {
	path   string
	access uint64
}

// landlockRules is the sandbox policy: read and execute everywhere, write
// only in the workspace and /tmp (and to the harmless device nodes and the
// process's own /proc files).
func landlockRules() []llRule {
	devRW := uint64(llRead | llFileWrite | unix.LANDLOCK_ACCESS_FS_IOCTL_DEV)
	return []llRule{
		{"/", llRead},
		{WorkspacePath, llRead | llDirWrite},
		{"/tmp", llRead | llDirWrite},
		{"/proc", llRead | llFileWrite},
		{"/dev/null", devRW}, {"/dev/zero", devRW}, {"/dev/full", devRW},
		{"/dev/random", devRW}, {"/dev/urandom", devRW}, {"/dev/tty", devRW},
	}
}

// applyLandlock enforces the policy on the calling thread, which must hold
// runtime.LockOSThread and have no_new_privs set. It returns a description
// of what applied, or an empty string when Landlock is unavailable.
func applyLandlock() (string, error) {
	abi := LandlockABI()
	if abi < 1 {
		return "", nil
	}
	fsMask := handledFS(abi)
	attr := llRulesetAttr{fs: fsMask}
	size := unsafe.Sizeof(uint64(0)) // ABI 1-3: handled_access_fs only
	parts := []string{"fs"}
	if abi >= 4 {
		attr.net = unix.LANDLOCK_ACCESS_NET_CONNECT_TCP
		size = 2 * unsafe.Sizeof(uint64(0))
		parts = append(parts, fmt.Sprintf("tcp connect %d only", RelayPort))
	}
	if abi >= 6 {
		attr.scoped = unix.LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | unix.LANDLOCK_SCOPE_SIGNAL
		size = unsafe.Sizeof(attr)
		parts = append(parts, "scoped signals and abstract sockets")
	}
	rfd, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, uintptr(unsafe.Pointer(&attr)), size, 0)
	if errno != 0 {
		return "", fmt.Errorf("landlock: create ruleset: %w", errno)
	}
	defer unix.Close(int(rfd))
	for _, r := range landlockRules() {
		fd, err := unix.Open(r.path, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			if err == unix.ENOENT {
				continue // an absent device node needs no rule
			}
			return "", fmt.Errorf("landlock: open %s: %w", r.path, err)
		}
		access := r.access & fsMask
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			access &= llRead | llFileWrite | unix.LANDLOCK_ACCESS_FS_IOCTL_DEV
			access &^= unix.LANDLOCK_ACCESS_FS_READ_DIR
		}
		pb := unix.LandlockPathBeneathAttr{Allowed_access: access, Parent_fd: int32(fd)}
		_, _, errno := unix.Syscall6(unix.SYS_LANDLOCK_ADD_RULE, rfd, unix.LANDLOCK_RULE_PATH_BENEATH, uintptr(unsafe.Pointer(&pb)), 0, 0, 0)
		unix.Close(fd)
		if errno != 0 {
			return "", fmt.Errorf("landlock: rule for %s: %w", r.path, errno)
		}
	}
	if abi >= 4 {
		np := llNetPortAttr{allowed: unix.LANDLOCK_ACCESS_NET_CONNECT_TCP, port: RelayPort}
		_, _, errno := unix.Syscall6(unix.SYS_LANDLOCK_ADD_RULE, rfd, llRuleNetPort, uintptr(unsafe.Pointer(&np)), 0, 0, 0)
		if errno != 0 {
			return "", fmt.Errorf("landlock: tcp port rule: %w", errno)
		}
	}
	if _, _, errno := unix.Syscall(unix.SYS_LANDLOCK_RESTRICT_SELF, rfd, 0, 0); errno != 0 {
		return "", fmt.Errorf("landlock: restrict self: %w", errno)
	}
	return fmt.Sprintf("abi %d: %s", abi, strings.Join(parts, ", ")), nil
}
