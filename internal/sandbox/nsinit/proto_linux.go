package nsinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// The launcher and the in-namespace init talk over a SOCK_SEQPACKET
// socketpair: one small JSON message per packet, so no framing is needed, and
// SCM_RIGHTS carries the relay's listening socket out of the namespace. The
// config, which may be large (argv, CA bundle), travels in a memfd instead.

const (
	maxMsg        = 64 << 10
	maxConfigSize = 16 << 20
)

// Message types.
const (
	MsgConfig  = "config"  // launcher → init: the config memfd is ready, the init is in its cgroup, the launch is recorded
	MsgReady   = "ready"   // init → launcher: mounts done, listener attached
	MsgGo      = "go"      // launcher → init (Config.WaitGo only): workspace copied in, start the command
	MsgStarted = "started" // init → launcher: the command runs
	MsgExited  = "exited"  // init → launcher: the command exited, the rest is killed
	MsgDone    = "done"    // launcher → init (Config.Keep only): workspace copied out, exit now
	MsgError   = "error"   // init → launcher: setup failed
)

// Message is one control packet.
type Message struct {
	Type     string `json:"type"`
	Error    string `json:"error,omitempty"`
	Exit     int    `json:"exit,omitempty"`
	Signal   int    `json:"signal,omitempty"`
	Landlock string `json:"landlock,omitempty"`
}

// Config is everything the init needs. It holds the sandbox environment
// (with the proxy token): it only ever travels in a private memfd.
type Config struct {
	Hostname        string   `json:"hostname"`
	RootDir         string   `json:"root_dir"`
	Argv            []string `json:"argv"`
	Env             []string `json:"env"`
	CABundle        []byte   `json:"ca_bundle,omitempty"`
	DiskBytes       int64    `json:"disk_bytes"`
	Files           int64    `json:"files"`
	TmpBytes        int64    `json:"tmp_bytes"`
	TmpFiles        int64    `json:"tmp_files"`
	Rlimits         bool     `json:"rlimits"` // no cgroup applied: set rlimits instead
	MemoryBytes     int64    `json:"memory_bytes"`
	Pids            int64    `json:"pids"`
	CPUSeconds      int64    `json:"cpu_seconds"`
	AllowNoLandlock bool     `json:"allow_no_landlock"`
	// WaitGo: wait for MsgGo after MsgReady (the launcher copies the
	// workspace in first). Otherwise the command starts right after setup.
	WaitGo bool `json:"wait_go"`
	// Keep: stay alive after MsgExited until MsgDone, so the launcher can
	// copy /workspace out. Otherwise exit at once.
	Keep bool `json:"keep"`
}

// Conn is one end of the control socket.
type Conn struct{ FD int }

// Send writes one message, with fds passed as SCM_RIGHTS.
func (c Conn) Send(m Message, fds ...int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return fmt.Errorf("encoding %s message: %w", m.Type, err)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	for {
		err = unix.Sendmsg(c.FD, b, oob, nil, 0)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("sending %s message: %w", m.Type, err)
	}
	return nil
}

// Recv reads one message and any file descriptors passed with it.
func (c Conn) Recv() (Message, []int, error) {
	buf := make([]byte, maxMsg)
	oob := make([]byte, unix.CmsgSpace(4*4))
	var n, oobn, flags int
	var err error
	for {
		n, oobn, flags, _, err = unix.Recvmsg(c.FD, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return Message{}, nil, fmt.Errorf("receiving: %w", err)
	}
	var fds []int
	if oobn > 0 {
		scms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return Message{}, nil, fmt.Errorf("parsing control message: %w", err)
		}
		for _, s := range scms {
			got, err := unix.ParseUnixRights(&s)
			if err == nil {
				fds = append(fds, got...)
			}
		}
	}
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if n == 0 {
		closeAll()
		return Message{}, nil, errors.New("peer closed the control socket")
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeAll()
		return Message{}, nil, errors.New("control message truncated")
	}
	var m Message
	if err := json.Unmarshal(buf[:n], &m); err != nil {
		closeAll()
		return Message{}, nil, fmt.Errorf("decoding control message: %w", err)
	}
	return m, fds, nil
}

// Socketpair returns the launcher's and the init's ends of a new control
// socket (SOCK_SEQPACKET, close-on-exec).
func Socketpair() (parent, child *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("control socketpair: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "sluice-control"), os.NewFile(uintptr(fds[1]), "sluice-control-init"), nil
}

// WriteConfig puts cfg in a sealed memfd for the init to read.
func WriteConfig(cfg *Config) (*os.File, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("encoding init config: %w", err)
	}
	if len(b) > maxConfigSize {
		return nil, fmt.Errorf("init config is %d bytes, more than %d (command line or CA bundle too large)", len(b), maxConfigSize)
	}
	fd, err := unix.MemfdCreate("sluice-init-config", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd for init config: %w", err)
	}
	f := os.NewFile(uintptr(fd), "sluice-init-config")
	if _, err := f.Write(b); err != nil {
		f.Close()
		return nil, fmt.Errorf("writing init config: %w", err)
	}
	_, _ = unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_WRITE|unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL)
	return f, nil
}

// readConfig reads the sealed memfd. It sizes the buffer from fstat rather
// than the 16 MiB bound: a config is a few KiB, and the init's start-up is
// on every launch's critical path.
func readConfig(f *os.File) (*Config, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("reading init config: %w", err)
	}
	if fi.Size() > maxConfigSize {
		return nil, errors.New("init config too large")
	}
	b := make([]byte, fi.Size()+1) // one more, to see a file that grew
	n, err := f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("reading init config: %w", err)
	}
	if n != int(fi.Size()) {
		return nil, errors.New("init config changed while being read")
	}
	var cfg Config
	if err := json.Unmarshal(b[:n], &cfg); err != nil {
		return nil, fmt.Errorf("decoding init config: %w", err)
	}
	return &cfg, nil
}

// CloseFDs closes received descriptors nobody will use.
func CloseFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
