package audit

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestSinkFailureDevFull(t *testing.T) {
	if _, err := os.Stat("/dev/full"); err != nil {
		t.Skip("no /dev/full")
	}
	ctx := context.Background()
	t.Run("closed", func(t *testing.T) {
		w := openTest(t, Options{Path: "/dev/full"})
		err := w.Write(ctx, sampleRecord(1))
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("Write = %v, want ErrUnavailable", err)
		}
		if !errors.Is(w.Healthy(), ErrUnavailable) {
			t.Fatalf("Healthy = %v", w.Healthy())
		}
		if w.Lost() != 0 {
			t.Fatalf("Lost = %d under closed policy", w.Lost())
		}
		if err := w.Close(ctx); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("Close = %v, want the unwritten records reported", err)
		}
	})
	t.Run("open", func(t *testing.T) {
		w := openTest(t, Options{Path: "/dev/full", OnFailure: FailOpen})
		for i := range 5 {
			if err := w.Write(ctx, sampleRecord(i)); err != nil {
				t.Fatalf("Write = %v under open policy", err)
			}
		}
		if w.Lost() != 5 || w.SinkErr() == nil {
			t.Fatalf("Lost = %d, SinkErr = %v", w.Lost(), w.SinkErr())
		}
		if err := w.Healthy(); err != nil {
			t.Fatalf("Healthy = %v under open policy: the proxy would refuse traffic", err)
		}
	})
}

// mountTiny mounts a small tmpfs so the disk can really fill up.
func mountTiny(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0700"); err != nil {
		t.Skipf("cannot mount tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

func fillDisk(t *testing.T, dir string) string {
	t.Helper()
	filler := filepath.Join(dir, "filler")
	f, err := os.Create(filler)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 1024)
	for i := 0; i < 1024; i++ {
		if _, err := f.Write(chunk); err != nil {
			return filler
		}
	}
	t.Fatal("tmpfs never filled up")
	return ""
}

func waitHealthy(t *testing.T, w *Writer) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for w.SinkErr() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("writer did not recover: %v", w.SinkErr())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestDiskFullAndRecovery(t *testing.T) {
	for _, policy := range []string{FailClosed, FailOpen} {
		t.Run(policy, func(t *testing.T) {
			dir := mountTiny(t)
			path := filepath.Join(dir, "audit.log")
			w := openTest(t, Options{Path: path, OnFailure: policy, Fsync: FsyncAlways, RetryInterval: 20 * time.Millisecond})
			ctx := context.Background()
			for i := range 3 {
				if err := w.Write(ctx, sampleRecord(i)); err != nil {
					t.Fatal(err)
				}
			}
			filler := fillDisk(t, dir)
			// The file's last page may still have room: write until the
			// first failure, then some more.
			failed, after := 0, 0
			for i := 3; i < 200 && after < 5; i++ {
				err := w.Write(ctx, sampleRecord(i))
				var bad bool
				switch policy {
				case FailClosed:
					if err != nil && !errors.Is(err, ErrUnavailable) {
						t.Fatalf("Write %d = %v", i, err)
					}
					bad = err != nil
				case FailOpen:
					if err != nil {
						t.Fatalf("Write %d = %v under open policy", i, err)
					}
					bad = w.Lost() > uint64(failed)
				}
				if bad {
					failed++
				}
				if failed > 0 {
					after++
					if !bad {
						t.Fatalf("Write %d succeeded after a failure on a full disk", i)
					}
				}
			}
			if failed != 5 {
				t.Fatalf("%d failed writes, want 5", failed)
			}
			if w.SinkErr() == nil {
				t.Fatal("SinkErr reports nil while the disk is full")
			}
			if err := w.Healthy(); (err == nil) != (policy == FailOpen) {
				t.Fatalf("Healthy = %v on a full disk under policy %s", err, policy)
			}
			if policy == FailOpen && w.Lost() != 5 {
				t.Fatalf("lost %d, want 5", w.Lost())
			}
			os.Remove(filler)
			waitHealthy(t, w) // recovers without new traffic
			if err := w.Write(ctx, sampleRecord(10)); err != nil {
				t.Fatal(err)
			}
			if err := w.Write(ctx, sampleRecord(10)); err != nil {
				t.Fatal(err)
			}
			w.Close(ctx)
			rep := verifyOK(t, []string{path})
			var gaps []uint64
			var ids []string
			Scan(ctx, []string{path}, func(r *Record, _ Location) error {
				if r.Kind == KindAuditGap {
					gaps = append(gaps, r.Lost)
				} else if r.Kind == KindRequest || r.Kind == KindRun {
					ids = append(ids, r.ID)
				}
				return nil
			})
			if len(gaps) != 1 || gaps[0] != 5 {
				t.Fatalf("gap records %v, want one with lost=5", gaps)
			}
			if ids[len(ids)-1] != "req-10" || len(ids) < 4 {
				t.Fatalf("records %v", ids)
			}
			if rep.Records != 1+len(ids)+1 {
				t.Fatalf("records %d, ids %d", rep.Records, len(ids))
			}
		})
	}
}

func TestFileRemovedUnderWriter(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	w := openTest(t, Options{Path: path})
	ctx := context.Background()
	w.Write(ctx, sampleRecord(1))
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	// The path is checked at most every statEvery.
	time.Sleep(statEvery + 10*time.Millisecond)
	if err := w.Write(ctx, sampleRecord(2)); err != nil {
		t.Fatal(err)
	}
	w.Close(ctx)
	lines := readLines(t, path)
	h, _ := parseLine([]byte(lines[0]))
	if len(lines) != 2 || h.Kind != KindChain || h.Reason != ChainFileMissing || h.Seq != 3 {
		t.Fatalf("new file %q", lines)
	}
	// Verify names what the writer saw: records were deleted.
	rep, err := Verify([]string{path})
	if err != nil || rep.OK() {
		t.Fatalf("verify = %+v, %v; want a deletion for the first file", rep, err)
	}
}

func TestConcurrentWriters(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	w := openTest(t, Options{Path: path, QueueSize: 16, RotateSize: 64 << 10})
	ctx := context.Background()
	var wg sync.WaitGroup
	const G, N = 8, 200
	for g := range G {
		wg.Go(func() {
			for i := range N {
				r := sampleRecord(g*N + i)
				if err := w.Write(ctx, r); err != nil {
					t.Error(err)
					return
				}
				_ = w.QueueDepth()
				_ = w.Healthy()
			}
		})
	}
	wg.Wait()
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	files, _ := ResolveSet([]string{path})
	rep := verifyOK(t, files)
	seen := map[string]bool{}
	Scan(ctx, files, func(r *Record, _ Location) error { seen[r.ID] = true; return nil })
	if len(seen) != G*N+1 || rep.Records != G*N+len(files) {
		t.Fatalf("%d distinct ids, %d records, %d files", len(seen), rep.Records, len(files))
	}
}

func TestWriteRespectsContextWhenQueueFull(t *testing.T) {
	// A FIFO with no reader blocks the writer goroutine; the queue fills.
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skip(err)
	}
	rd, err := os.OpenFile(fifo, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	w, err := Open(Options{Path: fifo, QueueSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	var errs []error
	for i := 0; i < 200 && ctx.Err() == nil; i++ {
		if err := w.Write(ctx, sampleRecord(i)); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 || !errors.Is(errs[len(errs)-1], context.DeadlineExceeded) {
		t.Fatalf("Write never gave up: %v", errs)
	}
	// Drain the FIFO so the writer can finish.
	go func() {
		buf := make([]byte, 64<<10)
		for {
			if _, err := rd.Read(buf); err != nil && !errors.Is(err, syscall.EAGAIN) {
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	if err := w.Close(cctx); err != nil {
		t.Fatal(err)
	}
	rd.Close()
}

// TestKill9 runs a writer in a child process, kills it with SIGKILL while it
// writes, and checks that every acknowledged record is on disk and the chain
// verifies.
func TestKill9(t *testing.T) {
	if path := os.Getenv("SLUICE_AUDIT_KILL9_CHILD"); path != "" {
		kill9Child(path)
		return
	}
	path := filepath.Join(t.TempDir(), "audit.log")
	cmd := exec.Command(os.Args[0], "-test.run=^TestKill9$", "-test.count=1")
	cmd.Env = append(os.Environ(), "SLUICE_AUDIT_KILL9_CHILD="+path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	acked := map[string]bool{}
	sc := bufio.NewScanner(out)
	killed := false
	for sc.Scan() {
		id := sc.Text()
		if len(id) < 4 || id[:4] != "req-" {
			continue
		}
		acked[id] = true
		if len(acked) == 3000 && !killed {
			cmd.Process.Signal(syscall.SIGKILL)
			killed = true
		}
	}
	cmd.Wait()
	if !killed {
		t.Fatalf("child stopped after %d acks before it was killed", len(acked))
	}
	files, err := ResolveSet([]string{path})
	if err != nil {
		t.Fatal(err)
	}
	rep := verifyOK(t, files)
	present := map[string]bool{}
	Scan(context.Background(), files, func(r *Record, _ Location) error { present[r.ID] = true; return nil })
	for id := range acked {
		if !present[id] {
			t.Fatalf("acknowledged record %s is missing after kill -9", id)
		}
	}
	t.Logf("%d acknowledged, %d records verified, torn tail: %v", len(acked), rep.Records, rep.TornTail)
	// A new writer continues the chain.
	w := openTest(t, Options{Path: path, RotateSize: 256 << 10})
	if err := w.Write(context.Background(), sampleRecord(1)); err != nil {
		t.Fatal(err)
	}
	w.Close(context.Background())
	files, _ = ResolveSet([]string{path})
	verifyOK(t, files)
}

func kill9Child(path string) {
	w, err := Open(Options{Path: path, Fsync: FsyncNever, RotateSize: 256 << 10})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := 0; i < 50000 && ctx.Err() == nil; i++ {
				r := sampleRecord(0)
				r.ID = "req-" + strconv.Itoa(g) + "-" + strconv.Itoa(i)
				if err := w.Write(ctx, r); err != nil {
					return
				}
				mu.Lock()
				os.Stdout.WriteString(r.ID + "\n")
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	os.Exit(3)
}
