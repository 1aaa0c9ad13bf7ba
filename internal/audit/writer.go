package audit

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// ErrUnavailable means the audit sink cannot be written. With the "closed"
// failure policy the proxy must refuse traffic (reason audit_unavailable).
var ErrUnavailable = errors.New("audit: sink unavailable")

// ErrClosed is returned by Write after Close.
var ErrClosed = errors.New("audit: writer closed")

// Fsync policies.
const (
	FsyncAlways   = "always"   // fsync before Write returns
	FsyncInterval = "interval" // fsync every FsyncInterval when something was written
	FsyncNever    = "never"    // leave it to the kernel
)

// Failure policies.
const (
	FailClosed = "closed" // Write returns ErrUnavailable; the proxy refuses traffic
	FailOpen   = "open"   // Write returns nil; the loss is counted and later recorded as an audit_gap
)

// Options configure a Writer. The zero value of every field but Path has a
// sensible default.
type Options struct {
	Path          string        // file path, or "-" for Stdout
	Fsync         string        // always | interval (default) | never
	FsyncInterval time.Duration // default 1s
	QueueSize     int           // pending records; default 4096
	OnFailure     string        // closed (default) | open
	RotateSize    int64         // rotate before a file would exceed this many bytes; 0 = never
	RotateAge     time.Duration // rotate when the file's first record is this old; 0 = never
	Compress      bool          // gzip rotated files in the background
	RetryInterval time.Duration // while the sink fails, how often to try again without traffic; default 1s
	Logger        *slog.Logger  // default slog.Default()
	Now           func() time.Time
	Stdout        io.Writer // the sink for Path "-"; default os.Stdout
}

// Writer appends hash-chained records to the audit log. One goroutine owns
// the file and the chain; callers hand it records through a bounded queue and
// wait until their record is written (group commit).
type Writer struct {
	opts Options
	log  *slog.Logger
	now  func() time.Time

	mu     sync.RWMutex // held shared while enqueueing, exclusively to close the queue
	closed bool
	queue  chan *pending

	health atomic.Pointer[error]
	lost   atomic.Uint64
	done   chan struct{}
	bg     sync.WaitGroup // background compression
	result error          // set by the loop before done closes

	// Owned by the loop goroutine.
	out      io.Writer
	file     *os.File // nil for a non-file sink
	fi       os.FileInfo
	regular  bool
	size     int64
	created  time.Time
	lastStat time.Time // when the path was last checked for removal
	seq      uint64
	prev     string
	header   *Record // chain header to write first in the current file
	newFile  string  // non-empty: start a new file before the next write, for this reason
	gap      uint64  // records not written since the last successful write
	dirty    bool
	buf      []byte
	lastName string // base name of the file the chain continues from
}

type pending struct {
	body []byte
	done chan error
}

const (
	maxBatchRecords = 4096
	maxBatchBytes   = 4 << 20
)

// Open validates opts, continues the chain from any existing log and starts
// the writer goroutine.
func Open(opts Options) (*Writer, error) {
	if opts.Path == "" {
		return nil, errors.New("audit: no path (use \"-\" for stdout)")
	}
	switch opts.Fsync {
	case "":
		opts.Fsync = FsyncInterval
	case FsyncAlways, FsyncInterval, FsyncNever:
	default:
		return nil, fmt.Errorf("audit: fsync %q: want always, interval or never", opts.Fsync)
	}
	switch opts.OnFailure {
	case "":
		opts.OnFailure = FailClosed
	case FailClosed, FailOpen:
	default:
		return nil, fmt.Errorf("audit: on_failure %q: want closed or open", opts.OnFailure)
	}
	if opts.QueueSize < 0 || opts.RotateSize < 0 || opts.RotateAge < 0 || opts.FsyncInterval < 0 || opts.RetryInterval < 0 {
		return nil, errors.New("audit: queue size, rotation limits and intervals must not be negative")
	}
	if opts.RotateSize > 0 && opts.RotateSize < 4096 {
		return nil, fmt.Errorf("audit: rotate size %d is below the minimum of 4096 bytes", opts.RotateSize)
	}
	if opts.Path == "-" && (opts.RotateSize > 0 || opts.RotateAge > 0) {
		return nil, errors.New("audit: rotation needs a file path, not stdout")
	}
	if opts.QueueSize == 0 {
		opts.QueueSize = 4096
	}
	if opts.FsyncInterval == 0 {
		opts.FsyncInterval = time.Second
	}
	if opts.RetryInterval == 0 {
		opts.RetryInterval = time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Stdout == nil {
		opts.Stdout = os.Stdout
	}
	w := &Writer{
		opts:  opts,
		log:   opts.Logger.With("component", "audit"),
		now:   opts.Now,
		queue: make(chan *pending, opts.QueueSize),
		done:  make(chan struct{}),
		buf:   make([]byte, 0, 64<<10),
	}
	if err := w.start(); err != nil {
		if w.file != nil {
			w.file.Close()
		}
		return nil, err
	}
	go w.loop()
	return w, nil
}

// Write appends r to the log and returns once it has been written to the
// sink (and fsync'd with fsync=always). It waits while the queue is full,
// bounded by ctx. If the sink fails, Write returns an error wrapping
// ErrUnavailable under the closed policy and nil under the open policy (the
// loss is counted by Lost and recorded as an audit_gap later). If ctx ends
// after the record was queued, the record may still be written.
func (w *Writer) Write(ctx context.Context, r *Record) error {
	if r == nil {
		return errors.New("audit: nil record")
	}
	switch r.Kind {
	case KindRequest, KindTunnel, KindAuthFailure, KindLaunch, KindRun, KindConfigReload:
	case KindChain, KindAuditGap:
		return fmt.Errorf("audit: kind %q is written by the writer itself", r.Kind)
	default:
		return fmt.Errorf("audit: unknown record kind %q", r.Kind)
	}
	rec := *r
	if rec.Time.IsZero() {
		rec.Time = w.now()
	}
	p := &pending{body: appendBody(make([]byte, 0, 384), &rec), done: make(chan error, 1)}

	w.mu.RLock()
	if w.closed {
		w.mu.RUnlock()
		return ErrClosed
	}
	select {
	case w.queue <- p:
		w.mu.RUnlock()
	case <-ctx.Done():
		w.mu.RUnlock()
		return fmt.Errorf("audit: queue full: %w", ctx.Err())
	}
	select {
	case err := <-p.done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("audit: waiting for the record to be written: %w", ctx.Err())
	}
}

// Healthy says whether the proxy may take new traffic. Under the closed
// policy it returns an error wrapping ErrUnavailable after the last attempt
// to write failed, so the proxy refuses requests (audit_unavailable) and
// /readyz reports it. Under the open policy it always returns nil: traffic
// goes on and the loss is counted by Lost and recorded as an audit_gap. The
// proxy checks it before doing any work for a new request.
func (w *Writer) Healthy() error {
	if w.opts.OnFailure == FailOpen {
		return nil
	}
	return w.SinkErr()
}

// SinkErr returns the error of the last failed attempt to write (under
// either policy), and nil once a write has succeeded again. It is for
// monitoring; whether to refuse traffic is Healthy's answer.
func (w *Writer) SinkErr() error {
	if p := w.health.Load(); p != nil {
		return *p
	}
	return nil
}

// Lost returns how many records Write accepted under the open policy but
// could not write.
func (w *Writer) Lost() uint64 { return w.lost.Load() }

// QueueDepth returns the number of records waiting to be written.
func (w *Writer) QueueDepth() int { return len(w.queue) }

// Close writes everything queued, fsyncs and closes the file, and waits for
// background compression. Write after Close returns ErrClosed.
func (w *Writer) Close(ctx context.Context) error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		<-w.done
		return nil
	}
	w.closed = true
	close(w.queue)
	w.mu.Unlock()
	select {
	case <-w.done:
	case <-ctx.Done():
		return fmt.Errorf("audit: close: %w", ctx.Err())
	}
	bgDone := make(chan struct{})
	go func() { w.bg.Wait(); close(bgDone) }()
	select {
	case <-bgDone:
	case <-ctx.Done():
		return fmt.Errorf("audit: close: waiting for compression: %w", ctx.Err())
	}
	return w.result
}

func (w *Writer) loop() {
	defer close(w.done)
	var syncC <-chan time.Time
	if w.opts.Fsync == FsyncInterval {
		t := time.NewTicker(w.opts.FsyncInterval)
		defer t.Stop()
		syncC = t.C
	}
	retry := time.NewTicker(w.opts.RetryInterval)
	defer retry.Stop()
	batch := make([]*pending, 0, 64)
	for {
		select {
		case p, ok := <-w.queue:
			if !ok {
				w.result = w.finish()
				return
			}
			batch = append(batch[:0], p)
			size := len(p.body)
			// Let the goroutines that are about to hand over a record do
			// so before this batch is cut: one yield turns many one-record
			// writes into fewer, larger ones when the proxy is busy, and
			// costs nothing measurable when it is idle.
			runtime.Gosched()
		drain:
			for len(batch) < maxBatchRecords && size < maxBatchBytes {
				select {
				case p, ok := <-w.queue:
					if !ok {
						break drain // the closed queue is seen on the next turn
					}
					batch = append(batch, p)
					size += len(p.body)
				default:
					break drain
				}
			}
			w.commit(batch)
			clear(batch)
		case <-syncC:
			if w.dirty && w.file != nil && w.regular {
				if err := w.file.Sync(); err != nil {
					w.setUnhealthy(fmt.Errorf("%w: fsync %s: %w", ErrUnavailable, w.opts.Path, err))
				} else {
					w.dirty = false
				}
			}
		case <-retry.C:
			// Retry without traffic, so Healthy recovers and the gap is recorded.
			if w.gap > 0 || w.SinkErr() != nil {
				w.commit(nil)
			}
		}
	}
}

func (w *Writer) finish() error {
	var errs []error
	if w.gap > 0 || w.SinkErr() != nil {
		w.commit(nil)
	}
	if w.file != nil {
		if w.regular && w.opts.Fsync != FsyncNever {
			if err := w.file.Sync(); err != nil {
				errs = append(errs, fmt.Errorf("audit: fsync on close: %w", err))
			}
		}
		if err := w.file.Close(); err != nil {
			errs = append(errs, fmt.Errorf("audit: close: %w", err))
		}
		w.file = nil
	}
	if w.gap > 0 {
		errs = append(errs, fmt.Errorf("%w: %d records could not be written before close", ErrUnavailable, w.gap))
	}
	return errors.Join(errs...)
}

// commit writes the batch (and any pending chain header and gap record) in
// one write and wakes the callers. On failure nothing of the batch stays in
// the file: a partial write is truncated away or, if that fails, the file is
// abandoned for a new one whose header says why.
func (w *Writer) commit(batch []*pending) {
	err := w.prepare(batch)
	var written bool
	if err == nil {
		written, err = w.writeBatch(batch)
	}
	if err != nil {
		w.gap += uint64(len(batch))
		w.setUnhealthy(err)
		for _, p := range batch {
			if w.opts.OnFailure == FailOpen {
				w.lost.Add(1)
				p.done <- nil
			} else {
				p.done <- err
			}
		}
		return
	}
	if written {
		w.setHealthy()
	}
	for _, p := range batch {
		p.done <- nil
	}
}

// statEvery bounds how often the writer checks that its file is still the
// one at its path.
const statEvery = 100 * time.Millisecond

// prepare makes sure the right file is open: it reopens a removed file and
// rotates by size and age.
func (w *Writer) prepare(batch []*pending) error {
	if !w.regular && w.out != nil {
		return nil
	}
	// A stat per batch cost a twentieth of the proxy's CPU under load, so
	// the path is checked at most every statEvery. Records written between
	// a removal and its detection land in the removed file; the new file's
	// chain header (file_missing) says the old one went away.
	// Wall-clock time, not the writer's clock: this is a throttle on
	// syscalls, and reading the record clock here would move record times.
	if w.file != nil && w.newFile == "" && time.Since(w.lastStat) >= statEvery {
		w.lastStat = time.Now()
		fi, err := os.Stat(w.opts.Path)
		if err != nil || !os.SameFile(fi, w.fi) {
			w.log.Warn("audit log was removed or replaced; starting a new file", "path", w.opts.Path)
			w.file.Close()
			w.file = nil
			w.lastName = filepath.Base(w.opts.Path)
			w.newFile = ChainFileMissing
		}
	}
	if w.newFile == "" && w.file != nil && w.size > 0 {
		n := 0
		for _, p := range batch {
			n += len(p.body) + 200
		}
		switch {
		case w.opts.RotateSize > 0 && w.size+int64(n) > w.opts.RotateSize:
			w.newFile = ChainSize
		case w.opts.RotateAge > 0 && w.now().Sub(w.created) >= w.opts.RotateAge:
			w.newFile = ChainAge
		}
	}
	if w.newFile == "" {
		return nil
	}
	if w.file != nil {
		if err := w.rotateAway(); err != nil {
			return err
		}
	}
	if err := w.openNew(w.newFile); err != nil {
		return err
	}
	w.newFile = ""
	return nil
}

// writeBatch encodes and writes the pending header, gap record and batch. It
// reports whether anything was written.
func (w *Writer) writeBatch(batch []*pending) (bool, error) {
	buf := w.buf[:0]
	seq, prev := w.seq, w.prev
	add := func(body []byte) {
		seq++
		buf, prev = appendLine(buf, seq, prev, body)
	}
	now := w.now()
	if w.header != nil {
		h := *w.header
		h.Time = now
		add(appendBody(nil, &h))
	}
	if w.gap > 0 {
		add(appendBody(nil, gapRecord(now, w.gap, w.opts.OnFailure)))
	}
	for _, p := range batch {
		add(p.body)
	}
	if len(buf) == 0 {
		return false, nil
	}
	if cap(buf) <= 1<<20 {
		w.buf = buf
	}
	n, err := w.out.Write(buf)
	if err == nil && w.regular && w.opts.Fsync == FsyncAlways {
		err = w.file.Sync()
		if err != nil {
			err = fmt.Errorf("fsync: %w", err)
		}
	}
	if err != nil {
		if n > 0 || w.opts.Fsync == FsyncAlways {
			w.rollback()
		}
		return false, fmt.Errorf("%w: write %s: %w", ErrUnavailable, w.opts.Path, err)
	}
	w.size += int64(n)
	w.seq, w.prev = seq, prev
	w.header = nil
	if w.gap > 0 {
		w.log.Info("audit log writable again; gap recorded", "lost", w.gap)
	}
	w.gap = 0
	w.dirty = true
	return true, nil
}

// rollback removes a partly written batch so the file never holds a torn
// line followed by more records.
func (w *Writer) rollback() {
	if w.regular && w.file != nil {
		if err := w.file.Truncate(w.size); err == nil {
			return
		}
		w.lastName = filepath.Base(w.opts.Path)
		w.newFile = ChainWriteError
		return
	}
	// A stream cannot be truncated; readers skip the torn line.
}

func (w *Writer) setUnhealthy(err error) {
	if w.SinkErr() == nil {
		w.log.Error("audit log cannot be written", "path", w.opts.Path, "policy", w.opts.OnFailure, "err", err)
	}
	w.health.Store(&err)
}

func (w *Writer) setHealthy() {
	if w.SinkErr() != nil {
		w.log.Info("audit log writable again", "path", w.opts.Path)
		w.health.Store(nil)
	}
}

// start opens the sink and continues the chain from what is already on disk.
func (w *Writer) start() error {
	if w.opts.Path == "-" {
		w.out = w.opts.Stdout
		w.header = &Record{Kind: KindChain, Reason: ChainStart, Message: "stdout"}
		return nil
	}
	path := w.opts.Path
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("audit: create log directory: %w", err)
	}
	fi, err := os.Stat(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("audit: %w", err)
	}
	if err == nil && !fi.Mode().IsRegular() {
		// A device or pipe (e.g. /dev/full in tests, a FIFO to a shipper):
		// no tail to continue, no rotation.
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			return fmt.Errorf("audit: %w", err)
		}
		w.file, w.out = f, f
		w.header = &Record{Kind: KindChain, Reason: ChainStart, Message: "not a regular file"}
		return nil
	}
	w.regular = true
	if err == nil && fi.Size() > 0 {
		t, err := readTail(path)
		if err != nil {
			return err
		}
		w.seq, w.prev = t.seq, t.hash
		w.lastName = filepath.Base(path)
		if t.problem == "" {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				return fmt.Errorf("audit: %w", err)
			}
			if w.fi, err = f.Stat(); err != nil {
				f.Close()
				return fmt.Errorf("audit: %w", err)
			}
			w.file, w.out, w.size = f, f, w.fi.Size()
			w.created = t.first
			if w.created.IsZero() {
				w.created = w.fi.ModTime()
			}
			return nil
		}
		w.log.Warn("audit log ends in a damaged record; starting a new file", "path", path, "reason", t.problem)
		// Keep the damaged file as it is, under a rotated name.
		name, err := w.rotatedName()
		if err != nil {
			return err
		}
		if err := os.Rename(path, name); err != nil {
			return fmt.Errorf("audit: %w", err)
		}
		w.lastName = filepath.Base(name)
		return w.openNew(t.problem)
	}
	// No active file (or an empty one): continue from the newest rotated file
	// if there is one, so a crash between rename and create keeps the chain.
	set, err := rotatedSiblings(path)
	if err != nil {
		return err
	}
	reason := ChainStart
	if len(set) > 0 {
		last := set[len(set)-1]
		t, err := readTail(last)
		if err != nil {
			return err
		}
		w.seq, w.prev = t.seq, t.hash
		w.lastName = logicalName(filepath.Base(last))
		reason = ChainSize
		if t.problem != "" {
			reason = t.problem
		}
	}
	return w.openNew(reason)
}

// openNew creates the active file and queues its chain header.
func (w *Writer) openNew(reason string) error {
	f, err := os.OpenFile(w.opts.Path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("%w: open %s: %w", ErrUnavailable, w.opts.Path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	w.file, w.out, w.fi, w.size = f, f, fi, fi.Size()
	w.created = w.now()
	w.header = &Record{Kind: KindChain, Reason: reason, PrevFile: w.lastName}
	if w.opts.Fsync != FsyncNever {
		syncDir(filepath.Dir(w.opts.Path))
	}
	return nil
}

// rotateAway closes the active file and renames it to its rotated name.
func (w *Writer) rotateAway() error {
	if w.opts.Fsync != FsyncNever {
		if err := w.file.Sync(); err != nil {
			return fmt.Errorf("%w: fsync before rotation: %w", ErrUnavailable, err)
		}
	}
	name, err := w.rotatedName()
	if err != nil {
		return err
	}
	if err := os.Rename(w.opts.Path, name); err != nil {
		return fmt.Errorf("%w: rotate: %w", ErrUnavailable, err)
	}
	w.file.Close()
	w.file = nil
	w.lastName = filepath.Base(name)
	if w.opts.Compress {
		w.bg.Add(1)
		go func() {
			defer w.bg.Done()
			if err := compressFile(name); err != nil {
				w.log.Error("audit: compressing rotated file failed; left uncompressed", "file", name, "err", err)
			}
		}()
	}
	return nil
}

func (w *Writer) rotatedName() (string, error) {
	base := w.opts.Path + "." + w.now().UTC().Format(rotateStamp)
	name := base
	for i := 1; ; i++ {
		if _, err := os.Lstat(name); errors.Is(err, os.ErrNotExist) {
			if _, err := os.Lstat(name + ".gz"); errors.Is(err, os.ErrNotExist) {
				return name, nil
			}
		}
		if i > 1000 {
			return "", fmt.Errorf("%w: no free rotated name for %s", ErrUnavailable, base)
		}
		name = fmt.Sprintf("%s-%d", base, i)
	}
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}

// tail is what the writer needs from the end of an existing file.
type tail struct {
	seq     uint64
	hash    string
	first   time.Time // time of the file's first record
	problem string    // "", ChainTornTail or ChainInvalidTail
}

const tailWindow = 1 << 20

// readTail finds the last valid record of a file (plain or gzip).
func readTail(path string) (tail, error) {
	var t tail
	data, err := readEnd(path)
	if err != nil {
		return t, err
	}
	if first, ok := firstLine(path); ok {
		if r, err := parseLine(first); err == nil {
			t.first = r.Time
		}
	}
	if i := bytes.LastIndexByte(data, '\n'); i < len(data)-1 {
		t.problem = ChainTornTail
		data = data[:i+1]
	}
	lines := bytes.Split(bytes.TrimSuffix(data, []byte{'\n'}), []byte{'\n'})
	for i := len(lines) - 1; i >= 0; i-- {
		computed, claimed, ok := lineHash(lines[i])
		if !ok || computed != claimed {
			t.problem = ChainInvalidTail
			continue
		}
		r, err := parseLine(lines[i])
		if err != nil {
			t.problem = ChainInvalidTail
			continue
		}
		t.seq, t.hash = r.Seq, r.Hash
		return t, nil
	}
	if len(data) > 0 {
		t.problem = ChainInvalidTail
	}
	return t, nil
}

// readEnd returns up to tailWindow bytes from the end of a file, starting at
// a line boundary when the window does not cover the whole file.
func readEnd(path string) ([]byte, error) {
	if isGzip(path) {
		rc, err := openRecords(path)
		if err != nil {
			return nil, err
		}
		defer rc.Close()
		ring := make([]byte, 0, tailWindow)
		br := bufio.NewReaderSize(rc, 64<<10)
		buf := make([]byte, 64<<10)
		for {
			n, err := br.Read(buf)
			ring = append(ring, buf[:n]...)
			if len(ring) > 2*tailWindow {
				ring = append(ring[:0], ring[len(ring)-tailWindow:]...)
			}
			if err == io.EOF {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("audit: read %s: %w", path, err)
			}
		}
		return trimToLine(ring), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	off := max(fi.Size()-tailWindow, 0)
	data := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(data, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("audit: read %s: %w", path, err)
	}
	if off > 0 {
		data = trimToLine(data)
	}
	return data, nil
}

func trimToLine(b []byte) []byte {
	if len(b) <= tailWindow {
		return b
	}
	b = b[len(b)-tailWindow:]
	if i := bytes.IndexByte(b, '\n'); i >= 0 {
		return b[i+1:]
	}
	return b
}

func firstLine(path string) ([]byte, bool) {
	rc, err := openRecords(path)
	if err != nil {
		return nil, false
	}
	defer rc.Close()
	br := bufio.NewReaderSize(rc, 4096)
	line, err := br.ReadSlice('\n')
	if err != nil {
		return nil, false
	}
	return bytes.TrimSuffix(line, []byte{'\n'}), true
}

// gapRecord says how many records could not be written, and what their
// callers were told.
func gapRecord(now time.Time, lost uint64, policy string) *Record {
	msg := "records were accepted but could not be written (failure policy open)"
	if policy == FailClosed {
		msg = "records could not be written; their callers were refused (failure policy closed)"
	}
	return &Record{Time: now, Kind: KindAuditGap, Lost: lost, Message: msg}
}
