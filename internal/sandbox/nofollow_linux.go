package sandbox

import "syscall"

const noFollow = syscall.O_NOFOLLOW
