package audit

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
)

// Location names a line in a log file (lines count from 1).
type Location struct {
	File string
	Line int
}

func (l Location) String() string { return fmt.Sprintf("%s:%d", l.File, l.Line) }

// ScanStats counts what a scan read and skipped.
type ScanStats struct {
	Records   int // records passed to fn
	Malformed int // complete lines that are not records
	Torn      int // files that end in a partial line (a crash mid-write)
}

// Scan reads the records of files in the order given (see ResolveSet) and
// calls fn for each. A file's final line without a newline (a torn write) and
// lines that do not decode are skipped and counted; use Verify to check them.
// fn must not keep r: it is reused for the next record. Returning a non-nil
// error from fn stops the scan with that error.
func Scan(ctx context.Context, files []string, fn func(r *Record, at Location) error) (ScanStats, error) {
	var st ScanStats
	var r Record
	intern := make(map[string]string)
	for _, path := range files {
		if err := scanFile(ctx, path, func(line []byte, n int, complete bool) error {
			if !complete {
				st.Torn++
				return nil
			}
			r = Record{}
			if err := decodeInterned(line, &r, intern); err != nil {
				st.Malformed++
				return nil
			}
			st.Records++
			return fn(&r, Location{File: path, Line: n})
		}); err != nil {
			return st, err
		}
	}
	return st, nil
}

// scanFile calls fn for each line of a file (plain or gzip), without its
// newline. complete is false for a final line with no newline.
func scanFile(ctx context.Context, path string, fn func(line []byte, n int, complete bool) error) error {
	rc, err := openRecords(path)
	if err != nil {
		return err
	}
	defer rc.Close()
	return scanLines(ctx, rc, path, fn)
}

func scanLines(ctx context.Context, rd io.Reader, path string, fn func(line []byte, n int, complete bool) error) error {
	br := bufio.NewReaderSize(rd, 256<<10)
	var long []byte
	for n := 1; ; n++ {
		if n&1023 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			long = append(long[:0], line...)
			for errors.Is(err, bufio.ErrBufferFull) {
				line, err = br.ReadSlice('\n')
				long = append(long, line...)
			}
			line = long
		}
		switch {
		case err == nil:
			if ferr := fn(bytes.TrimSuffix(line, []byte{'\n'}), n, true); ferr != nil {
				return ferr
			}
		case errors.Is(err, io.EOF):
			if len(line) > 0 {
				return fn(line, n, false)
			}
			return nil
		default:
			return fmt.Errorf("audit: read %s: %w", path, err)
		}
	}
}
