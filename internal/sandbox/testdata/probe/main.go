// Command probe is run inside a sandbox by the sandbox tests. Each subcommand
// tries one thing and prints "ok ..." or "errno=N ..." so the test can assert
// exactly why it failed.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"syscall"
	"time"
)

func errno(err error) string {
	var e syscall.Errno
	if errors.As(err, &e) {
		return fmt.Sprintf("errno=%d %v", int(e), err)
	}
	return "err " + err.Error()
}

func report(what string, err error) {
	if err != nil {
		fmt.Printf("%s: %s\n", what, errno(err))
		return
	}
	fmt.Printf("%s: ok\n", what)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Println("usage: probe CMD [ARG]")
		os.Exit(2)
	}
	arg := ""
	if len(os.Args) > 2 {
		arg = os.Args[2]
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	switch os.Args[1] {
	case "proxyget": // GET arg through $HTTP_PROXY, explicitly
		pu, err := url.Parse(os.Getenv("HTTP_PROXY"))
		if err != nil {
			report("proxyget", err)
			return
		}
		c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu)}, Timeout: 5 * time.Second}
		resp, err := c.Get(arg)
		if err != nil {
			report("proxyget", err)
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("proxyget: ok %d %s\n", resp.StatusCode, b)
	case "dial": // TCP connect to arg, no proxy
		d := net.Dialer{Timeout: 3 * time.Second}
		c, err := d.DialContext(ctx, "tcp", arg)
		if err == nil {
			c.Close()
		}
		report("dial "+arg, err)
	case "dns":
		_, err := net.DefaultResolver.LookupHost(ctx, arg)
		report("dns "+arg, err)
	case "selfconnect": // listen on arg inside the sandbox and connect to it
		ln, err := net.Listen("tcp4", arg)
		if err != nil {
			report("listen", err)
			return
		}
		defer ln.Close()
		c, err := net.DialTimeout("tcp4", arg, 3*time.Second)
		if err == nil {
			c.Close()
		}
		report("selfconnect "+arg, err)
	case "unshare":
		report("unshare", syscall.Unshare(syscall.CLONE_NEWNET))
	case "unshare-user":
		report("unshare-user", syscall.Unshare(syscall.CLONE_NEWUSER))
	case "rawsocket":
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_ICMP)
		if err == nil {
			syscall.Close(fd)
		}
		report("rawsocket", err)
	case "packet":
		fd, err := syscall.Socket(syscall.AF_PACKET, syscall.SOCK_DGRAM, 0)
		if err == nil {
			syscall.Close(fd)
		}
		report("packet", err)
	case "netlink":
		fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW, syscall.NETLINK_ROUTE)
		if err == nil {
			syscall.Close(fd)
		}
		report("netlink", err)
	case "mount":
		report("mount", syscall.Mount("none", "/tmp", "tmpfs", 0, ""))
	case "iouring":
		_, _, e := syscall.Syscall(425, 8, 0, 0) // io_uring_setup
		var err error
		if e != 0 {
			err = e
		}
		report("iouring", err)
	case "ptrace":
		_, _, e := syscall.Syscall(syscall.SYS_PTRACE, syscall.PTRACE_ATTACH, 1, 0)
		var err error
		if e != 0 {
			err = e
		}
		report("ptrace", err)
	case "write": // create a file at arg
		err := os.WriteFile(arg, []byte("x"), 0o644)
		report("write "+arg, err)
	case "killinit":
		report("killinit", syscall.Kill(1, syscall.SIGTERM))
	default:
		fmt.Println("unknown probe", os.Args[1])
		os.Exit(2)
	}
}
