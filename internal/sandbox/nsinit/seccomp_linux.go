package nsinit

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// The seccomp filter refuses, with EPERM, the system calls a sandboxed program
// would use to leave its namespaces, reach the kernel's less-hardened
// interfaces or inspect other processes. It is an allow-by-default filter on
// purpose: the namespaces, capabilities and Landlock are the main walls, and a
// deny list keeps ordinary toolchains working.

const (
	seccompRetAllow       = 0x7fff0000
	seccompRetErrno       = 0x00050000
	seccompRetKillProcess = 0x80000000
	seccompSetModeFilter  = 1

	offNr   = 0
	offArch = 4
	offArg0 = 16 // low 32 bits (little-endian) of args[0]
	offArg1 = 24

	x32SyscallBit = 0x40000000

	// Namespace flags accepted by clone(2); CLONE_NEWTIME (0x80) shares its bit
	// with the exit-signal byte of clone(2) and is only checked for unshare.
	cloneNSFlags   = unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP
	unshareNSFlags = cloneNSFlags | unix.CLONE_NEWTIME
)

// deniedSyscalls are refused outright.
func deniedSyscalls() []uint32 {
	return []uint32{
		unix.SYS_SETNS,
		unix.SYS_IO_URING_SETUP, unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER,
		unix.SYS_PTRACE, unix.SYS_PROCESS_VM_READV, unix.SYS_PROCESS_VM_WRITEV,
		unix.SYS_BPF, unix.SYS_PERF_EVENT_OPEN, unix.SYS_USERFAULTFD,
		unix.SYS_MOUNT, unix.SYS_UMOUNT2, unix.SYS_PIVOT_ROOT, unix.SYS_MOVE_MOUNT,
		unix.SYS_FSOPEN, unix.SYS_FSCONFIG, unix.SYS_FSMOUNT, unix.SYS_FSPICK,
		unix.SYS_OPEN_TREE, unix.SYS_MOUNT_SETATTR,
		unix.SYS_KEYCTL, unix.SYS_ADD_KEY, unix.SYS_REQUEST_KEY,
		unix.SYS_KEXEC_LOAD, unix.SYS_KEXEC_FILE_LOAD,
		unix.SYS_INIT_MODULE, unix.SYS_FINIT_MODULE, unix.SYS_DELETE_MODULE,
		unix.SYS_OPEN_BY_HANDLE_AT, unix.SYS_NAME_TO_HANDLE_AT,
		unix.SYS_SWAPON, unix.SYS_SWAPOFF, unix.SYS_REBOOT, unix.SYS_ACCT, unix.SYS_QUOTACTL,
	}
}

func auditArch() (uint32, error) {
	switch runtime.GOARCH {
	case "amd64":
		return unix.AUDIT_ARCH_X86_64, nil
	case "arm64":
		return unix.AUDIT_ARCH_AARCH64, nil
	}
	return 0, fmt.Errorf("seccomp: architecture %s is not supported", runtime.GOARCH)
}

// asm is a tiny assembler for classic BPF with symbolic jump targets, so the
// filter reads top to bottom instead of as hand-counted offsets.
type asm struct {
	ins    []bpf.Instruction
	labels map[string]int
	fixups []fixup
}

type fixup struct {
	at     int
	jt, jf string
}

func (a *asm) emit(i bpf.Instruction) { a.ins = append(a.ins, i) }

func (a *asm) label(name string) { a.labels[name] = len(a.ins) }

// jump emits a conditional jump; "" means fall through.
func (a *asm) jump(cond bpf.JumpTest, val uint32, jt, jf string) {
	a.fixups = append(a.fixups, fixup{at: len(a.ins), jt: jt, jf: jf})
	a.emit(bpf.JumpIf{Cond: cond, Val: val})
}

func (a *asm) assemble() ([]bpf.RawInstruction, error) {
	for _, f := range a.fixups {
		j := a.ins[f.at].(bpf.JumpIf)
		for _, t := range []struct {
			name string
			dst  *uint8
		}{{f.jt, &j.SkipTrue}, {f.jf, &j.SkipFalse}} {
			if t.name == "" {
				continue
			}
			to, ok := a.labels[t.name]
			if !ok {
				return nil, fmt.Errorf("seccomp: undefined label %s", t.name)
			}
			skip := to - f.at - 1
			if skip < 0 || skip > 255 {
				return nil, fmt.Errorf("seccomp: jump to %s out of range", t.name)
			}
			*t.dst = uint8(skip)
		}
		a.ins[f.at] = j
	}
	return bpf.Assemble(a.ins)
}

// seccompProgram builds the filter for the running architecture.
func seccompProgram() ([]bpf.RawInstruction, error) {
	arch, err := auditArch()
	if err != nil {
		return nil, err
	}
	a := &asm{labels: map[string]int{}}
	a.emit(bpf.LoadAbsolute{Off: offArch, Size: 4})
	a.jump(bpf.JumpEqual, arch, "", "kill")
	a.emit(bpf.LoadAbsolute{Off: offNr, Size: 4})
	if runtime.GOARCH == "amd64" {
		// The x32 ABI reaches the same kernel code under other numbers.
		a.jump(bpf.JumpGreaterOrEqual, x32SyscallBit, "eperm", "")
	}
	for _, nr := range deniedSyscalls() {
		a.jump(bpf.JumpEqual, nr, "eperm", "")
	}
	a.jump(bpf.JumpEqual, unix.SYS_CLONE, "clone", "")
	a.jump(bpf.JumpEqual, unix.SYS_UNSHARE, "unshare", "")
	// clone3 passes its flags in memory a filter cannot read. ENOSYS makes
	// libc fall back to clone(2), whose flags are checked.
	a.jump(bpf.JumpEqual, unix.SYS_CLONE3, "enosys", "")
	a.jump(bpf.JumpEqual, unix.SYS_SOCKET, "socket", "")
	a.jump(bpf.JumpEqual, unix.SYS_IOCTL, "ioctl", "")
	a.emit(bpf.RetConstant{Val: seccompRetAllow})

	a.label("clone")
	a.emit(bpf.LoadAbsolute{Off: offArg0, Size: 4})
	a.jump(bpf.JumpBitsSet, cloneNSFlags, "eperm", "")
	a.emit(bpf.RetConstant{Val: seccompRetAllow})

	a.label("unshare")
	a.emit(bpf.LoadAbsolute{Off: offArg0, Size: 4})
	a.jump(bpf.JumpBitsSet, unshareNSFlags, "eperm", "")
	a.emit(bpf.RetConstant{Val: seccompRetAllow})

	a.label("socket")
	a.emit(bpf.LoadAbsolute{Off: offArg0, Size: 4})
	a.jump(bpf.JumpEqual, unix.AF_PACKET, "eperm", "")
	a.jump(bpf.JumpEqual, unix.AF_NETLINK, "eperm", "")
	a.emit(bpf.LoadAbsolute{Off: offArg1, Size: 4})
	a.emit(bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: 0xf}) // strip SOCK_NONBLOCK|SOCK_CLOEXEC
	a.jump(bpf.JumpEqual, unix.SOCK_RAW, "eperm", "")
	a.jump(bpf.JumpEqual, unix.SOCK_PACKET, "eperm", "")
	a.emit(bpf.RetConstant{Val: seccompRetAllow})

	a.label("ioctl")
	// TIOCSTI and TIOCLINUX push input into a terminal the sandbox shares
	// with its launcher.
	a.emit(bpf.LoadAbsolute{Off: offArg1, Size: 4})
	a.jump(bpf.JumpEqual, unix.TIOCSTI, "eperm", "")
	a.jump(bpf.JumpEqual, unix.TIOCLINUX, "eperm", "")
	a.emit(bpf.RetConstant{Val: seccompRetAllow})

	a.label("eperm")
	a.emit(bpf.RetConstant{Val: seccompRetErrno | uint32(unix.EPERM)})
	a.label("enosys")
	a.emit(bpf.RetConstant{Val: seccompRetErrno | uint32(unix.ENOSYS)})
	a.label("kill")
	a.emit(bpf.RetConstant{Val: seccompRetKillProcess})
	return a.assemble()
}

// installSeccomp loads the filter on the calling OS thread only. The caller
// holds runtime.LockOSThread and has set no_new_privs; the filter is inherited
// by every child that thread forks.
func installSeccomp() error {
	raw, err := seccompProgram()
	if err != nil {
		return err
	}
	filter := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	_, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, seccompSetModeFilter, 0, uintptr(unsafe.Pointer(&prog)))
	runtime.KeepAlive(filter)
	if errno != 0 {
		return fmt.Errorf("seccomp: loading filter: %w", errno)
	}
	return nil
}
