package sandbox

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// copyTree copies the tree under src into dst. Both are os.Roots, so no path,
// symlink or ".." can lead outside either of them; symlinks are copied as
// symlinks and never followed; devices, sockets and fifos are skipped; setuid,
// setgid and sticky bits are dropped. Every operation on dst runs through
// dstDo, which may run it under other filesystem ids (see fsidWorker).
func copyTree(src, dst *os.Root, dstDo func(func() error) error) error {
	return fs.WalkDir(src.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var in *os.File
		if d.Type().IsRegular() {
			// Opened with the launcher's own ids; only dst is touched as the sandbox.
			if in, err = src.OpenFile(p, os.O_RDONLY|noFollow, 0); err != nil {
				return fmt.Errorf("open %s: %w", p, err)
			}
			defer in.Close()
		}
		var target string
		if d.Type()&fs.ModeSymlink != 0 {
			if target, err = src.Readlink(p); err != nil {
				return fmt.Errorf("readlink %s: %w", p, err)
			}
		}
		return dstDo(func() error { return copyEntry(dst, p, d, in, target) })
	})
}

func copyEntry(dst *os.Root, p string, d fs.DirEntry, in *os.File, target string) error {
	{
		info, err := d.Info()
		if err != nil {
			return err
		}
		mode := info.Mode()
		perm := mode.Perm()
		if p != "." {
			if fi, lerr := dst.Lstat(p); lerr == nil && (fi.Mode()&fs.ModeSymlink != 0 || fi.IsDir() != mode.IsDir()) {
				// Never write through a link, or into a type we did not make.
				if err := dst.RemoveAll(p); err != nil {
					return fmt.Errorf("replacing %s: %w", p, err)
				}
			}
		}
		switch {
		case mode.IsDir():
			if p != "." {
				if err := dst.Mkdir(p, perm|0o700); err != nil && !errors.Is(err, fs.ErrExist) {
					return fmt.Errorf("mkdir %s: %w", p, err)
				}
			}
		case mode&fs.ModeSymlink != 0:
			if err := dst.Symlink(target, p); err != nil {
				return fmt.Errorf("symlink %s: %w", p, err)
			}
		case mode.IsRegular():
			if err := copyFile(in, dst, p, perm); err != nil {
				return err
			}
		default:
			return nil
		}
		if mode.IsDir() {
			return dst.Chmod(p, perm|0o700)
		}
		return nil
	}
}

func copyFile(in *os.File, dst *os.Root, p string, perm fs.FileMode) error {
	out, err := dst.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|noFollow, perm)
	if err != nil {
		return fmt.Errorf("create %s: %w", p, err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", p, err)
	}
	if err := out.Chmod(perm); err != nil {
		out.Close()
		return fmt.Errorf("chmod %s: %w", p, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("close %s: %w", p, err)
	}
	return nil
}

// fsidWorker runs functions on one OS thread whose filesystem uid and gid are
// the sandbox's. Files created in the sandbox's tmpfs must be owned by an id
// mapped in its user namespace (the kernel refuses others with EOVERFLOW),
// and creating them as that id also means the sandbox owns them.
type fsidWorker struct {
	jobs chan func() error
	errs chan error
}

func newFSIDWorker(uid, gid int) (*fsidWorker, error) {
	w := &fsidWorker{jobs: make(chan func() error), errs: make(chan error)}
	ready := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		ouid, _ := unix.SetfsuidRetUid(-1)
		ogid, _ := unix.SetfsgidRetGid(-1)
		defer func() {
			// Back to the launcher's own ids before the thread is reused. If
			// that fails the thread stays locked and ends with the goroutine.
			_, _ = unix.SetfsuidRetUid(ouid)
			_, _ = unix.SetfsgidRetGid(ogid)
			cu, _ := unix.SetfsuidRetUid(-1)
			cg, _ := unix.SetfsgidRetGid(-1)
			if cu == ouid && cg == ogid {
				runtime.UnlockOSThread()
			}
		}()
		_, _ = unix.SetfsgidRetGid(gid)
		_, _ = unix.SetfsuidRetUid(uid)
		// The calls return the previous id; asking again with -1 reports the current one.
		if cu, _ := unix.SetfsuidRetUid(-1); cu != uid {
			ready <- fmt.Errorf("could not switch to filesystem uid %d", uid)
			return
		}
		if cg, _ := unix.SetfsgidRetGid(-1); cg != gid {
			ready <- fmt.Errorf("could not switch to filesystem ids %d:%d", uid, gid)
			return
		}
		ready <- nil
		for job := range w.jobs {
			w.errs <- job()
		}
	}()
	if err := <-ready; err != nil {
		return nil, err
	}
	return w, nil
}

func (w *fsidWorker) do(f func() error) error {
	w.jobs <- f
	return <-w.errs
}

func (w *fsidWorker) close() { close(w.jobs) }

// direct runs f on the calling goroutine.
func direct(f func() error) error { return f() }
