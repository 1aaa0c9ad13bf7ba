package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// The hashed encoding. A line is
//
//	{"v":1,"seq":N,"prev":"<hex>",<fields...>,"hash":"<hex>"}\n
//
// and hash is the lower-case hex SHA-256 of exactly the bytes of that line
// without the trailing `,"hash":"<hex>"` member and without the newline, i.e.
// of `{"v":1,"seq":N,"prev":"<hex>",<fields...>}`. The verifier hashes the
// bytes it reads, not a re-encoding, so any change to any byte of a line shows.
// Fields come in the order of the Record struct and are omitted when empty.

const hashSuffixLen = len(`,"hash":"`) + sha256.Size*2 + len(`"}`)

// Bounds on attacker-influenced strings, so one record stays small.
const (
	maxField   = 1024 // host, path, ids, rule, ...
	maxMessage = 256
	maxList    = 64 // secrets, command arguments
)

// appendBody appends the record's fields after the chain prefix, each with a
// leading comma. It never emits seq, prev or hash: the writer adds those in
// order.
func appendBody(b []byte, r *Record) []byte {
	b = append(b, `,"time":"`...)
	b = r.Time.UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, '"')
	b = appendStrField(b, "kind", string(r.Kind), maxField)
	b = appendStrField(b, "id", r.ID, maxField)
	b = appendStrField(b, "tunnel_id", r.TunnelID, maxField)
	b = appendStrField(b, "tenant", r.Tenant, maxField)
	b = appendStrField(b, "sandbox", r.Sandbox, maxField)
	b = appendStrField(b, "client", r.Client, maxField)
	b = appendStrField(b, "method", r.Method, maxField)
	b = appendStrField(b, "scheme", r.Scheme, maxField)
	b = appendStrField(b, "host", r.Host, maxField)
	b = appendIntField(b, "port", int64(r.Port))
	b = appendStrField(b, "path", stripQuery(r.Path), maxField)
	b = appendStrField(b, "decision", string(r.Decision), maxField)
	b = appendStrField(b, "mode", r.Mode, maxField)
	b = appendStrField(b, "rule", r.Rule, maxField)
	b = appendStrField(b, "reason", r.Reason, maxField)
	b = appendIntField(b, "status", int64(r.Status))
	b = appendIntField(b, "bytes_in", r.BytesIn)
	b = appendIntField(b, "bytes_out", r.BytesOut)
	b = appendFloatField(b, "duration_ms", r.DurationMS)
	b = appendStrField(b, "upstream_ip", r.UpstreamIP, maxField)
	b = appendBoolField(b, "intercepted", r.Intercepted)
	b = appendListField(b, "secrets", r.Secrets)
	b = appendBoolField(b, "reflection_scrubbed", r.ReflectionScrubbed)
	b = appendBoolField(b, "exfiltration", r.Exfiltration)
	b = appendStrField(b, "policy", r.Policy, maxField)
	b = appendStrField(b, "message", r.Message, maxMessage)
	b = appendListField(b, "command", r.Command)
	if l := r.Limits; l != nil && *l != (Limits{}) {
		b = append(b, `,"limits":{`...)
		n := len(b)
		b = appendIntField(b, "memory_bytes", l.MemoryBytes)
		b = appendIntField(b, "pids", l.PIDs)
		b = appendFloatField(b, "cpus", l.CPUs)
		b = appendIntField(b, "timeout_ms", l.TimeoutMS)
		b = appendIntField(b, "workspace_bytes", l.WorkspaceBytes)
		b = appendIntField(b, "tmp_bytes", l.TmpBytes)
		b = appendIntField(b, "open_files", l.OpenFiles)
		if len(b) > n { // drop the leading comma of the first member
			copy(b[n:], b[n+1:])
			b = b[:len(b)-1]
		}
		b = append(b, '}')
	}
	if r.ExitCode != nil {
		b = append(b, `,"exit_code":`...)
		b = strconv.AppendInt(b, int64(*r.ExitCode), 10)
	}
	b = appendStrField(b, "killed_by", r.KilledBy, maxField)
	b = appendStrField(b, "launcher", r.Launcher, maxField)
	if r.Lost != 0 {
		b = append(b, `,"lost":`...)
		b = strconv.AppendUint(b, r.Lost, 10)
	}
	b = appendStrField(b, "prev_file", r.PrevFile, maxField)
	return b
}

// appendLine appends one complete, hashed line for a record whose body was
// encoded by appendBody, and returns the new buffer and the record's hash.
func appendLine(b []byte, seq uint64, prev string, body []byte) ([]byte, string) {
	start := len(b)
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, SchemaVersion, 10)
	b = append(b, `,"seq":`...)
	b = strconv.AppendUint(b, seq, 10)
	b = append(b, `,"prev":"`...)
	b = append(b, prev...) // hex, produced by us
	b = append(b, '"')
	b = append(b, body...)
	b = append(b, '}')
	sum := sha256.Sum256(b[start:])
	b = b[:len(b)-1]
	b = append(b, `,"hash":"`...)
	n := len(b)
	b = append(b, make([]byte, sha256.Size*2)...)
	hex.Encode(b[n:], sum[:])
	h := string(b[n:])
	b = append(b, `"}`...)
	b = append(b, '\n')
	return b, h
}

// lineHash recomputes the hash of a line (without its newline) and returns it
// with the hash the line claims. ok is false when the line does not end in a
// well-formed hash member.
func lineHash(line []byte) (computed, claimed string, ok bool) {
	if len(line) < hashSuffixLen+2 {
		return "", "", false
	}
	cut := len(line) - hashSuffixLen
	suf := line[cut:]
	if string(suf[:len(`,"hash":"`)]) != `,"hash":"` || string(suf[len(suf)-2:]) != `"}` {
		return "", "", false
	}
	claimedB := suf[len(`,"hash":"`) : len(suf)-2]
	for _, c := range claimedB {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return "", "", false
		}
	}
	h := sha256.New()
	h.Write(line[:cut])
	h.Write([]byte{'}'})
	var sum [sha256.Size]byte
	return hex.EncodeToString(h.Sum(sum[:0])), string(claimedB), true
}

func stripQuery(p string) string {
	if i := strings.IndexAny(p, "?#"); i >= 0 {
		return p[:i]
	}
	return p
}

func appendStrField(b []byte, name, v string, limit int) []byte {
	if v == "" {
		return b
	}
	b = append(b, ',', '"')
	b = append(b, name...)
	b = append(b, '"', ':')
	return appendString(b, v, limit)
}

func appendIntField(b []byte, name string, v int64) []byte {
	if v == 0 {
		return b
	}
	b = append(b, ',', '"')
	b = append(b, name...)
	b = append(b, '"', ':')
	return strconv.AppendInt(b, v, 10)
}

func appendFloatField(b []byte, name string, v float64) []byte {
	if v == 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return b
	}
	b = append(b, ',', '"')
	b = append(b, name...)
	b = append(b, '"', ':')
	return strconv.AppendFloat(b, v, 'f', -1, 64)
}

func appendBoolField(b []byte, name string, v bool) []byte {
	if !v {
		return b
	}
	b = append(b, ',', '"')
	b = append(b, name...)
	return append(b, `":true`...)
}

func appendListField(b []byte, name string, v []string) []byte {
	if len(v) == 0 {
		return b
	}
	b = append(b, ',', '"')
	b = append(b, name...)
	b = append(b, `":[`...)
	for i, s := range v {
		if i == maxList {
			b = append(b, `,"…"`...)
			break
		}
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, s, maxField)
	}
	return append(b, ']')
}

const hexDigits = "0123456789abcdef"

// appendString appends s as a JSON string. Control characters (so no raw
// newline ever reaches the file), quotes, backslashes, U+2028/U+2029 and
// invalid UTF-8 are escaped or replaced. Strings longer than limit bytes are
// cut at a rune boundary and marked with "…".
func appendString(b []byte, s string, limit int) []byte {
	cut := false
	if len(s) > limit {
		i := limit
		for i > 0 && !utf8.RuneStart(s[i]) {
			i--
		}
		s, cut = s[:i], true
	}
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != 0x7f {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"':
				b = append(b, '\\', '"')
			case '\\':
				b = append(b, '\\', '\\')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	if cut {
		b = append(b, "…"...)
	}
	return append(b, '"')
}
