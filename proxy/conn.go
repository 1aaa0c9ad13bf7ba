package proxy

import (
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// trackedListener wraps the proxy listener so that every accepted connection
// has a maximum lifetime and is counted. goproxy hands hijacked connections
// over with no timeouts at all; the lifetime timer here is the backstop that
// holds even if some later code path forgets its own deadlines.
type trackedListener struct {
	net.Listener
	maxLifetime time.Duration
	maxConns    int64 // 0 = unlimited
	active      atomic.Int64

	mu    sync.Mutex
	conns map[*trackedConn]struct{}
}

func newTrackedListener(l net.Listener, maxLifetime time.Duration, maxConns int) *trackedListener {
	return &trackedListener{Listener: l, maxLifetime: maxLifetime, maxConns: int64(maxConns), conns: make(map[*trackedConn]struct{})}
}

func (l *trackedListener) Accept() (net.Conn, error) {
	var c net.Conn
	for {
		var err error
		c, err = l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.maxConns <= 0 || l.active.Load() < l.maxConns {
			break
		}
		// Over the global connection cap: refuse at once rather than let
		// connections queue inside the proxy.
		_, _ = c.Write(overCapacity)
		_ = c.Close()
	}
	if tc, ok := c.(*net.TCPConn); ok {
		// Small writes (TLS records, response heads) must not wait for
		// delayed ACKs; Go sets this by default, but be explicit since the
		// splice path depends on it.
		_ = tc.SetNoDelay(true)
	}
	t := &trackedConn{Conn: c, l: l}
	l.active.Add(1)
	l.mu.Lock()
	l.conns[t] = struct{}{}
	l.mu.Unlock()
	if l.maxLifetime > 0 {
		t.timer = time.AfterFunc(l.maxLifetime, func() { _ = t.Close() })
	}
	return t, nil
}

// closeAll closes every connection still open; used at the end of a graceful
// shutdown for hijacked connections that http.Server no longer tracks.
func (l *trackedListener) closeAll() {
	l.mu.Lock()
	conns := make([]*trackedConn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// overCapacity is the whole response to a connection over the global cap.
var overCapacity = func() []byte {
	body := `{"error":"sluice is at its connection limit","reason":"rate_limited"}` + "\n"
	return []byte("HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: application/json\r\n" +
		"X-Sluice-Reason: rate_limited\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}()

type trackedConn struct {
	net.Conn
	l     *trackedListener
	timer *time.Timer
	once  sync.Once

	// held are the tenants this connection counts against (one, unless a
	// client switches credentials on a keep-alive connection), released
	// when it closes.
	mu     sync.Mutex
	held   []string
	frees  []func()
	closed bool
}

// holdTenant counts this connection against tenant's connection cap, once.
func (c *trackedConn) holdTenant(tenant string, acquire func(string) (func(), bool)) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, t := range c.held {
		if t == tenant {
			return true
		}
	}
	if c.closed {
		return false
	}
	release, ok := acquire(tenant)
	if !ok {
		return false
	}
	c.held = append(c.held, tenant)
	c.frees = append(c.frees, release)
	return true
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		if c.timer != nil {
			c.timer.Stop()
		}
		c.l.active.Add(-1)
		c.l.mu.Lock()
		delete(c.l.conns, c)
		c.l.mu.Unlock()
		c.mu.Lock()
		c.closed = true
		for _, free := range c.frees {
			free()
		}
		c.held, c.frees = nil, nil
		c.mu.Unlock()
	})
	return err
}

// CloseWrite lets the splice path half-close the client side.
func (c *trackedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}
