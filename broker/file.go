package broker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"github.com/fsnotify/fsnotify"
	"gopkg.in/yaml.v3"

	"github.com/sluicehq/sluice/rules"
)

// maxSecretsFile bounds how much of the secrets file is read.
const maxSecretsFile = 1 << 20

// FileSource reads secrets from a local YAML or JSON file of name → string
// value, kept outside any sandbox. The file must not be accessible to group or
// other (mode 0600 or stricter): a secrets file others can read is refused, not
// warned about. The file is re-read whenever it changes on disk.
type FileSource struct {
	path string
	log  *slog.Logger

	mu     sync.Mutex
	cached fileSnapshot
}

type fileSnapshot struct {
	stamp  fileStamp
	values map[string]string
}

// fileStamp identifies one version of the file cheaply; if it is unchanged the
// parsed values are reused.
type fileStamp struct {
	size    int64
	modNano int64
	mode    fs.FileMode
	sys     string
}

// NewFileSource returns a source for the file at path. The file is not read
// until the first Fetch, so a broker can start before the file exists.
func NewFileSource(path string, log *slog.Logger) (*FileSource, error) {
	if path == "" {
		return nil, errors.New("broker: file source: broker.file.path is empty")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("broker: file source %s: %w", path, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &FileSource{path: abs, log: log}, nil
}

// Name implements Source.
func (*FileSource) Name() string { return "file" }

// Fetch implements Source. The key is spec.Key, else spec.Name.
func (f *FileSource) Fetch(ctx context.Context, spec rules.SecretSpec) (Value, error) {
	if err := ctx.Err(); err != nil {
		return Value{}, err
	}
	key := spec.Key
	if key == "" {
		key = spec.Name
	}
	values, err := f.load()
	if err != nil {
		return Value{}, err
	}
	v, ok := values[key]
	if !ok {
		return Value{}, fmt.Errorf("broker: file %s: no key %q", f.path, key)
	}
	if v == "" {
		return Value{}, fmt.Errorf("broker: file %s: key %q is empty", f.path, key)
	}
	return NewValue([]byte(v)), nil
}

func (f *FileSource) load() (map[string]string, error) {
	fh, err := os.Open(f.path)
	if err != nil {
		return nil, fmt.Errorf("broker: file source: %w", err)
	}
	defer fh.Close()
	// Stat the open file, not the path, so the mode we check is the mode of
	// the bytes we read even if the file is swapped meanwhile.
	st, err := fh.Stat()
	if err != nil {
		return nil, fmt.Errorf("broker: file source: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("broker: file %s: not a regular file", f.path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("broker: file %s has mode %04o: a secrets file must not be accessible to group or other (chmod 600)", f.path, perm)
	}
	stamp := fileStamp{size: st.Size(), modNano: st.ModTime().UnixNano(), mode: st.Mode(), sys: statKey(st)}

	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cached.values != nil && f.cached.stamp == stamp {
		return f.cached.values, nil
	}
	data := make([]byte, 0, min(st.Size()+1, maxSecretsFile+1))
	buf := bytes.NewBuffer(data)
	if _, err := buf.ReadFrom(io.LimitReader(fh, maxSecretsFile+1)); err != nil {
		return nil, fmt.Errorf("broker: file source: read %s: %w", f.path, err)
	}
	if buf.Len() > maxSecretsFile {
		return nil, fmt.Errorf("broker: file %s: larger than %d bytes", f.path, maxSecretsFile)
	}
	values, err := parseSecretsFile(buf.Bytes())
	clear(buf.Bytes())
	if err != nil {
		return nil, fmt.Errorf("broker: file %s: %w", f.path, err)
	}
	f.cached = fileSnapshot{stamp: stamp, values: values}
	return values, nil
}

// parseSecretsFile decodes a flat mapping of name to string. JSON is read as
// YAML (a subset). Errors describe structure and position only: yaml.v3's own
// messages can quote the offending scalar, which here would be a secret.
func parseSecretsFile(data []byte) (map[string]string, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, errors.New("not valid YAML or JSON")
	}
	if len(doc.Content) == 0 {
		return map[string]string{}, nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("line %d: want a mapping of secret name to value", root.Line)
	}
	out := make(map[string]string, len(root.Content)/2)
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		if k.Kind != yaml.ScalarNode || k.Tag != "!!str" {
			return nil, fmt.Errorf("line %d: keys must be strings", k.Line)
		}
		if _, dup := out[k.Value]; dup {
			return nil, fmt.Errorf("line %d: duplicate key %q", k.Line, k.Value)
		}
		// Only quoted or plain strings: a number or bool would be silently
		// reformatted (0123 → 83) and then sent as the wrong credential.
		if v.Kind != yaml.ScalarNode || v.Tag != "!!str" {
			return nil, fmt.Errorf("line %d: value of %q must be a string (quote it)", v.Line, k.Value)
		}
		out[k.Value] = v.Value
	}
	return out, nil
}

// Run implements runner: it watches the file's directory (editors and
// orchestrators replace files by rename, which a watch on the file itself
// would miss) and asks for a refresh when the file may have changed. The
// broker's periodic refresh remains the fallback if watching fails.
func (f *FileSource) Run(ctx context.Context, changed func()) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		f.log.Warn("broker: cannot watch secrets file; relying on periodic refresh", "path", f.path, "err", err)
		return
	}
	defer w.Close()
	dir := filepath.Dir(f.path)
	if err := w.Add(dir); err != nil {
		f.log.Warn("broker: cannot watch secrets file directory; relying on periodic refresh", "dir", dir, "err", err)
		return
	}
	// The watch starts after the first fetch: a change made in between
	// would be missed until the periodic refresh, so look once more now.
	changed()
	base := filepath.Base(f.path)
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.Events:
			if !ok {
				return
			}
			if filepath.Base(ev.Name) == base {
				changed()
			}
		case err, ok := <-w.Errors:
			if !ok {
				return
			}
			f.log.Warn("broker: secrets file watch error", "path", f.path, "err", err)
		}
	}
}
