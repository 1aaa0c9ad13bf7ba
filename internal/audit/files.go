package audit

import (
	"bufio"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// Rotated files are named <active>.<UTC timestamp>[-n][.gz], for example
// audit.log.20260102T150405.123456789Z.gz. The fixed-width stamp sorts in time
// order; the active file (no suffix) comes last.
const rotateStamp = "20060102T150405.000000000Z"

var rotatedSuffix = regexp.MustCompile(`^\.(\d{8}T\d{6}\.\d{9}Z)(-\d+)?(\.gz)?$`)

func isGzip(path string) bool { return strings.HasSuffix(path, ".gz") }

// logicalName is a file's name without the .gz a background compression
// added: the name chain headers use.
func logicalName(name string) string { return strings.TrimSuffix(name, ".gz") }

// rotatedSiblings lists the rotated files of an active path, oldest first. A
// file present both compressed and not (a crash during compression) is listed
// once, uncompressed.
func rotatedSiblings(active string) ([]string, error) {
	dir, base := filepath.Split(active)
	if dir == "" {
		dir = "."
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("audit: list %s: %w", dir, err)
	}
	type item struct{ key, path string }
	seen := map[string]bool{}
	var items []item
	for _, e := range entries {
		name := e.Name()
		if !strings.HasPrefix(name, base+".") || !e.Type().IsRegular() {
			continue
		}
		m := rotatedSuffix.FindStringSubmatch(name[len(base):])
		if m == nil {
			continue
		}
		logical := logicalName(name)
		if seen[logical] {
			continue
		}
		if m[3] != "" {
			if _, err := os.Stat(filepath.Join(dir, logical)); err == nil {
				continue // the uncompressed copy is listed instead
			}
		}
		seen[logical] = true
		items = append(items, item{key: m[1] + fmt.Sprintf("%08s", strings.TrimPrefix(m[2], "-")), path: filepath.Join(dir, name)})
	}
	sort.Slice(items, func(i, j int) bool { return items[i].key < items[j].key })
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.path
	}
	return out, nil
}

// ResolveSet turns the paths a reviewer names into the ordered list of files
// to read. An active log path expands to its rotated files (oldest first)
// followed by itself; rotated or other files are taken as named. Duplicates
// are dropped. Files are ordered by set, then rotation time, active last.
func ResolveSet(paths []string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	add := func(p string) {
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	for _, p := range paths {
		if p == "" {
			return nil, errors.New("audit: empty path")
		}
		if isRotatedName(p) {
			add(p)
			continue
		}
		sibs, err := rotatedSiblings(p)
		if err != nil {
			return nil, err
		}
		for _, s := range sibs {
			add(s)
		}
		if _, err := os.Stat(p); err == nil {
			add(p)
		} else if len(sibs) == 0 {
			return nil, fmt.Errorf("audit: %w", err)
		}
	}
	// Keep the files of one set together and in rotation order even when
	// named out of order; sets stay in the order they were first named.
	order := map[string]int{}
	for _, p := range out {
		if k, _ := setKey(p); order[k] == 0 {
			order[k] = len(order) + 1
		}
	}
	sort.SliceStable(out, func(i, j int) bool {
		si, ki := setKey(out[i])
		sj, kj := setKey(out[j])
		if si != sj {
			return order[si] < order[sj]
		}
		return ki < kj
	})
	return out, nil
}

func isRotatedName(p string) bool {
	base := filepath.Base(p)
	for i := 0; i < len(base); i++ {
		if base[i] == '.' && rotatedSuffix.MatchString(base[i:]) {
			return true
		}
	}
	return false
}

// setKey returns the active name a file belongs to and its order in the set.
func setKey(p string) (string, string) {
	dir, base := filepath.Split(p)
	for i := 0; i < len(base); i++ {
		if base[i] != '.' {
			continue
		}
		if m := rotatedSuffix.FindStringSubmatch(base[i:]); m != nil {
			return dir + base[:i], m[1] + fmt.Sprintf("%08s", strings.TrimPrefix(m[2], "-"))
		}
	}
	return p, "~" // the active file sorts after every stamp
}

// openRecords opens a log file for reading, decompressing .gz files.
func openRecords(path string) (io.ReadCloser, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	if !isGzip(path) {
		return f, nil
	}
	zr, err := gzip.NewReader(bufio.NewReaderSize(f, 64<<10))
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("audit: %s: %w", path, err)
	}
	return &gzipFile{Reader: zr, f: f}, nil
}

type gzipFile struct {
	*gzip.Reader
	f *os.File
}

func (g *gzipFile) Close() error {
	err := g.Reader.Close()
	return errors.Join(err, g.f.Close())
}

// compressFile gzips a rotated file: write name.gz.tmp, fsync, rename to
// name.gz, then remove the original. A crash at any point leaves at least one
// complete copy, and readers prefer the uncompressed one.
func compressFile(name string) error {
	src, err := os.Open(name)
	if err != nil {
		return err
	}
	defer src.Close()
	tmp := name + ".gz.tmp"
	dst, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	zw := gzip.NewWriter(dst)
	_, err = io.Copy(zw, src)
	if err == nil {
		err = zw.Close()
	}
	if err == nil {
		err = dst.Sync()
	}
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, name+".gz")
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	syncDir(filepath.Dir(name))
	return os.Remove(name)
}
