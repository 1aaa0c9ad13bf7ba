package rules

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// Duration is a time.Duration written in the config as a Go duration string ("30s").
type Duration time.Duration

// Std returns the value as a time.Duration.
func (d Duration) Std() time.Duration { return time.Duration(d) }

// String formats the duration the way the config writes it.
func (d Duration) String() string { return time.Duration(d).String() }

// Size is a byte count written in the config as "64KiB", "5MB" or a plain integer.
type Size int64

// Bytes returns the value as a byte count.
func (s Size) Bytes() int64 { return int64(s) }

// ParseDuration reads a config duration. Bare integers are refused because
// their unit would be a guess, and negative durations have no meaning here.
func ParseDuration(s string) (Duration, error) {
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("want a duration such as \"30s\" or \"5m\", got %q", s)
	}
	if d < 0 {
		return 0, fmt.Errorf("duration must not be negative, got %q", s)
	}
	return Duration(d), nil
}

// sizeUnits maps a suffix to its multiplier. Decimal (kB, MB) and binary
// (KiB, MiB) units are both accepted because both appear in the wild and the
// difference matters for byte budgets; lower-case "mb"/"kib" are refused so a
// bit/byte mix-up ("Mb") cannot slip through.
var sizeUnits = map[string]int64{
	"":    1,
	"B":   1,
	"kB":  1000,
	"KB":  1000,
	"MB":  1000 * 1000,
	"GB":  1000 * 1000 * 1000,
	"TB":  1000 * 1000 * 1000 * 1000,
	"KiB": 1 << 10,
	"MiB": 1 << 20,
	"GiB": 1 << 30,
	"TiB": 1 << 40,
}

// ParseSize reads a config size: a non-negative integer optionally followed by
// a unit (B, kB, KB, MB, GB, TB, KiB, MiB, GiB, TiB), with at most one space
// between them. Fractions, signs and overflow are refused.
func ParseSize(s string) (Size, error) {
	bad := fmt.Errorf("want a size such as \"64KiB\", \"5MB\" or 1024, got %q", s)
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	if i == 0 {
		if strings.HasPrefix(s, "-") {
			return 0, fmt.Errorf("size must not be negative, got %q", s)
		}
		return 0, bad
	}
	n, err := strconv.ParseInt(s[:i], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	unit := s[i:]
	if strings.HasPrefix(unit, " ") && len(unit) > 1 {
		unit = unit[1:]
	}
	mult, ok := sizeUnits[unit]
	if !ok {
		return 0, bad
	}
	if n > math.MaxInt64/mult {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return Size(n * mult), nil
}

var (
	durationType = reflect.TypeFor[Duration]()
	sizeType     = reflect.TypeFor[Size]()
)

// errNegativeSize is returned for a size given as a negative integer.
var errNegativeSize = errors.New("size must not be negative")

// decodeUnits is the mapstructure decode hook for Duration and Size. It is the
// second line of defence: the YAML walk in Parse reports the same problems with
// line numbers first, but a Config decoded by other means still gets them.
func decodeUnits(from reflect.Type, to reflect.Type, data any) (any, error) {
	switch to {
	case durationType:
		s, ok := data.(string)
		if !ok {
			return nil, fmt.Errorf("want a duration string such as \"30s\", got %s", from)
		}
		return ParseDuration(s)
	case sizeType:
		switch v := data.(type) {
		case string:
			return ParseSize(v)
		case int:
			if v < 0 {
				return nil, errNegativeSize
			}
			return Size(v), nil
		case int64:
			if v < 0 {
				return nil, errNegativeSize
			}
			return Size(v), nil
		case uint64:
			if v > math.MaxInt64 {
				return nil, errors.New("size is too large")
			}
			return Size(v), nil
		default:
			return nil, fmt.Errorf("want a size such as \"64KiB\" or an integer, got %s", from)
		}
	}
	return data, nil
}
