package sandbox

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"
)

const (
	maxRelayConns    = 256
	relayDialTimeout = 10 * time.Second
)

// relay carries every connection accepted on the sandbox's 127.0.0.1:3128 to
// the proxy, byte for byte. It adds nothing and reads nothing: the proxy sees
// exactly what the sandbox sent, credential included.
type relay struct {
	ln    net.Listener
	proxy string
	log   *slog.Logger

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
	sem    chan struct{}
}

func newRelay(ln net.Listener, proxy string, log *slog.Logger) *relay {
	return &relay{ln: ln, proxy: proxy, log: log, conns: map[net.Conn]struct{}{}, sem: make(chan struct{}, maxRelayConns)}
}

func (r *relay) dial(ctx context.Context) (net.Conn, error) {
	d := net.Dialer{Timeout: relayDialTimeout}
	if p, ok := strings.CutPrefix(r.proxy, "unix:"); ok {
		return d.DialContext(ctx, "unix", p)
	}
	return d.DialContext(ctx, "tcp", r.proxy)
}

func (r *relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *relay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

// serve accepts until the listener is closed.
func (r *relay) serve(ctx context.Context) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			c, err := r.ln.Accept()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					r.log.Debug("sandbox relay accept failed", "err", err)
				}
				return
			}
			select {
			case r.sem <- struct{}{}:
			default:
				c.Close() // too many at once: refuse rather than queue without bound
				continue
			}
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				defer func() { <-r.sem }()
				r.handle(ctx, c)
			}()
		}
	}()
}

func (r *relay) handle(ctx context.Context, in net.Conn) {
	if !r.track(in) {
		in.Close()
		return
	}
	defer r.untrack(in)
	out, err := r.dial(ctx)
	if err != nil {
		r.log.Warn("sandbox relay cannot reach the proxy", "proxy", r.proxy, "err", err)
		return
	}
	if !r.track(out) {
		out.Close()
		return
	}
	defer r.untrack(out)
	var wg sync.WaitGroup
	wg.Add(2)
	go pipe(&wg, out, in)
	go pipe(&wg, in, out)
	wg.Wait()
}

// pipe copies one direction and then half-closes, so request/response
// protocols that rely on EOF keep working.
func pipe(wg *sync.WaitGroup, dst, src net.Conn) {
	defer wg.Done()
	_, err := io.Copy(dst, src)
	if cw, ok := dst.(interface{ CloseWrite() error }); ok && err == nil {
		_ = cw.CloseWrite()
	} else {
		dst.Close()
	}
}

// close stops accepting, cuts every relayed connection and waits for the
// goroutines to finish.
func (r *relay) close() {
	r.ln.Close()
	r.mu.Lock()
	r.closed = true
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}
