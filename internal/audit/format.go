package audit

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// AppendJSON appends r as one line in the writer's canonical encoding,
// including seq, prev and hash as recorded. For a record read from a log,
// this reproduces the line that was written.
func AppendJSON(b []byte, r *Record) []byte {
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, int64(r.V), 10)
	b = append(b, `,"seq":`...)
	b = strconv.AppendUint(b, r.Seq, 10)
	b = append(b, `,"prev":`...)
	b = appendString(b, r.Prev, maxField)
	b = appendBody(b, r)
	b = append(b, `,"hash":`...)
	b = appendString(b, r.Hash, maxField)
	return append(b, '}', '\n')
}

// Table prints records as an aligned table. Column widths are fixed so rows
// can stream (--follow); long values are cut with "…". Every value is made
// safe for a terminal.
type Table struct {
	w      io.Writer
	header bool
}

// NewTable returns a Table writing to w.
func NewTable(w io.Writer) *Table { return &Table{w: w} }

var tableCols = []struct {
	name  string
	width int
}{
	{"TIME", 20}, {"TENANT", 10}, {"SANDBOX", 12}, {"KIND", 13}, {"DECISION", 10}, {"REASON", 26},
	{"METHOD", 7}, {"DESTINATION", 32}, {"STATUS", 8}, {"IN/OUT", 13}, {"PATH / DETAIL", 0},
}

// Write prints one record (and the header before the first).
func (t *Table) Write(r *Record) error {
	var b strings.Builder
	if !t.header {
		t.header = true
		cells := make([]string, len(tableCols))
		for i, c := range tableCols {
			cells[i] = c.name
		}
		writeRow(&b, cells)
	}
	dest := r.Host
	if r.Port != 0 {
		dest = hostPort(r.Host, r.Port)
	}
	status := ""
	if r.Status != 0 {
		status = strconv.Itoa(r.Status)
	}
	detail := r.Path
	switch r.Kind {
	case KindLaunch, KindRun:
		detail = strings.Join(r.Command, " ")
		if r.ExitCode != nil {
			status = "exit " + strconv.Itoa(*r.ExitCode)
		}
		if r.KilledBy != "" {
			status = r.KilledBy
		}
	case KindAuditGap:
		detail = fmt.Sprintf("lost %d: %s", r.Lost, r.Message)
	case KindChain:
		detail = ""
		if r.PrevFile != "" {
			detail = "continues " + r.PrevFile
		}
	case KindConfigReload, KindAuthFailure:
		if detail == "" {
			detail = r.Message
		}
		if dest == "" && r.Client != "" {
			// Who failed, not where to: say so, or it reads as a destination.
			dest = "from " + r.Client
		}
	}
	var marks []string
	if len(r.Secrets) > 0 {
		marks = append(marks, "secrets="+strings.Join(r.Secrets, ","))
	}
	if r.Exfiltration {
		marks = append(marks, "EXFILTRATION")
	}
	if r.ReflectionScrubbed {
		marks = append(marks, "reflection-scrubbed")
	}
	if len(marks) > 0 {
		detail = strings.TrimSpace(detail + " [" + strings.Join(marks, " ") + "]")
	}
	inOut := ""
	if r.BytesIn != 0 || r.BytesOut != 0 {
		inOut = humanBytes(r.BytesIn) + "/" + humanBytes(r.BytesOut)
	}
	writeRow(&b, []string{
		r.Time.UTC().Format(time.RFC3339), r.Tenant, r.Sandbox, string(r.Kind), string(r.Decision), r.Reason,
		r.Method, dest, status, inOut, detail,
	})
	_, err := io.WriteString(t.w, b.String())
	return err
}

func writeRow(out *strings.Builder, cells []string) {
	var b strings.Builder
	for i, c := range cells {
		c = Printable(c)
		w := tableCols[i].width
		if w == 0 {
			b.WriteString(c)
			break
		}
		if n := utf8.RuneCountInString(c); n > w {
			c = string([]rune(c)[:w-1]) + "…"
		} else {
			c += strings.Repeat(" ", w-n)
		}
		b.WriteString(c)
		b.WriteString("  ")
	}
	out.WriteString(strings.TrimRight(b.String(), " "))
	out.WriteByte('\n')
}

func hostPort(h string, p int) string {
	if strings.Contains(h, ":") && !strings.HasPrefix(h, "[") {
		h = "[" + h + "]"
	}
	return h + ":" + strconv.Itoa(p)
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return strconv.FormatInt(n, 10)
	}
	f := float64(n)
	for _, s := range []string{"K", "M", "G", "T"} {
		f /= unit
		if f < unit {
			return strconv.FormatFloat(f, 'f', 1, 64) + s
		}
	}
	return strconv.FormatFloat(f, 'f', 1, 64) + "P"
}
