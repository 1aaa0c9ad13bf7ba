package nsinit

import (
	"testing"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// TestSeccompProgram runs the assembled filter in the x/net/bpf VM over
// synthetic seccomp_data and checks each decision.
func TestSeccompProgram(t *testing.T) {
	raw, err := seccompProgram()
	if err != nil {
		t.Fatal(err)
	}
	ins, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatal("filter does not disassemble")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatal(err)
	}
	arch, _ := auditArch()
	data := func(a uint32, nr uint32, args ...uint64) []byte {
		b := make([]byte, 64)
		le := func(off int, v uint64, n int) {
			for i := 0; i < n; i++ {
				b[off+i] = byte(v >> (8 * i))
			}
		}
		le(0, uint64(nr), 4)
		le(4, uint64(a), 4)
		for i, v := range args {
			le(16+8*i, v, 8)
		}
		return b
	}
	// The VM only reads big-endian; seccomp_data is native (little) endian,
	// so the filter's loads are checked against byte-swapped input below.
	swap := func(b []byte) []byte {
		out := make([]byte, len(b))
		for i := 0; i+4 <= len(b); i += 4 {
			out[i], out[i+1], out[i+2], out[i+3] = b[i+3], b[i+2], b[i+1], b[i]
		}
		return out
	}
	eperm := uint32(seccompRetErrno | uint32(unix.EPERM))
	cases := []struct {
		name string
		in   []byte
		want uint32
	}{
		{"getpid", data(arch, unix.SYS_GETPID), seccompRetAllow},
		{"wrong arch", data(arch^1, unix.SYS_GETPID), seccompRetKillProcess},
		{"mount", data(arch, unix.SYS_MOUNT), eperm},
		{"setns", data(arch, unix.SYS_SETNS), eperm},
		{"bpf", data(arch, unix.SYS_BPF), eperm},
		{"io_uring", data(arch, unix.SYS_IO_URING_SETUP), eperm},
		{"ptrace", data(arch, unix.SYS_PTRACE), eperm},
		{"clone thread", data(arch, unix.SYS_CLONE, unix.CLONE_VM|unix.CLONE_THREAD|unix.CLONE_SIGHAND), seccompRetAllow},
		{"clone newuser", data(arch, unix.SYS_CLONE, unix.CLONE_NEWUSER|uint64(unix.SIGCHLD)), eperm},
		{"clone3", data(arch, unix.SYS_CLONE3), seccompRetErrno | uint32(unix.ENOSYS)},
		{"unshare fs", data(arch, unix.SYS_UNSHARE, unix.CLONE_FS), seccompRetAllow},
		{"unshare net", data(arch, unix.SYS_UNSHARE, unix.CLONE_NEWNET), eperm},
		{"unshare time", data(arch, unix.SYS_UNSHARE, unix.CLONE_NEWTIME), eperm},
		{"tcp socket", data(arch, unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC), seccompRetAllow},
		{"unix socket", data(arch, unix.SYS_SOCKET, unix.AF_UNIX, unix.SOCK_STREAM), seccompRetAllow},
		{"raw socket", data(arch, unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_RAW|unix.SOCK_NONBLOCK), eperm},
		{"packet", data(arch, unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_DGRAM), eperm},
		{"netlink", data(arch, unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_DGRAM), eperm},
		{"ioctl tcgets", data(arch, unix.SYS_IOCTL, 0, unix.TCGETS), seccompRetAllow},
		{"ioctl tiocsti", data(arch, unix.SYS_IOCTL, 0, unix.TIOCSTI), eperm},
	}
	for _, c := range cases {
		got, err := vm.Run(swap(c.in))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if uint32(got) != c.want {
			t.Errorf("%s: filter returned %#x, want %#x", c.name, got, c.want)
		}
	}
}
