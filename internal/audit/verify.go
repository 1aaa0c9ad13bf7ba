package audit

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"path/filepath"
)

// ProblemKind classifies the first thing Verify found wrong.
type ProblemKind string

// Problem kinds.
const (
	ProblemModified    ProblemKind = "modified"     // a record's bytes no longer match its hash, or its link was rewritten
	ProblemDeleted     ProblemKind = "deleted"      // records are missing from the chain
	ProblemInserted    ProblemKind = "inserted"     // a record that does not belong to the chain was added
	ProblemReordered   ProblemKind = "reordered"    // records are out of order
	ProblemMissingFile ProblemKind = "missing_file" // a file of the set is missing
	ProblemMalformed   ProblemKind = "malformed"    // a complete line that is not a record
	ProblemTruncated   ProblemKind = "truncated"    // a file ends in a partial line that no crash explains
)

// Problem is the first break in the chain.
type Problem struct {
	Kind   ProblemKind
	At     Location
	Seq    uint64 // the sequence number expected there
	Detail string
}

func (p *Problem) String() string {
	return fmt.Sprintf("%s: %s: %s", p.At, p.Kind, p.Detail)
}

// Report is the result of Verify.
type Report struct {
	Files    []string
	Records  int    // records whose hash and link verified
	FirstSeq uint64 // seq of the first record
	LastSeq  uint64
	LastHash string // anchor: compare with a copy kept elsewhere to detect a cut-off end
	// ContinuesFrom is set when the set does not start at the beginning of
	// the chain (older files were removed by retention): the file the first
	// header names.
	ContinuesFrom string
	// TornTail is set when the last file ends in a partial line: a crash
	// during a write, not tampering. The record was never acknowledged.
	TornTail *Location
	Notes    []string // explained irregularities (a crash recorded by the next file's header)
	Problem  *Problem // nil when the chain is intact
}

// OK reports whether the chain verified.
func (r *Report) OK() bool { return r.Problem == nil }

type vline struct {
	at        Location
	rec       *Record
	hashOK    bool
	complete  bool
	fileStart bool
	lastFile  bool
}

// Verify checks the hash chain across files, given oldest first (see
// ResolveSet). It returns an error only when a file cannot be read; a broken
// chain is reported in Report.Problem, with the first bad record's file and
// line.
func Verify(paths []string) (Report, error) {
	return VerifyContext(context.Background(), paths)
}

// VerifyContext is Verify bounded by ctx.
func VerifyContext(ctx context.Context, paths []string) (Report, error) {
	rep := Report{Files: paths}
	if len(paths) == 0 {
		return rep, errors.New("audit: verify: no files")
	}
	var readErr error
	next, stop := iter.Pull(func(yield func(*vline) bool) {
		for i, path := range paths {
			first := true
			err := scanFile(ctx, path, func(line []byte, n int, complete bool) error {
				v := &vline{at: Location{File: path, Line: n}, complete: complete, fileStart: first, lastFile: i == len(paths)-1}
				first = false
				if complete {
					if r, err := parseLine(line); err == nil {
						v.rec = r
						computed, claimed, ok := lineHash(line)
						v.hashOK = ok && computed == claimed && claimed == r.Hash
					}
				}
				if !yield(v) {
					return errStop
				}
				return nil
			})
			if errors.Is(err, errStop) {
				return
			}
			if err != nil {
				readErr = err
				return
			}
		}
	})
	defer stop()

	var peeked *vline
	pull := func() *vline {
		if peeked != nil {
			v := peeked
			peeked = nil
			return v
		}
		v, ok := next()
		if !ok {
			return nil
		}
		return v
	}
	peek := func() *vline {
		if peeked == nil {
			if v, ok := next(); ok {
				peeked = v
			}
		}
		return peeked
	}

	var (
		started  bool
		lastSeq  uint64
		lastHash string
		lastPrev string   // the accepted record's own link
		lastAt   Location // where it is
		prevFile string
		torn     *Location
	)
	fail := func(kind ProblemKind, at Location, format string, a ...any) (Report, error) {
		rep.Problem = &Problem{Kind: kind, At: at, Seq: lastSeq + 1, Detail: fmt.Sprintf(format, a...)}
		return rep, nil
	}
	accept := func(v *vline) {
		if !started {
			started = true
			rep.FirstSeq = v.rec.Seq
		}
		lastSeq, lastHash, lastPrev, lastAt = v.rec.Seq, v.rec.Hash, v.rec.Prev, v.at
		rep.LastSeq, rep.LastHash = lastSeq, lastHash
		rep.Records++
	}
	fits := func(v *vline) bool {
		return v != nil && v.complete && v.rec != nil && v.hashOK && v.rec.Seq == lastSeq+1 && v.rec.Prev == lastHash
	}

	for v := pull(); v != nil; v = pull() {
		if !v.complete {
			if v.lastFile {
				rep.TornTail = &v.at
				continue
			}
			torn = &v.at
			continue
		}
		if v.rec == nil {
			return fail(ProblemMalformed, v.at, "line is not an audit record")
		}
		if v.fileStart {
			h := v.rec
			if h.Kind != KindChain {
				if !v.hashOK {
					return fail(ProblemModified, v.at, "record does not match its hash (and the file's chain header is gone)")
				}
				return fail(ProblemDeleted, v.at, "file does not start with its chain header: records were removed from its start")
			}
			if !v.hashOK {
				return fail(ProblemModified, v.at, "chain header does not match its hash")
			}
			if !started {
				if h.Reason == ChainFileMissing {
					return fail(ProblemDeleted, v.at, "the writer found its file %q removed or replaced; the records before seq %d are gone", h.PrevFile, h.Seq)
				}
				if h.Seq != 1 || h.Prev != "" {
					rep.ContinuesFrom = h.PrevFile
					rep.Notes = append(rep.Notes, fmt.Sprintf("%s: the set starts at seq %d, continuing %q (older files not given)", v.at, h.Seq, h.PrevFile))
				}
				accept(v)
				prevFile = logicalName(filepath.Base(v.at.File))
				continue
			}
			if torn != nil {
				if (h.Reason == ChainTornTail || h.Reason == ChainWriteError) && fits(v) {
					rep.Notes = append(rep.Notes, fmt.Sprintf("%s: partial line left by a crash or failed write; the next file's header records it (%s)", torn, h.Reason))
					torn = nil
					accept(v)
					prevFile = logicalName(filepath.Base(v.at.File))
					continue
				}
				return fail(ProblemTruncated, *torn, "file ends in a partial line that the next file's header does not account for")
			}
			if fits(v) {
				if h.PrevFile != "" && h.PrevFile != prevFile {
					rep.Notes = append(rep.Notes, fmt.Sprintf("%s: header names previous file %q, the set has %q (renamed?)", v.at, h.PrevFile, prevFile))
				}
				accept(v)
				prevFile = logicalName(filepath.Base(v.at.File))
				continue
			}
			if h.Reason == ChainFileMissing {
				return fail(ProblemDeleted, v.at, "the writer found its file %q removed or replaced; records after seq %d up to %d are gone", h.PrevFile, lastSeq, h.Seq-1)
			}
			if h.Seq > lastSeq+1 {
				return fail(ProblemMissingFile, v.at, "header continues %q at seq %d, but the previous file in the set is %q ending at seq %d: a file (or its end) is missing", h.PrevFile, h.Seq, prevFile, lastSeq)
			}
			return fail(ProblemInserted, v.at, "chain header does not follow the previous file (seq %d, expected %d)", h.Seq, lastSeq+1)
		}
		if torn != nil {
			return fail(ProblemTruncated, *torn, "partial line followed by more records")
		}
		if !started {
			return fail(ProblemDeleted, v.at, "no chain header before this record")
		}
		if fits(v) && v.rec.Kind != KindChain {
			accept(v)
			continue
		}
		r := v.rec
		if n := peek(); fits(n) && !n.fileStart {
			if v.hashOK && r.Seq == n.rec.Seq+1 && r.Prev == n.rec.Hash {
				return fail(ProblemReordered, v.at, "record seq %d comes before seq %d (line %d)", r.Seq, n.rec.Seq, n.at.Line)
			}
			return fail(ProblemInserted, v.at, "record does not belong to the chain; the next line continues it")
		}
		if v.hashOK && r.Seq == lastSeq && r.Prev == lastPrev {
			// Two records claim the same place. The one the next record
			// continues is genuine; the other was inserted.
			if n := peek(); n != nil && n.rec != nil && n.hashOK && n.rec.Prev == r.Hash {
				return fail(ProblemInserted, lastAt, "record claims seq %d, which line %d holds and the chain continues from", lastSeq, v.at.Line)
			}
			return fail(ProblemInserted, v.at, "seq %d was already used at line %d", r.Seq, lastAt.Line)
		}
		switch {
		case !v.hashOK:
			return fail(ProblemModified, v.at, "record does not match its hash (seq %d)", r.Seq)
		case r.Kind == KindChain:
			return fail(ProblemInserted, v.at, "unexpected chain header inside a file")
		case r.Seq > lastSeq+1:
			return fail(ProblemDeleted, v.at, "records seq %d to %d are missing before this line", lastSeq+1, r.Seq-1)
		case r.Seq <= lastSeq:
			return fail(ProblemInserted, v.at, "seq %d was already used (a copied or replayed record)", r.Seq)
		default:
			return fail(ProblemModified, v.at, "record's link to the previous record was rewritten")
		}
	}
	if readErr != nil {
		return rep, readErr
	}
	if err := ctx.Err(); err != nil {
		return rep, err
	}
	if torn != nil {
		// Only possible when the last file is empty after a torn file.
		return fail(ProblemTruncated, *torn, "file ends in a partial line")
	}
	return rep, nil
}

var errStop = errors.New("stop")
