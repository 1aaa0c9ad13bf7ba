package certs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// maxPEMFileSize bounds what we read from a certificate, key or root bundle
// file, so that a path pointing at /dev/zero or a huge file fails cleanly
// instead of exhausting memory. Distribution root bundles are ~200 KiB.
const maxPEMFileSize = 4 << 20

// readBounded reads a regular file of at most maxPEMFileSize bytes. When
// privateKey is set it also refuses a file that group or others may read or
// write; the mode is checked on the opened descriptor so that a swap of the
// path between check and read cannot slip a different file past the check.
func readBounded(path string, privateKey bool) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if privateKey && fi.Mode().Perm()&0o077 != 0 {
		return nil, &keyModeError{path: path, mode: fi.Mode().Perm()}
	}
	if fi.Size() > maxPEMFileSize {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxPEMFileSize)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxPEMFileSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxPEMFileSize {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxPEMFileSize)
	}
	return data, nil
}

// keyModeError reports a private key file with permissions that are too open.
type keyModeError struct {
	path string
	mode fs.FileMode
}

func (e *keyModeError) Error() string {
	return fmt.Sprintf("key file %s has mode %04o: it must not be accessible to group or others (chmod 600 %s)", e.path, uint32(e.mode), e.path)
}

// createExclusive publishes data at path with the given mode, atomically and
// without ever replacing an existing file: the bytes go to a temporary file in
// the same directory, are synced, and the temporary file is then hard-linked to
// the final name (link(2) fails with EEXIST rather than overwriting, unlike
// rename(2)). A reader therefore sees either no file or the complete file.
func createExclusive(path string, data []byte, mode fs.FileMode) (err error) {
	dir := filepath.Dir(path)
	// os.CreateTemp creates the file with mode 0600, so a key is never
	// readable by others, not even for an instant.
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmpName := tmp.Name()
	defer func() {
		// The temporary name is only scaffolding: it goes away on success
		// (after the link) and on failure.
		if rmErr := os.Remove(tmpName); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) && err == nil {
			err = rmErr
		}
	}()
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Link(tmpName, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%s already exists: refusing to overwrite it", path)
		}
		return err
	}
	syncDir(dir)
	return nil
}

// syncDir makes a new directory entry durable. Failure is not fatal: the file
// content is already synced and some filesystems do not support syncing a
// directory.
func syncDir(dir string) {
	d, err := os.Open(dir)
	if err != nil {
		return
	}
	_ = d.Sync()
	_ = d.Close()
}
