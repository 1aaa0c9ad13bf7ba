package broker

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
)

// scrubChunk is how much the Scrubber reads from the body at a time.
const scrubChunk = 32 << 10

// Scrubber is an io.ReadCloser that replaces every occurrence of any of its
// secrets in a streamed body, including occurrences split across reads. It
// never holds more than one read chunk plus the longest secret minus one byte,
// and between reads it holds back only a tail that is the start of a secret
// the next read could complete, so a streamed body is not delayed.
//
// Where occurrences overlap, the leftmost wins, and of several secrets
// starting at the same byte the longest wins, so a secret that is a prefix of
// another never leaves the longer one's remainder behind.
//
// Compressed bodies cannot be scrubbed byte-wise: the proxy asks upstream for
// Accept-Encoding: identity on every request that carries a secret and refuses
// (502) a response that still arrives encoded; see CheckScrubbable.
type Scrubber struct {
	src     io.ReadCloser
	secrets [][]byte
	repl    []byte
	maxLen  int

	// buf holds the current window of the body. Bytes before ready have been
	// scanned (matches lists the secrets found there); bytes from ready on
	// are the undecided tail plus fresh reads. Read copies straight from buf,
	// so a body without secrets is copied once more than it would be anyway.
	buf     []byte
	pooled  *[]byte // buf's backing array when it came from scrubBufs
	rpos    int     // next byte of buf to return
	ready   int
	matches []match
	mi      int // next entry of matches
	replOff int // bytes of repl already returned for the current match; len(repl): none pending
	next    []int

	err      error // sticky error from src (io.EOF included)
	scrubbed bool
}

type match struct{ start, len int }

// NewScrubber wraps body. Empty and duplicate secrets are ignored; a nil
// replacement means Redacted. With no secrets left the body is passed through.
func NewScrubber(body io.ReadCloser, secrets [][]byte, replacement []byte) *Scrubber {
	if replacement == nil {
		replacement = []byte(Redacted)
	}
	s := &Scrubber{src: body, repl: replacement, replOff: len(replacement)}
	seen := make(map[string]bool, len(secrets))
	for _, sec := range secrets {
		if len(sec) == 0 || seen[string(sec)] {
			continue
		}
		seen[string(sec)] = true
		s.secrets = append(s.secrets, bytes.Clone(sec))
		s.maxLen = max(s.maxLen, len(sec))
	}
	if len(s.secrets) > 0 {
		s.next = make([]int, len(s.secrets))
	}
	return s
}

// scrubBufs recycles window buffers: every response to a request that
// carried a secret gets a Scrubber, and a fresh 32 KiB buffer each time
// showed up as a tenth of the proxy's CPU (allocation and GC).
var scrubBufs = sync.Pool{New: func() any { b := make([]byte, 0, scrubChunk+pooledSecretMax); return &b }}

// pooledSecretMax is the longest secret whose window fits a pooled buffer;
// longer ones get a buffer of their own.
const pooledSecretMax = 512

func (s *Scrubber) window() {
	if s.maxLen <= pooledSecretMax {
		s.pooled = scrubBufs.Get().(*[]byte)
		s.buf = (*s.pooled)[:0]
		return
	}
	s.buf = make([]byte, 0, scrubChunk+s.maxLen)
}

// Scrubbed reports whether at least one secret has been replaced so far; the
// proxy reads it after the body is done to mark the audit record.
func (s *Scrubber) Scrubbed() bool { return s.scrubbed }

// Close closes the underlying body and releases the window; a Read after
// Close fails.
func (s *Scrubber) Close() error {
	if s.pooled != nil {
		*s.pooled = s.buf[:0]
		scrubBufs.Put(s.pooled)
		s.pooled = nil
	}
	s.buf, s.rpos, s.ready, s.matches, s.mi = nil, 0, 0, nil, 0
	if s.err == nil {
		s.err = errScrubberClosed
	}
	return s.src.Close()
}

var errScrubberClosed = errors.New("broker: read from a closed scrubber")

// Read implements io.Reader.
func (s *Scrubber) Read(p []byte) (int, error) {
	if len(s.secrets) == 0 {
		return s.src.Read(p)
	}
	if s.buf == nil {
		if s.err != nil {
			return 0, s.err
		}
		s.window()
	}
	n := 0
	for n < len(p) {
		if s.replOff < len(s.repl) {
			c := copy(p[n:], s.repl[s.replOff:])
			s.replOff += c
			n += c
			continue
		}
		if s.rpos < s.ready {
			end := s.ready
			if s.mi < len(s.matches) {
				m := s.matches[s.mi]
				if m.start == s.rpos {
					s.rpos += m.len
					s.mi++
					s.replOff = 0
					s.scrubbed = true
					continue
				}
				end = m.start
			}
			c := copy(p[n:], s.buf[s.rpos:end])
			s.rpos += c
			n += c
			continue
		}
		if n > 0 {
			break
		}
		if s.err != nil && s.ready == len(s.buf) {
			return 0, s.err
		}
		// Everything scanned has been returned: keep the undecided tail at
		// the front, read more and scan again.
		s.buf = s.buf[:copy(s.buf, s.buf[s.ready:])]
		s.rpos, s.ready = 0, 0
		if s.err == nil {
			s.fill()
		}
		s.scan(s.err != nil)
	}
	return n, nil
}

// fill appends one read from src to buf.
func (s *Scrubber) fill() {
	start := len(s.buf)
	n, err := s.src.Read(s.buf[start:cap(s.buf)])
	s.buf = s.buf[:start+n]
	if err != nil {
		s.err = err
	}
}

// scan finds the matches in the part of buf that can no longer be extended
// by later reads (all of it at the end of the stream) and moves ready past it.
func (s *Scrubber) scan(final bool) {
	buf := s.buf
	limit := len(buf)
	if !final {
		// A match starting at or after limit might be longer than what we
		// hold. Hold back only a tail that is still the start of a secret,
		// not a fixed maxLen-1 bytes: a streamed body (server-sent events)
		// would otherwise wait for the origin's next event before the end
		// of the current one reached the client.
		limit = s.undecided(buf)
	}
	for i := range s.next {
		s.next[i] = -2 // unknown
	}
	s.matches, s.mi = s.matches[:0], 0
	pos := 0
	for pos < limit {
		best, bestLen := -1, 0
		for i, sec := range s.secrets {
			// next[i] caches where secret i next occurs (-1: nowhere), valid
			// while it is not behind pos.
			if s.next[i] == -2 || (s.next[i] >= 0 && s.next[i] < pos) {
				if j := bytes.Index(buf[pos:], sec); j >= 0 {
					s.next[i] = pos + j
				} else {
					s.next[i] = -1
				}
			}
			if at := s.next[i]; at >= 0 && (best < 0 || at < best || (at == best && len(sec) > bestLen)) {
				best, bestLen = at, len(sec)
			}
		}
		if best < 0 || best >= limit {
			break
		}
		s.matches = append(s.matches, match{best, bestLen})
		pos = best + bestLen
	}
	s.ready = max(pos, limit, 0)
}

// undecided returns where the tail of buf that is a proper prefix of some
// secret begins (the earliest such position), or len(buf) if there is none.
func (s *Scrubber) undecided(buf []byte) int {
	for i := max(0, len(buf)-(s.maxLen-1)); i < len(buf); i++ {
		tail := buf[i:]
		for _, sec := range s.secrets {
			if len(tail) < len(sec) && bytes.HasPrefix(sec, tail) {
				return i
			}
		}
	}
	return len(buf)
}

// ScrubHeader removes secrets from h in place and reports whether it changed
// anything. A value containing a secret has each occurrence replaced by
// Redacted; a header whose name contains a secret (compared without case,
// since names are canonicalised) is dropped entirely. Call it on the
// response's Header and Trailer.
func ScrubHeader(h http.Header, secrets [][]byte) bool {
	changed := false
	for name, values := range h {
		lname := strings.ToLower(name)
		drop := false
		for _, sec := range secrets {
			if len(sec) > 0 && strings.Contains(lname, strings.ToLower(string(sec))) {
				drop = true
				break
			}
		}
		if drop {
			delete(h, name)
			changed = true
			continue
		}
		for i, v := range values {
			for _, sec := range secrets {
				if len(sec) > 0 && strings.Contains(v, string(sec)) {
					v = strings.ReplaceAll(v, string(sec), Redacted)
					changed = true
				}
			}
			values[i] = v
		}
	}
	return changed
}

// ErrEncodedBody is returned by CheckScrubbable for a response the Scrubber
// cannot see into.
var ErrEncodedBody = errors.New("broker: response body has a content encoding and cannot be scrubbed")

// CheckScrubbable says whether a response to a request that carried a secret
// may be streamed through a Scrubber. Anything but an absent or "identity"
// Content-Encoding is refused: a gzip stream would carry a reflected secret
// past a byte-wise scrubber, so the proxy answers 502 instead.
func CheckScrubbable(h http.Header) error {
	for _, v := range h.Values("Content-Encoding") {
		for _, enc := range strings.Split(v, ",") {
			enc = strings.TrimSpace(enc)
			if enc != "" && !strings.EqualFold(enc, "identity") {
				return fmt.Errorf("%w (Content-Encoding %q)", ErrEncodedBody, enc)
			}
		}
	}
	return nil
}
