package broker

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

// refScrub is the specification the streaming Scrubber must match: scan left
// to right, at each byte take the longest secret that starts there.
func refScrub(in []byte, secrets [][]byte, repl []byte) ([]byte, bool) {
	var out []byte
	hit := false
	for i := 0; i < len(in); {
		best := 0
		for _, s := range secrets {
			if len(s) > best && bytes.HasPrefix(in[i:], s) {
				best = len(s)
			}
		}
		if best > 0 {
			out = append(out, repl...)
			i += best
			hit = true
			continue
		}
		out = append(out, in[i])
		i++
	}
	return out, hit
}

// chunkReader returns the input in the given chunk sizes (cycled).
type chunkReader struct {
	data  []byte
	sizes []int
	i     int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := c.sizes[c.i%len(c.sizes)]
	c.i++
	n = min(n, len(p), len(c.data))
	copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

func scrubAll(t *testing.T, r io.Reader, secrets [][]byte, repl []byte) ([]byte, bool) {
	t.Helper()
	s := NewScrubber(io.NopCloser(r), secrets, repl)
	out, err := io.ReadAll(s)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return out, s.Scrubbed()
}

func check(t *testing.T, name string, in []byte, secrets [][]byte, r io.Reader) {
	t.Helper()
	repl := []byte("#")
	want, wantHit := refScrub(in, secrets, repl)
	got, hit := scrubAll(t, r, secrets, repl)
	if !bytes.Equal(got, want) || hit != wantHit {
		t.Fatalf("%s: got %q (scrubbed=%v), want %q (scrubbed=%v)", name, got, hit, want, wantHit)
	}
}

func TestScrubberEveryBoundary(t *testing.T) {
	secret := []byte("sk-live-0123456789")
	secrets := [][]byte{secret}
	for at := 0; at <= 40; at++ {
		in := append(append(bytes.Repeat([]byte("x"), at), secret...), []byte("tail")...)
		for split := 1; split <= len(in); split++ {
			// Two reads: the split falls at every possible offset of the secret.
			check(t, "split", in, secrets, &chunkReader{data: in, sizes: []int{split, len(in)}})
		}
		check(t, "one-byte", in, secrets, iotest.OneByteReader(bytes.NewReader(in)))
	}
}

func TestScrubberCases(t *testing.T) {
	cases := []struct {
		name    string
		in      string
		secrets []string
		want    string
	}{
		{"none", "hello world", []string{"secret"}, "hello world"},
		{"whole", "secret", []string{"secret"}, "#"},
		{"adjacent", "secretsecretsecret", []string{"secret"}, "###"},
		{"overlapping", "ababab", []string{"abab"}, "#ab"},
		{"self-overlap", "aaaaa", []string{"aa"}, "##a"},
		{"prefix-of-another", "tok tokenX token", []string{"tok", "token"}, "# #X #"},
		{"different-lengths", "A=k1;B=key-two;C=third-key-3", []string{"k1", "key-two", "third-key-3"}, "A=#;B=#;C=#"},
		{"at-end-partial", "xxsecre", []string{"secret"}, "xxsecre"},
		{"empty-secret-ignored", "abc", []string{"", "b"}, "a#c"},
		{"empty-body", "", []string{"s"}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var secrets [][]byte
			for _, s := range c.secrets {
				secrets = append(secrets, []byte(s))
			}
			for _, r := range []io.Reader{
				strings.NewReader(c.in),
				iotest.OneByteReader(strings.NewReader(c.in)),
				iotest.HalfReader(strings.NewReader(c.in)),
			} {
				got, hit := scrubAll(t, r, secrets, []byte("#"))
				if string(got) != c.want {
					t.Fatalf("got %q, want %q", got, c.want)
				}
				if hit != (c.in != c.want) {
					t.Fatalf("Scrubbed() = %v", hit)
				}
			}
		})
	}
}

func TestScrubberRandomChunking(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte("abc")
	for iter := 0; iter < 400; iter++ {
		// A small alphabet makes overlaps, prefixes and near-misses common.
		var secrets [][]byte
		for range 1 + rng.IntN(3) {
			s := make([]byte, 1+rng.IntN(6))
			for i := range s {
				s[i] = alphabet[rng.IntN(len(alphabet))]
			}
			secrets = append(secrets, s)
		}
		in := make([]byte, rng.IntN(300))
		for i := range in {
			in[i] = alphabet[rng.IntN(len(alphabet))]
		}
		sizes := make([]int, 1+rng.IntN(5))
		for i := range sizes {
			sizes[i] = 1 + rng.IntN(20)
		}
		check(t, "random", in, secrets, &chunkReader{data: in, sizes: sizes})
	}
}

func TestScrubberLargeBodyNoSecretLeft(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	secrets := [][]byte{[]byte("ghp_AAAAbbbbCCCCdddd1234"), []byte("Bearer xyz-987"), []byte("ghp_AAAA")}
	var in bytes.Buffer
	for in.Len() < 1<<20 {
		in.WriteString(strings.Repeat("lorem ipsum ", rng.IntN(200)))
		in.Write(secrets[rng.IntN(len(secrets))])
	}
	sizes := []int{1, 7, 4096, 65536, 31, 32768}
	got, hit := scrubAll(t, &chunkReader{data: in.Bytes(), sizes: sizes}, secrets, nil)
	if !hit {
		t.Fatal("Scrubbed() = false")
	}
	for _, s := range secrets {
		if bytes.Contains(got, s) {
			t.Fatalf("secret of length %d survived", len(s))
		}
	}
	want, _ := refScrub(in.Bytes(), secrets, []byte(Redacted))
	if !bytes.Equal(got, want) {
		t.Fatal("output differs from reference")
	}
}

func TestScrubberPassesErrorsAndCloses(t *testing.T) {
	boom := errors.New("upstream reset")
	closed := false
	body := struct {
		io.Reader
		io.Closer
	}{
		io.MultiReader(strings.NewReader("abc-secret-"), iotest.ErrReader(boom)),
		closerFunc(func() error { closed = true; return nil }),
	}
	s := NewScrubber(body, [][]byte{[]byte("secret")}, nil)
	got, err := io.ReadAll(s)
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v, want %v", err, boom)
	}
	if string(got) != "abc-"+Redacted+"-" {
		t.Fatalf("got %q", got)
	}
	if err := s.Close(); err != nil || !closed {
		t.Fatalf("Close: %v closed=%v", err, closed)
	}
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

func TestScrubberNoSecretsPassThrough(t *testing.T) {
	got, hit := scrubAll(t, strings.NewReader("plain"), nil, nil)
	if string(got) != "plain" || hit {
		t.Fatalf("got %q %v", got, hit)
	}
}

func TestScrubHeader(t *testing.T) {
	secrets := [][]byte{[]byte("s3cr3t-Value"), []byte("abc")}
	h := http.Header{}
	h.Set("X-Echo", "auth=Bearer s3cr3t-Value; again s3cr3t-Value")
	h.Add("X-Multi", "fine")
	h.Add("X-Multi", "has abc inside")
	h.Set("X-S3cr3t-Value-Name", "1") // canonicalised: case differs from the secret
	h.Set("Content-Type", "text/plain")
	if !ScrubHeader(h, secrets) {
		t.Fatal("ScrubHeader reported no change")
	}
	if got := h.Get("X-Echo"); got != "auth=Bearer "+Redacted+"; again "+Redacted {
		t.Fatalf("X-Echo = %q", got)
	}
	if got := h.Values("X-Multi"); got[0] != "fine" || got[1] != "has "+Redacted+" inside" {
		t.Fatalf("X-Multi = %q", got)
	}
	if _, ok := h["X-S3cr3t-Value-Name"]; ok {
		t.Fatal("header named after a secret survived")
	}
	if h.Get("Content-Type") != "text/plain" {
		t.Fatal("unrelated header changed")
	}
	if ScrubHeader(h, secrets) {
		t.Fatal("second pass changed something")
	}
}

func TestCheckScrubbable(t *testing.T) {
	for enc, ok := range map[string]bool{"": true, "identity": true, "Identity": true, "gzip": false, "identity, br": false} {
		h := http.Header{}
		if enc != "" {
			h.Set("Content-Encoding", enc)
		}
		err := CheckScrubbable(h)
		if (err == nil) != ok {
			t.Fatalf("%q: err = %v", enc, err)
		}
		if err != nil && !errors.Is(err, ErrEncodedBody) {
			t.Fatalf("%q: %v is not ErrEncodedBody", enc, err)
		}
	}
}

func BenchmarkScrubber(b *testing.B) {
	body := bytes.Repeat([]byte("{\"login\":\"octocat\",\"id\":1,\"node_id\":\"MDQ6VXNlcjE=\"}\n"), 64<<10/52)
	all := [][]byte{[]byte("ghp_0123456789abcdefghijklmnopqrstuvwxyz"), []byte("sk-proj-AAAABBBBCCCC"), []byte("xoxb-1234")}
	for n := 0; n <= 3; n++ { // 0: pass-through baseline
		b.Run(fmt.Sprintf("secrets=%d", n), func(b *testing.B) {
			secrets := all[:n]
			buf := make([]byte, 32<<10)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				s := NewScrubber(io.NopCloser(bytes.NewReader(body)), secrets, nil)
				if _, err := io.CopyBuffer(io.Discard, struct{ io.Reader }{s}, buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestScrubberDoesNotHoldBackAStream: between reads only a tail that can
// still become a secret is held back, so each event of a streamed body
// reaches the client without waiting for the next one.
func TestScrubberDoesNotHoldBackAStream(t *testing.T) {
	pr, pw := io.Pipe()
	t.Cleanup(func() { pw.Close() })
	s := NewScrubber(pr, [][]byte{[]byte("supersecretvalue")}, []byte("[R]"))
	read := func(write string) string {
		t.Helper()
		go func() { _, _ = pw.Write([]byte(write)) }()
		got := make(chan string, 1)
		go func() {
			buf := make([]byte, 256)
			n, _ := s.Read(buf)
			got <- string(buf[:n])
		}()
		select {
		case g := <-got:
			return g
		case <-time.After(5 * time.Second):
			t.Fatalf("Read held back %q waiting for more input", write)
			return ""
		}
	}
	if got := read("data: one\n\n"); got != "data: one\n\n" {
		t.Errorf("first event: %q", got)
	}
	// "sup" may be the start of the secret: only it waits.
	if got := read("data: two sup"); got != "data: two " {
		t.Errorf("second read: %q", got)
	}
	go func() {
		_, _ = pw.Write([]byte("ersecretvalue\n\n"))
		pw.Close()
	}()
	rest, err := io.ReadAll(s)
	if err != nil || string(rest) != "[R]\n\n" || !s.Scrubbed() {
		t.Errorf("rest %q, err %v, scrubbed %v", rest, err, s.Scrubbed())
	}
}
