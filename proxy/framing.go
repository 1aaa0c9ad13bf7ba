package proxy

import (
	"bytes"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"

	"github.com/sluicehq/sluice/rules"
)

// framingGuard sits between a client connection and the HTTP parser and
// refuses request heads that are ambiguous before any parser or policy sees
// them: conflicting Content-Length/Transfer-Encoding, duplicate Host, a Host
// header that differs from an absolute-form target, obs-fold, bare LF line
// ends, oversized heads and too many header fields. Go's parser resolves some
// of these silently (it drops Content-Length when chunked, it ignores Host for
// absolute-form targets); a security proxy must refuse them instead, because a
// server behind us may resolve them differently.
//
// To find where the next head starts it follows each request's body framing
// (Content-Length or chunked) without buffering the body. After a CONNECT or
// an Upgrade request the stream is no longer HTTP, and the guard steps aside.
type framingGuard struct {
	r        io.Reader
	maxHead  int
	maxCount int

	state     framingState
	remaining int64 // bytes left in a Content-Length body or chunk
	line      []byte
	head      []byte  // head being collected (bounded by maxHead)
	buf       *[]byte // read buffer, from readBufs while bytes are in flight
	pending   []byte  // bytes read from r that are not yet classified
	ready     []byte  // classified bytes that may be returned
	violation *framingError
}

type framingState int

const (
	stateHead framingState = iota
	stateBody
	stateChunkSize
	stateChunkData
	stateChunkDataCRLF
	stateTrailer
	statePassthrough
)

// framingError is a refused request head. Status is the HTTP status the
// client should get, Reason the machine-readable code.
type framingError struct {
	Status int
	Reason rules.Reason
	Detail string
}

func (e *framingError) Error() string { return "proxy: refused request head: " + e.Detail }

// readBufs holds the guard's read buffers: an idle keep-alive connection
// should not pin one, since the benchmark counts memory per idle connection.
var readBufs = sync.Pool{New: func() any { b := make([]byte, 4096); return &b }}

func newFramingGuard(r io.Reader, maxHead, maxCount int) *framingGuard {
	return &framingGuard{r: r, maxHead: maxHead, maxCount: maxCount}
}

// buffered reports whether the guard holds bytes it has read but not yet
// returned.
func (g *framingGuard) buffered() bool { return len(g.pending) > 0 || len(g.ready) > 0 }

// Violation returns the refused head's error, or nil.
func (g *framingGuard) Violation() *framingError { return g.violation }

func (g *framingGuard) Read(p []byte) (int, error) {
	if g.violation != nil {
		return 0, g.violation
	}
	for len(g.ready) == 0 {
		if g.state == statePassthrough && len(g.pending) == 0 {
			return g.r.Read(p)
		}
		if g.state == stateBody && len(g.pending) == 0 {
			// Fast path: a Content-Length body is passed straight through.
			if int64(len(p)) > g.remaining {
				p = p[:g.remaining]
			}
			n, err := g.r.Read(p)
			g.remaining -= int64(n)
			if g.remaining == 0 {
				g.state = stateHead
			}
			return n, err
		}
		if len(g.pending) == 0 {
			if g.buf == nil {
				g.buf = readBufs.Get().(*[]byte)
			}
			buf := *g.buf
			n, err := g.r.Read(buf)
			if n == 0 {
				if err == nil {
					continue
				}
				if err == io.EOF && len(g.head) > 0 {
					return 0, io.ErrUnexpectedEOF
				}
				return 0, err
			}
			g.pending = buf[:n]
		}
		if err := g.advance(); err != nil {
			return 0, err
		}
	}
	n := copy(p, g.ready)
	g.ready = g.ready[n:]
	if len(g.ready) == 0 && len(g.pending) == 0 && g.buf != nil {
		readBufs.Put(g.buf)
		g.buf = nil
	}
	return n, nil
}

// passCounted releases up to remaining bytes of a body or chunk, and moves
// to next once they are all through.
func (g *framingGuard) passCounted(next framingState) {
	n := min(int64(len(g.pending)), g.remaining)
	g.ready, g.pending = g.pending[:n], g.pending[n:]
	g.remaining -= n
	if g.remaining == 0 {
		g.state = next
	}
}

// advance classifies bytes from pending into ready according to the state.
func (g *framingGuard) advance() error {
	switch g.state {
	case statePassthrough:
		g.ready, g.pending = g.pending, nil
	case stateBody:
		g.passCounted(stateHead)
	case stateChunkData:
		g.passCounted(stateChunkDataCRLF)
	case stateHead:
		i := bytes.IndexByte(g.pending, '\n')
		if i < 0 {
			g.head = append(g.head, g.pending...)
			g.pending = nil
			if len(g.head) > g.maxHead {
				return g.refuse(431, rules.ReasonBadRequest, "request head too large")
			}
			return nil
		}
		g.head = append(g.head, g.pending[:i+1]...)
		g.pending = g.pending[i+1:]
		if len(g.head) > g.maxHead {
			return g.refuse(431, rules.ReasonBadRequest, "request head too large")
		}
		if !bytes.HasSuffix(g.head, []byte("\r\n\r\n")) {
			if bytes.Equal(g.head, []byte("\r\n")) {
				// RFC 9112 2.2: empty lines before the request line are ignored.
				g.ready, g.head = g.head, nil
			}
			return nil
		}
		head := g.head
		g.head = nil
		next, remaining, err := g.checkHead(head)
		if err != nil {
			return err
		}
		g.ready = head
		g.state, g.remaining = next, remaining
	case stateChunkSize, stateChunkDataCRLF, stateTrailer:
		i := bytes.IndexByte(g.pending, '\n')
		if i < 0 {
			g.line = append(g.line, g.pending...)
			g.ready, g.pending = g.pending, nil
			if len(g.line) > 4096 {
				return g.refuse(400, rules.ReasonBadRequest, "chunk framing line too long")
			}
			return nil
		}
		g.line = append(g.line, g.pending[:i+1]...)
		g.ready, g.pending = g.pending[:i+1], g.pending[i+1:]
		line := g.line
		g.line = g.line[:0]
		if len(line) > 4096 || !bytes.HasSuffix(line, []byte("\r\n")) {
			return g.refuse(400, rules.ReasonBadRequest, "malformed chunk framing")
		}
		line = line[:len(line)-2]
		switch g.state {
		case stateChunkDataCRLF:
			if len(line) != 0 {
				return g.refuse(400, rules.ReasonBadRequest, "malformed chunk framing")
			}
			g.state = stateChunkSize
		case stateTrailer:
			if len(line) == 0 {
				g.state = stateHead
			}
		case stateChunkSize:
			if j := bytes.IndexByte(line, ';'); j >= 0 {
				line = line[:j]
			}
			size, err := strconv.ParseInt(string(bytes.TrimRight(line, " \t")), 16, 64)
			if err != nil || size < 0 || len(line) == 0 || line[0] == '+' || line[0] == '-' {
				return g.refuse(400, rules.ReasonBadRequest, "malformed chunk size")
			}
			if size == 0 {
				g.state = stateTrailer
			} else {
				g.state, g.remaining = stateChunkData, size
			}
		}
	}
	return nil
}

func (g *framingGuard) refuse(status int, reason rules.Reason, detail string) error {
	g.violation = &framingError{Status: status, Reason: reason, Detail: detail}
	g.pending, g.ready, g.head = nil, nil, nil
	return g.violation
}

// checkHead validates one complete request head (ending in CRLFCRLF) and
// returns the framing state of what follows it. It runs on every request, so
// it walks the bytes once and allocates only for the few headers it keeps.
func (g *framingGuard) checkHead(head []byte) (framingState, int64, error) {
	body := head[:len(head)-4]
	if bytes.IndexByte(body, '\n') >= 0 || bytes.IndexByte(body, '\r') >= 0 {
		// Every line must end in CRLF: no bare CR or LF inside a line.
		for rest := body; len(rest) > 0; {
			i := bytes.Index(rest, crlf)
			line := rest
			if i >= 0 {
				line, rest = rest[:i], rest[i+2:]
			} else {
				rest = nil
			}
			if bytes.IndexByte(line, '\n') >= 0 || bytes.IndexByte(line, '\r') >= 0 {
				return 0, 0, g.refuse(400, rules.ReasonBadRequest, "bare CR or LF in request head")
			}
		}
	}
	reqLine, rest, _ := bytes.Cut(body, crlf)
	sp1 := bytes.IndexByte(reqLine, ' ')
	sp2 := bytes.LastIndexByte(reqLine, ' ')
	if sp1 <= 0 || sp2 <= sp1+1 || bytes.IndexByte(reqLine[sp1+1:sp2], ' ') >= 0 || !bytes.HasPrefix(reqLine[sp2+1:], []byte("HTTP/1.")) {
		return 0, 0, g.refuse(400, rules.ReasonBadRequest, "malformed request line")
	}
	method, target := reqLine[:sp1], reqLine[sp1+1:sp2]
	var (
		count              int
		host               []byte
		hosts, cls, tes    int
		contentLength      []byte
		transferEncoding   []byte
		upgrade, badLength bool
	)
	for len(rest) > 0 {
		var l []byte
		l, rest, _ = bytes.Cut(rest, crlf)
		count++
		if count > g.maxCount {
			return 0, 0, g.refuse(431, rules.ReasonBadRequest, "too many header fields")
		}
		if len(l) == 0 {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "empty header line")
		}
		if l[0] == ' ' || l[0] == '\t' {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "obsolete header line folding")
		}
		colon := bytes.IndexByte(l, ':')
		if colon <= 0 || !isToken(l[:colon]) {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "malformed header field")
		}
		name, value := l[:colon], bytes.TrimSpace(l[colon+1:])
		switch len(name) {
		case 4:
			if asciiEqualFold(name, "host") {
				hosts++
				host = value
			}
		case 7:
			if asciiEqualFold(name, "upgrade") {
				upgrade = true
			}
		case 14:
			if asciiEqualFold(name, "content-length") {
				if cls > 0 && !bytes.Equal(value, contentLength) {
					badLength = true
				}
				cls++
				contentLength = value
			}
		case 17:
			if asciiEqualFold(name, "transfer-encoding") {
				tes++
				transferEncoding = value
			}
		}
	}
	if hosts > 1 {
		return 0, 0, g.refuse(400, rules.ReasonBadRequest, "duplicate Host header")
	}
	if cls > 0 && tes > 0 {
		return 0, 0, g.refuse(400, rules.ReasonBadRequest, "both Content-Length and Transfer-Encoding")
	}
	if tes > 1 || (tes == 1 && !asciiEqualFold(transferEncoding, "chunked")) {
		return 0, 0, g.refuse(400, rules.ReasonBadRequest, "unsupported Transfer-Encoding")
	}
	var length int64
	if cls > 0 {
		n, ok := parseDecimal(contentLength)
		if !ok || badLength {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "invalid or conflicting Content-Length")
		}
		length = n
	}
	if string(method) == "CONNECT" {
		if hosts == 1 && !sameAuthority(string(host), string(target)) {
			return 0, 0, g.refuse(400, rules.ReasonHostMismatch, "Host header differs from CONNECT target")
		}
		return statePassthrough, 0, nil
	}
	if target[0] != '/' && !(len(target) == 1 && target[0] == '*') {
		scheme, after, ok := bytes.Cut(target, []byte("://"))
		if !ok || len(scheme) == 0 {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "malformed request target")
		}
		authority := after
		if i := bytes.IndexAny(after, "/?#"); i >= 0 {
			authority = after[:i]
		}
		if len(authority) == 0 {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "malformed request target")
		}
		if bytes.IndexByte(authority, '@') >= 0 {
			return 0, 0, g.refuse(400, rules.ReasonBadRequest, "userinfo in request target")
		}
		if hosts == 1 && !bytes.EqualFold(host, authority) && !sameAuthority(string(host), withDefaultPort(string(authority), string(scheme))) {
			return 0, 0, g.refuse(400, rules.ReasonHostMismatch, "Host header differs from absolute-form target")
		}
	}
	if upgrade {
		// After a protocol switch the bytes are no longer HTTP requests.
		return statePassthrough, 0, nil
	}
	switch {
	case tes == 1:
		return stateChunkSize, 0, nil
	case length > 0:
		return stateBody, length, nil
	}
	return stateHead, 0, nil
}

var crlf = []byte("\r\n")

func parseDecimal(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

func withDefaultPort(authority, scheme string) string {
	if _, _, err := net.SplitHostPort(authority); err == nil {
		return authority
	}
	if strings.EqualFold(scheme, "https") {
		return net.JoinHostPort(strings.Trim(authority, "[]"), "443")
	}
	return net.JoinHostPort(strings.Trim(authority, "[]"), "80")
}

// sameAuthority compares host[:port] forms case-insensitively, treating a
// missing port as equal to the default port of the other side only when both
// name the same host.
func sameAuthority(a, b string) bool {
	if strings.EqualFold(a, b) {
		return true
	}
	ah, ap := splitHostPortLoose(a)
	bh, bp := splitHostPortLoose(b)
	if !strings.EqualFold(strings.TrimSuffix(ah, "."), strings.TrimSuffix(bh, ".")) {
		return false
	}
	return ap == bp || ap == "" || bp == ""
}

func splitHostPortLoose(s string) (string, string) {
	if h, p, err := net.SplitHostPort(s); err == nil {
		return h, p
	}
	return strings.Trim(s, "[]"), ""
}

func isToken(b []byte) bool {
	for _, c := range b {
		if c <= ' ' || c >= 0x7f || strings.IndexByte("()<>@,;:\\\"/[]?={}", c) >= 0 {
			return false
		}
	}
	return len(b) > 0
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}
