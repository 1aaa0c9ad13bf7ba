// Package nsinit answers one question: how do fresh namespaces become the
// sandbox? It is the sandbox's PID 1: the launcher (package sandbox)
// re-executes the sluice binary as "sluice-init __sandbox-init" inside new
// user, mount, pid, net, uts, ipc and cgroup namespaces; the init builds the
// read-only root, /workspace, /tmp, /proc and /dev, brings up lo and opens
// the relay's listening socket, then applies no_new_privs, an empty
// capability bounding set, Landlock and seccomp to one thread, forks the
// command from it, reaps, and reports back over a private control socket.
//
// The package is deliberately light: it imports only packages whose
// initialisation is cheap and early (no net, no path/filepath, nothing of
// the proxy), because its init function runs the sandbox's init before the
// rest of the binary is initialised (see hook_linux.go).
package nsinit

// Paths and addresses inside the sandbox.
const (
	WorkspacePath = "/workspace"
	CABundlePath  = "/sluice/ca.pem"
	// RelayAddr is where the sandbox reaches the proxy: a listener inside the
	// sandbox's network namespace whose connections the launcher relays.
	RelayAddr = "127.0.0.1:3128"
	RelayPort = 3128
	// PATH is the sandbox's search path.
	PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// ExitLaunchFailed is the init's status when the sandbox could not be set
// up (the launcher reports the same status).
const ExitLaunchFailed = 125
