package sandbox

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
)

// copyTree copies the tree under src into dst. Both are os.Roots, so no path,
// symlink or ".." can lead outside either of them; symlinks are copied as
// symlinks and never followed; devices, sockets and fifos are skipped; setuid,
// setgid and sticky bits are dropped. uid/gid >= 0 chown what is created.
func copyTree(src, dst *os.Root, uid, gid int) error {
	return fs.WalkDir(src.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
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
			target, err := src.Readlink(p)
			if err != nil {
				return fmt.Errorf("readlink %s: %w", p, err)
			}
			if err := dst.Symlink(target, p); err != nil {
				return fmt.Errorf("symlink %s: %w", p, err)
			}
		case mode.IsRegular():
			if err := copyFile(src, dst, p, perm); err != nil {
				return err
			}
		default:
			return nil
		}
		if uid >= 0 {
			if err := dst.Lchown(path.Clean(p), uid, gid); err != nil {
				return fmt.Errorf("chown %s: %w", p, err)
			}
		}
		if mode.IsDir() {
			return dst.Chmod(p, perm|0o700)
		}
		return nil
	})
}

func copyFile(src, dst *os.Root, p string, perm fs.FileMode) error {
	in, err := src.OpenFile(p, os.O_RDONLY|noFollow, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", p, err)
	}
	defer in.Close()
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
