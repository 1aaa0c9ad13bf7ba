package proxy

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
)

// readAllRequests parses every request the guard lets through and returns
// them with the guard's violation, if any.
func readAllRequests(t *testing.T, raw string, oneByte bool) ([]*http.Request, *framingError) {
	t.Helper()
	var r io.Reader = strings.NewReader(raw)
	if oneByte {
		r = iotest.OneByteReader(r)
	}
	g := newFramingGuard(r, 4096, 20)
	br := bufio.NewReader(g)
	var reqs []*http.Request
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			var fe *framingError
			if errors.As(err, &fe) {
				return reqs, fe
			}
			return reqs, g.Violation()
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			var fe *framingError
			if errors.As(err, &fe) {
				return reqs, fe
			}
		}
		reqs = append(reqs, req)
	}
}

func TestFramingGuardPassesWellFormedPipelines(t *testing.T) {
	raw := "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n" +
		"POST http://a.test/x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nhello" +
		"POST http://a.test/y HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n" +
		"GET /origin-form HTTP/1.1\r\nHost: a.test\r\n\r\n"
	for _, oneByte := range []bool{false, true} {
		reqs, v := readAllRequests(t, raw, oneByte)
		if v != nil {
			t.Fatalf("oneByte=%v: unexpected violation %v", oneByte, v)
		}
		if len(reqs) != 4 {
			t.Fatalf("oneByte=%v: got %d requests, want 4", oneByte, len(reqs))
		}
	}
}

func TestFramingGuardRefusesAmbiguousHeads(t *testing.T) {
	big := strings.Repeat("a", 5000)
	many := strings.Repeat("X-A: 1\r\n", 21)
	cases := []struct {
		name, raw string
		status    int
	}{
		{"CL+TE", "POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
		{"TE+CL", "POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n", 400},
		{"duplicate Host", "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", 400},
		{"Host differs from target", "GET http://a.test/ HTTP/1.1\r\nHost: b.test\r\n\r\n", 400},
		{"conflicting CL", "POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400},
		{"TE not chunked", "POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400},
		{"obs-fold", "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX-A: 1\r\n 2\r\n\r\n", 400},
		{"bare LF", "GET http://a.test/ HTTP/1.1\nHost: a.test\r\n\r\n", 400},
		{"space before colon", "GET http://a.test/ HTTP/1.1\r\nHost : a.test\r\n\r\n", 400},
		{"userinfo", "GET http://u:p@a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n", 400},
		{"oversized head", "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX-Big: " + big + "\r\n\r\n", 431},
		{"too many fields", "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n" + many + "\r\n", 431},
		{"bad chunk size", "POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400},
		{"CONNECT Host mismatch", "CONNECT a.test:443 HTTP/1.1\r\nHost: b.test:443\r\n\r\n", 400},
		{"second request smuggled after body", "POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 0\r\n\r\nGET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nHost: evil.test\r\n\r\n", 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, oneByte := range []bool{false, true} {
				_, v := readAllRequests(t, tc.raw, oneByte)
				if v == nil {
					t.Fatalf("oneByte=%v: no violation", oneByte)
				}
				if v.Status != tc.status {
					t.Fatalf("oneByte=%v: status %d, want %d (%s)", oneByte, v.Status, tc.status, v.Detail)
				}
			}
		})
	}
}

func TestFramingGuardStepsAsideAfterConnect(t *testing.T) {
	raw := "CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n\x16\x03\x01 not http at all\n\n"
	g := newFramingGuard(strings.NewReader(raw), 4096, 20)
	br := bufio.NewReader(g)
	if _, err := http.ReadRequest(br); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	if string(rest) != "\x16\x03\x01 not http at all\n\n" {
		t.Fatalf("tunnel bytes altered: %q", rest)
	}
}

func BenchmarkFramingGuardHead(b *testing.B) {
	raw := "GET http://a.test/some/path HTTP/1.1\r\nHost: a.test\r\nUser-Agent: bench\r\nAccept: */*\r\nProxy-Authorization: Basic dDp4\r\n\r\n"
	r := strings.NewReader(raw)
	g := newFramingGuard(r, 65536, 100)
	buf := make([]byte, 4096)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		r.Reset(raw)
		for {
			if _, err := g.Read(buf); err != nil {
				break
			}
		}
	}
}
