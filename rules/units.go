package rules

import "time"

// Duration is a time.Duration written in the config as a Go duration string ("30s").
type Duration time.Duration

// Size is a byte count written in the config as "64KiB", "5MB" or a plain integer.
type Size int64
