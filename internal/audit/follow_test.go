package audit

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestFollowAcrossRotation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	w := openTest(t, Options{Path: path, RotateSize: 4096})
	ctx := context.Background()
	for i := range 5 {
		if err := w.Write(ctx, sampleRecord(i)); err != nil {
			t.Fatal(err)
		}
	}
	fctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var mu sync.Mutex
	seen := map[string]bool{}
	var last uint64
	done := make(chan error, 1)
	go func() {
		done <- Follow(fctx, path, 10*time.Millisecond, func(r *Record, _ Location) error {
			mu.Lock()
			defer mu.Unlock()
			if r.Seq <= last {
				t.Errorf("seq %d after %d: out of order or repeated", r.Seq, last)
			}
			last = r.Seq
			if r.Kind != KindChain {
				seen[r.ID] = true
			}
			if len(seen) == 60 {
				cancel()
			}
			return nil
		})
	}()
	// Keep writing while Follow runs, across several rotations.
	for i := 5; i < 60; i++ {
		if err := w.Write(ctx, sampleRecord(i)); err != nil {
			t.Fatal(err)
		}
		if i%10 == 0 {
			time.Sleep(15 * time.Millisecond)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	files, _ := ResolveSet([]string{path})
	if len(files) < 3 {
		t.Fatalf("no rotation happened: %v", files)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 60 {
		t.Fatalf("Follow saw %d of 60 records (deadline hit?)", len(seen))
	}
}
