package audit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"
)

// Follow reads a live log: first its rotated files, then the active file,
// and keeps reading the active file as records are appended, moving to the
// new active file when the writer rotates. It stops when ctx ends (it returns
// nil then) or fn returns an error. Partial lines are held until complete.
func Follow(ctx context.Context, path string, poll time.Duration, fn func(r *Record, at Location) error) error {
	if poll <= 0 {
		poll = 250 * time.Millisecond
	}
	// Records are passed on in chain order and each once: a file can be seen
	// both as the active file and, after a rotation, as a rotated one.
	var (
		lastSeq uint64
		started bool
		genesis string
	)
	emitRec := func(r *Record, at Location) error {
		if r.Kind == KindChain && r.Seq == 1 && r.Hash != genesis {
			started, genesis = false, r.Hash // a new chain, not one seen again
		}
		if started && r.Seq <= lastSeq {
			return nil
		}
		lastSeq, started = r.Seq, true
		return fn(r, at)
	}
	// catchUp reads the rotated files that hold records after lastSeq. It
	// runs after the active file is opened, so every file rotated before
	// that is listed.
	catchUp := func() error {
		sibs, err := rotatedSiblings(path)
		if err != nil {
			return err
		}
		from := 0
		if started {
			for i := len(sibs) - 1; i >= 0; i-- {
				if l, ok := firstLine(sibs[i]); ok {
					if h, err := parseLine(l); err == nil && h.Seq <= lastSeq {
						from = i
						break
					}
				}
			}
		}
		_, err = Scan(ctx, sibs[from:], emitRec)
		return err
	}
	var (
		f       *os.File
		fi      os.FileInfo
		partial []byte
		line    int
		buf     = make([]byte, 256<<10)
	)
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	emit := func(data []byte) error {
		data = append(partial, data...)
		for {
			i := bytes.IndexByte(data, '\n')
			if i < 0 {
				break
			}
			line++
			var r Record
			if err := decodeInto(data[:i], &r); err == nil {
				if err := emitRec(&r, Location{File: path, Line: line}); err != nil {
					return err
				}
			}
			data = data[i+1:]
		}
		partial = append(partial[:0], data...)
		return nil
	}
	for {
		if ctx.Err() != nil {
			return nil
		}
		if f == nil {
			nf, err := os.Open(path)
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("audit: follow: %w", err)
			}
			if err == nil {
				if fi, err = nf.Stat(); err != nil {
					nf.Close()
					return fmt.Errorf("audit: follow: %w", err)
				}
				f, partial, line = nf, partial[:0], 0
				if err := catchUp(); err != nil {
					return err
				}
			}
		}
		if f != nil {
			for {
				n, err := f.Read(buf)
				if n > 0 {
					if err := emit(buf[:n]); err != nil {
						return err
					}
				}
				if errors.Is(err, io.EOF) || n == 0 {
					break
				}
				if err != nil {
					return fmt.Errorf("audit: follow: %w", err)
				}
			}
			// At the end of the file: has the writer moved on to a new one?
			if cur, err := os.Stat(path); err != nil || !os.SameFile(cur, fi) {
				// Read what was appended before the rename, then switch.
				for {
					n, _ := f.Read(buf)
					if n == 0 {
						break
					}
					if err := emit(buf[:n]); err != nil {
						return err
					}
				}
				f.Close()
				f = nil
				continue
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(poll):
		}
	}
}
