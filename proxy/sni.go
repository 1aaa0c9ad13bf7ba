package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"time"
)

// maxClientHello bounds what is read while looking for the SNI. Post-quantum
// key shares make hellos ~1.8 KiB; 64 KiB is far above any real client.
const maxClientHello = 64 << 10

var errHelloCaptured = errors.New("client hello captured")

// peekClientHello reads the client's TLS ClientHello from r and returns the
// server name it asks for together with every byte read, which the caller
// must replay to the upstream. It lets crypto/tls do the parsing (a hand-rolled
// parser is one more thing to get wrong) by starting a server handshake on a
// connection that records what it reads and aborting it once the hello is in.
func peekClientHello(ctx context.Context, r io.Reader) (serverName string, hello []byte, err error) {
	rec := &recordingConn{r: io.LimitReader(r, maxClientHello)}
	var (
		captured bool
		sni      string
	)
	srv := tls.Server(rec, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			captured, sni = true, h.ServerName
			return nil, errHelloCaptured
		},
	})
	_ = srv.HandshakeContext(ctx)
	if !captured {
		return "", rec.buf.Bytes(), errors.New("proxy: tunnel did not start with a TLS ClientHello")
	}
	return sni, rec.buf.Bytes(), nil
}

// recordingConn is the net.Conn the aborted handshake runs on: reads come from
// the client and are recorded, writes (the alert) are discarded.
type recordingConn struct {
	r   io.Reader
	buf bytes.Buffer
}

func (c *recordingConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.buf.Write(p[:n])
	return n, err
}

func (c *recordingConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *recordingConn) Close() error                     { return nil }
func (c *recordingConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *recordingConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *recordingConn) SetDeadline(time.Time) error      { return nil }
func (c *recordingConn) SetReadDeadline(time.Time) error  { return nil }
func (c *recordingConn) SetWriteDeadline(time.Time) error { return nil }
