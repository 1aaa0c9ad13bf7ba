package audit

import (
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf16"
	"unicode/utf8"
)

// parseLine decodes one line into a Record. It is a small hand-written
// decoder for the flat shape the writer produces (the summary reads millions
// of lines), but it accepts any valid JSON object: unknown members are
// skipped, whitespace is allowed.
func parseLine(line []byte) (*Record, error) {
	r := new(Record)
	if err := decodeInto(line, r); err != nil {
		return nil, err
	}
	return r, nil
}

var errSyntax = errors.New("audit: malformed record")

type dec struct {
	b      []byte
	i      int
	intern map[string]string // nil: no interning
}

// maxIntern bounds the strings one scan keeps for reuse.
const maxIntern = 1 << 14

func decodeInto(line []byte, r *Record) error {
	return decodeInterned(line, r, nil)
}

// decodeInterned is decodeInto sharing repeated strings (tenants, hosts,
// reasons, ...) through intern, which saves most allocations in long scans.
func decodeInterned(line []byte, r *Record, intern map[string]string) error {
	d := dec{b: line, intern: intern}
	d.ws()
	if !d.eat('{') {
		return errSyntax
	}
	d.ws()
	if d.eat('}') {
		return d.end()
	}
	for {
		d.ws()
		key, err := d.str()
		if err != nil {
			return err
		}
		d.ws()
		if !d.eat(':') {
			return errSyntax
		}
		d.ws()
		if err := d.field(key, r); err != nil {
			return fmt.Errorf("audit: field %q: %w", key, err)
		}
		d.ws()
		if d.eat(',') {
			continue
		}
		if d.eat('}') {
			return d.end()
		}
		return errSyntax
	}
}

func (d *dec) end() error {
	d.ws()
	if d.i != len(d.b) {
		return errSyntax
	}
	return nil
}

func (d *dec) field(key string, r *Record) error {
	var err error
	switch key {
	case "v":
		var n int64
		n, err = d.int()
		r.V = int(n)
	case "time":
		var s string
		if s, err = d.str(); err == nil {
			r.Time, err = time.Parse(time.RFC3339Nano, s)
		}
	case "kind":
		var s string
		s, err = d.istr()
		r.Kind = Kind(s)
	case "id":
		r.ID, err = d.str()
	case "tunnel_id":
		r.TunnelID, err = d.str()
	case "tenant":
		r.Tenant, err = d.istr()
	case "sandbox":
		r.Sandbox, err = d.istr()
	case "client":
		r.Client, err = d.istr()
	case "method":
		r.Method, err = d.istr()
	case "scheme":
		r.Scheme, err = d.istr()
	case "host":
		r.Host, err = d.istr()
	case "port":
		var n int64
		n, err = d.int()
		r.Port = int(n)
	case "path":
		r.Path, err = d.str()
	case "decision":
		var s string
		s, err = d.istr()
		r.Decision = Decision(s)
	case "mode":
		r.Mode, err = d.istr()
	case "rule":
		r.Rule, err = d.istr()
	case "reason":
		r.Reason, err = d.istr()
	case "status":
		var n int64
		n, err = d.int()
		r.Status = int(n)
	case "bytes_in":
		r.BytesIn, err = d.int()
	case "bytes_out":
		r.BytesOut, err = d.int()
	case "duration_ms":
		r.DurationMS, err = d.float()
	case "upstream_ip":
		r.UpstreamIP, err = d.istr()
	case "intercepted":
		r.Intercepted, err = d.bool()
	case "secrets":
		r.Secrets, err = d.strs()
	case "reflection_scrubbed":
		r.ReflectionScrubbed, err = d.bool()
	case "exfiltration":
		r.Exfiltration, err = d.bool()
	case "policy":
		r.Policy, err = d.istr()
	case "message":
		r.Message, err = d.str()
	case "command":
		r.Command, err = d.strs()
	case "limits":
		r.Limits, err = d.limits()
	case "exit_code":
		var n int64
		if n, err = d.int(); err == nil {
			c := int(n)
			r.ExitCode = &c
		}
	case "killed_by":
		r.KilledBy, err = d.istr()
	case "launcher":
		r.Launcher, err = d.istr()
	case "lost":
		var n int64
		n, err = d.int()
		if n < 0 {
			err = errSyntax
		}
		r.Lost = uint64(n)
	case "prev_file":
		r.PrevFile, err = d.str()
	case "seq":
		var n int64
		n, err = d.int()
		if n < 0 {
			err = errSyntax
		}
		r.Seq = uint64(n)
	case "prev":
		r.Prev, err = d.str()
	case "hash":
		r.Hash, err = d.str()
	default:
		err = d.skip(0)
	}
	return err
}

func (d *dec) limits() (*Limits, error) {
	l := new(Limits)
	if !d.eat('{') {
		return nil, errSyntax
	}
	d.ws()
	if d.eat('}') {
		return l, nil
	}
	for {
		d.ws()
		key, err := d.str()
		if err != nil {
			return nil, err
		}
		d.ws()
		if !d.eat(':') {
			return nil, errSyntax
		}
		d.ws()
		switch key {
		case "memory_bytes":
			l.MemoryBytes, err = d.int()
		case "pids":
			l.PIDs, err = d.int()
		case "cpus":
			l.CPUs, err = d.float()
		case "timeout_ms":
			l.TimeoutMS, err = d.int()
		case "workspace_bytes":
			l.WorkspaceBytes, err = d.int()
		case "tmp_bytes":
			l.TmpBytes, err = d.int()
		case "open_files":
			l.OpenFiles, err = d.int()
		default:
			err = d.skip(0)
		}
		if err != nil {
			return nil, err
		}
		d.ws()
		if d.eat(',') {
			continue
		}
		if d.eat('}') {
			return l, nil
		}
		return nil, errSyntax
	}
}

func (d *dec) ws() {
	for d.i < len(d.b) {
		switch d.b[d.i] {
		case ' ', '\t', '\r', '\n':
			d.i++
		default:
			return
		}
	}
}

func (d *dec) eat(c byte) bool {
	if d.i < len(d.b) && d.b[d.i] == c {
		d.i++
		return true
	}
	return false
}

func (d *dec) number() ([]byte, error) {
	start := d.i
	for d.i < len(d.b) {
		c := d.b[d.i]
		if (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E' {
			d.i++
			continue
		}
		break
	}
	if d.i == start {
		return nil, errSyntax
	}
	return d.b[start:d.i], nil
}

func (d *dec) int() (int64, error) {
	num, err := d.number()
	if err != nil {
		return 0, err
	}
	// Fast path for plain integers.
	var n int64
	neg := false
	s := num
	if s[0] == '-' {
		neg, s = true, s[1:]
	}
	if len(s) > 0 && len(s) <= 18 {
		ok := true
		for _, c := range s {
			if c < '0' || c > '9' {
				ok = false
				break
			}
			n = n*10 + int64(c-'0')
		}
		if ok {
			if neg {
				n = -n
			}
			return n, nil
		}
	}
	v, err := strconv.ParseInt(string(num), 10, 64)
	if err != nil {
		return 0, errSyntax
	}
	return v, nil
}

func (d *dec) float() (float64, error) {
	num, err := d.number()
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseFloat(string(num), 64)
	if err != nil {
		return 0, errSyntax
	}
	return v, nil
}

func (d *dec) bool() (bool, error) {
	switch {
	case d.lit("true"):
		return true, nil
	case d.lit("false"):
		return false, nil
	}
	return false, errSyntax
}

func (d *dec) lit(s string) bool {
	if len(d.b)-d.i >= len(s) && string(d.b[d.i:d.i+len(s)]) == s {
		d.i += len(s)
		return true
	}
	return false
}

func (d *dec) strs() ([]string, error) {
	if d.lit("null") {
		return nil, nil
	}
	if !d.eat('[') {
		return nil, errSyntax
	}
	var out []string
	d.ws()
	if d.eat(']') {
		return out, nil
	}
	for {
		d.ws()
		s, err := d.istr()
		if err != nil {
			return nil, err
		}
		out = append(out, s)
		d.ws()
		if d.eat(',') {
			continue
		}
		if d.eat(']') {
			return out, nil
		}
		return nil, errSyntax
	}
}

// istr is str for values that repeat across records.
func (d *dec) istr() (string, error) {
	if d.intern == nil || d.i >= len(d.b) || d.b[d.i] != '"' {
		return d.str()
	}
	end := d.i + 1
	for end < len(d.b) && d.b[end] != '"' && d.b[end] != '\\' && d.b[end] >= 0x20 && d.b[end] < utf8.RuneSelf {
		end++
	}
	if end >= len(d.b) || d.b[end] != '"' {
		return d.str()
	}
	raw := d.b[d.i+1 : end]
	if s, ok := d.intern[string(raw)]; ok {
		d.i = end + 1
		return s, nil
	}
	s := string(raw)
	if len(d.intern) < maxIntern {
		d.intern[s] = s
	}
	d.i = end + 1
	return s, nil
}

// str decodes a JSON string. Strings without escapes are the common case and
// cost one allocation.
func (d *dec) str() (string, error) {
	if !d.eat('"') {
		return "", errSyntax
	}
	start := d.i
	for d.i < len(d.b) {
		c := d.b[d.i]
		if c == '"' {
			s := string(d.b[start:d.i])
			d.i++
			return s, nil
		}
		if c == '\\' || c < 0x20 || c >= utf8.RuneSelf {
			return d.strSlow(start)
		}
		d.i++
	}
	return "", errSyntax
}

func (d *dec) strSlow(start int) (string, error) {
	out := append([]byte(nil), d.b[start:d.i]...)
	for d.i < len(d.b) {
		c := d.b[d.i]
		switch {
		case c == '"':
			d.i++
			return string(out), nil
		case c < 0x20:
			return "", errSyntax
		case c == '\\':
			if d.i+1 >= len(d.b) {
				return "", errSyntax
			}
			e := d.b[d.i+1]
			d.i += 2
			switch e {
			case '"', '\\', '/':
				out = append(out, e)
			case 'b':
				out = append(out, '\b')
			case 'f':
				out = append(out, '\f')
			case 'n':
				out = append(out, '\n')
			case 'r':
				out = append(out, '\r')
			case 't':
				out = append(out, '\t')
			case 'u':
				r, ok := d.hex4()
				if !ok {
					return "", errSyntax
				}
				if utf16.IsSurrogate(r) {
					r2 := rune(-1)
					if d.i+1 < len(d.b) && d.b[d.i] == '\\' && d.b[d.i+1] == 'u' {
						d.i += 2
						if r2, ok = d.hex4(); !ok {
							return "", errSyntax
						}
					}
					r = utf16.DecodeRune(r, r2)
				}
				out = utf8.AppendRune(out, r)
			default:
				return "", errSyntax
			}
		case c >= utf8.RuneSelf:
			r, size := utf8.DecodeRune(d.b[d.i:])
			if r == utf8.RuneError && size == 1 {
				out = append(out, "\uFFFD"...)
			} else {
				out = append(out, d.b[d.i:d.i+size]...)
			}
			d.i += size
		default:
			out = append(out, c)
			d.i++
		}
	}
	return "", errSyntax
}

func (d *dec) hex4() (rune, bool) {
	if d.i+4 > len(d.b) {
		return 0, false
	}
	var r rune
	for _, c := range d.b[d.i : d.i+4] {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			r |= rune(c - 'A' + 10)
		default:
			return 0, false
		}
	}
	d.i += 4
	return r, true
}

// skip passes over one value of any type, bounded in nesting.
func (d *dec) skip(depth int) error {
	if depth > 32 {
		return errSyntax
	}
	if d.i >= len(d.b) {
		return errSyntax
	}
	switch d.b[d.i] {
	case '"':
		_, err := d.str()
		return err
	case '{', '[':
		closer := byte('}')
		if d.b[d.i] == '[' {
			closer = ']'
		}
		obj := closer == '}'
		d.i++
		d.ws()
		if d.eat(closer) {
			return nil
		}
		for {
			d.ws()
			if obj {
				if _, err := d.str(); err != nil {
					return err
				}
				d.ws()
				if !d.eat(':') {
					return errSyntax
				}
				d.ws()
			}
			if err := d.skip(depth + 1); err != nil {
				return err
			}
			d.ws()
			if d.eat(',') {
				continue
			}
			if d.eat(closer) {
				return nil
			}
			return errSyntax
		}
	case 't', 'f':
		_, err := d.bool()
		return err
	case 'n':
		if d.lit("null") {
			return nil
		}
		return errSyntax
	default:
		_, err := d.number()
		return err
	}
}
