package broker

import (
	"fmt"
	"io/fs"
	"syscall"
)

// statKey distinguishes a replaced file with the same size and mtime.
func statKey(st fs.FileInfo) string {
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		return fmt.Sprintf("%d:%d:%d", s.Dev, s.Ino, s.Ctim.Nano())
	}
	return ""
}
