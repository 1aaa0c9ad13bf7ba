package audit

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// writeSet writes n records into a rotating log and returns the ordered files.
func writeSet(t *testing.T, n int, compress bool) (string, []string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "audit.log")
	clk := newClock()
	w := openTest(t, Options{Path: path, Fsync: FsyncNever, RotateSize: 4096, Compress: compress, Now: clk.Now})
	ctx := context.Background()
	for i := range n {
		if err := w.Write(ctx, sampleRecord(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	files, err := ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	return path, files
}

func verifyOK(t *testing.T, files []string) Report {
	t.Helper()
	rep, err := Verify(files)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		t.Fatalf("verify: %s", rep.Problem)
	}
	return rep
}

func rewrite(t *testing.T, path string, edit func([]string) []string) {
	t.Helper()
	lines := readLines(t, path)
	lines = edit(lines)
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestVerifyIntactRotatedSet(t *testing.T) {
	for _, compress := range []bool{false, true} {
		_, files := writeSet(t, 60, compress)
		if len(files) < 4 {
			t.Fatalf("want at least 4 files, got %v", files)
		}
		gz := 0
		for _, f := range files {
			if strings.HasSuffix(f, ".gz") {
				gz++
			}
		}
		if compress && gz != len(files)-1 || !compress && gz != 0 {
			t.Fatalf("compress=%v: %d of %d files compressed", compress, gz, len(files))
		}
		rep := verifyOK(t, files)
		if rep.Records != 60+len(files) || rep.FirstSeq != 1 || rep.LastSeq != uint64(60+len(files)) {
			t.Fatalf("report %+v", rep)
		}
		// The reader sees every request once, in order.
		var ids []string
		if _, err := Scan(context.Background(), files, func(r *Record, _ Location) error {
			if r.Kind != KindChain {
				ids = append(ids, r.ID)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if len(ids) != 60 || ids[0] != "req-0" || ids[59] != "req-59" {
			t.Fatalf("scan order: %v", ids)
		}
	}
}

func TestVerifyDetectsTampering(t *testing.T) {
	cases := []struct {
		name string
		edit func(t *testing.T, files []string) (file string, line int)
		want ProblemKind
	}{
		{"edited field", func(t *testing.T, files []string) (string, int) {
			f := files[1]
			rewrite(t, f, func(l []string) []string {
				l[2] = strings.Replace(l[2], `"tenant":"acme"`, `"tenant":"acmf"`, 1)
				return l
			})
			return f, 3
		}, ProblemModified},
		{"deleted line", func(t *testing.T, files []string) (string, int) {
			f := files[1]
			rewrite(t, f, func(l []string) []string { return append(l[:3:3], l[4:]...) })
			return f, 4
		}, ProblemDeleted},
		{"inserted copy", func(t *testing.T, files []string) (string, int) {
			f := files[1]
			rewrite(t, f, func(l []string) []string {
				out := append([]string{}, l[:5]...)
				out = append(out, l[1])
				return append(out, l[5:]...)
			})
			return f, 6
		}, ProblemInserted},
		{"inserted forged record with a valid hash", func(t *testing.T, files []string) (string, int) {
			f := files[1]
			rewrite(t, f, func(l []string) []string {
				prev, _ := parseLine([]byte(l[3]))
				body := appendBody(nil, &Record{Time: time.Now(), Kind: KindRequest, Tenant: "acme", Host: "evil.example"})
				forged, _ := appendLine(nil, prev.Seq+1, prev.Hash, body)
				out := append([]string{}, l[:4]...)
				out = append(out, strings.TrimSuffix(string(forged), "\n"))
				return append(out, l[4:]...)
			})
			return f, 5
		}, ProblemInserted},
		{"swapped lines", func(t *testing.T, files []string) (string, int) {
			f := files[1]
			rewrite(t, f, func(l []string) []string {
				l[2], l[3] = l[3], l[2]
				return l
			})
			return f, 3
		}, ProblemReordered},
		{"removed middle file", func(t *testing.T, files []string) (string, int) {
			if err := os.Remove(files[1]); err != nil {
				t.Fatal(err)
			}
			return files[2], 1
		}, ProblemMissingFile},
		{"partial line in the middle", func(t *testing.T, files []string) (string, int) {
			f := files[1]
			rewrite(t, f, func(l []string) []string {
				l[3] = l[3][:len(l[3])/2]
				return l
			})
			return f, 4
		}, ProblemMalformed},
		{"lines removed from a file's start", func(t *testing.T, files []string) (string, int) {
			f := files[2]
			rewrite(t, f, func(l []string) []string { return l[2:] })
			return f, 1
		}, ProblemDeleted},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path, files := writeSet(t, 60, false)
			file, line := tc.edit(t, files)
			files, err := ResolveSet([]string{path})
			if err != nil {
				t.Fatal(err)
			}
			rep, err := Verify(files)
			if err != nil {
				t.Fatal(err)
			}
			if rep.OK() {
				t.Fatal("verify passed a tampered set")
			}
			p := rep.Problem
			if p.Kind != tc.want || p.At.File != file || p.At.Line != line {
				t.Fatalf("got %s, want %s at %s:%d", p, tc.want, file, line)
			}
		})
	}
}

func TestVerifyTornTailIsACrashNotTampering(t *testing.T) {
	path, files := writeSet(t, 30, false)
	lines := readLines(t, path)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(lines[1][:40]) // a crash mid-write
	f.Close()
	rep := verifyOK(t, files)
	if rep.TornTail == nil || rep.TornTail.File != path || rep.TornTail.Line != len(lines)+1 {
		t.Fatalf("torn tail not reported: %+v", rep)
	}

	// A writer started on it keeps the damaged file, starts a new one whose
	// header records the torn tail, and the chain still verifies.
	w := openTest(t, Options{Path: path})
	if err := w.Write(context.Background(), sampleRecord(99)); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	files, err = ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	rep = verifyOK(t, files)
	if rep.TornTail != nil || len(rep.Notes) != 1 || !strings.Contains(rep.Notes[0], ChainTornTail) {
		t.Fatalf("report %+v", rep)
	}
	first, _ := parseLine([]byte(readLines(t, path)[0]))
	if first.Kind != KindChain || first.Reason != ChainTornTail || first.PrevFile != filepath.Base(files[len(files)-2]) {
		t.Fatalf("header %+v", first)
	}
}

func TestWriterContinuesChainAfterRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	ctx := context.Background()
	for round := range 3 {
		w := openTest(t, Options{Path: path})
		for i := range 5 {
			if err := w.Write(ctx, sampleRecord(round*5+i)); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	rep := verifyOK(t, []string{path})
	if rep.Records != 16 {
		t.Fatalf("records %d, want 16 (one header, 15 records, one file)", rep.Records)
	}
}

func TestRotateByAge(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	clk := newClock()
	w := openTest(t, Options{Path: path, RotateAge: time.Hour, Now: clk.Now})
	ctx := context.Background()
	for i := range 6 {
		if err := w.Write(ctx, sampleRecord(i)); err != nil {
			t.Fatal(err)
		}
		if i%2 == 1 {
			clk.Advance(61 * time.Minute)
		}
	}
	w.Close(ctx)
	files, err := ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 3 {
		t.Fatalf("files %v, want 3", files)
	}
	verifyOK(t, files)
	h, _ := parseLine([]byte(readLines(t, files[2])[0]))
	if h.Reason != ChainAge || h.PrevFile != filepath.Base(files[1]) {
		t.Fatalf("header %+v", h)
	}
	// Rotation continues across a restart: the chain resumes in the active file.
	w2 := openTest(t, Options{Path: path, RotateAge: time.Hour, Now: clk.Now})
	w2.Write(ctx, sampleRecord(7))
	w2.Close(ctx)
	if files, err = ResolveSet([]string{path}); err != nil {
		t.Fatal(err)
	}
	if len(files) != 4 {
		t.Fatalf("files %v, want 4", files)
	}
	verifyOK(t, files)
}
