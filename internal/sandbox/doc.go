// Package sandbox answers one question: "run this command where the proxy is
// the only way out".
//
// A Launcher starts the sluice binary itself as the init of a fresh set of
// Linux namespaces (user, mount, pid, net, uts, ipc, cgroup); the init's
// side is package nsinit, which takes the process over before the rest of
// the binary is initialised, so a launch pays for one full start of sluice,
// not two. The init builds
// a read-only root on a tmpfs skeleton with a capped workspace and /tmp, a
// fresh /proc and a minimal /dev, brings up lo and opens 127.0.0.1:3128, whose
// listening socket it hands to the launcher: every connection the sandbox
// makes to it is relayed by the launcher, outside, to the proxy. There is no
// other interface, no route and no DNS. Limits come from cgroups (v2 when
// delegated, v1 otherwise) or rlimits, and the command runs with
// no_new_privs, an empty capability bounding set, Landlock and a seccomp
// filter. The whole tree dies with the launcher, on timeout and on error.
package sandbox
