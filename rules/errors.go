package rules

import (
	"fmt"
	"sort"
	"strings"
)

// FieldError is one problem in a configuration, located by file, line and key
// path (for example "tenants[0].allow[2].ports[0]").
type FieldError struct {
	Source string // file name as given to Parse; may be empty
	Line   int    // 1-based; 0 when unknown
	Path   string // key path; empty for the whole document
	Msg    string
}

// Error formats the problem as "source:line: path: message".
func (e *FieldError) Error() string {
	var b strings.Builder
	if e.Source != "" {
		b.WriteString(e.Source)
		b.WriteByte(':')
	}
	if e.Line > 0 {
		fmt.Fprintf(&b, "%d:", e.Line)
	}
	if b.Len() > 0 {
		b.WriteByte(' ')
	}
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Errors is every problem found in one configuration, one entry per problem,
// so that a user fixes a file in one round instead of one error at a time.
type Errors []*FieldError

// Error lists the problems one per line.
func (es Errors) Error() string {
	lines := make([]string, len(es))
	for i, e := range es {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}

// errList accumulates FieldErrors for one file.
type errList struct {
	source string
	lines  map[string]int
	errs   Errors
}

// add records a problem at path, with the line of the nearest enclosing key
// that has one (defaults have no line of their own).
func (l *errList) add(path, format string, args ...any) {
	l.errs = append(l.errs, &FieldError{Source: l.source, Line: l.lineOf(path), Path: path, Msg: fmt.Sprintf(format, args...)})
}

func (l *errList) addAt(line int, path, format string, args ...any) {
	l.errs = append(l.errs, &FieldError{Source: l.source, Line: line, Path: path, Msg: fmt.Sprintf(format, args...)})
}

func (l *errList) lineOf(path string) int {
	for p := path; p != ""; p = parentPath(p) {
		if n, ok := l.lines[p]; ok {
			return n
		}
	}
	return 0
}

// parentPath strips the last ".key" or "[i]" from a key path.
func parentPath(p string) string {
	i := strings.LastIndexAny(p, ".[")
	if i < 0 {
		return ""
	}
	return p[:i]
}

// err returns the collected problems sorted by line, or nil. It never returns
// a typed nil.
func (l *errList) err() error {
	if len(l.errs) == 0 {
		return nil
	}
	sort.SliceStable(l.errs, func(i, j int) bool { return l.errs[i].Line < l.errs[j].Line })
	return l.errs
}
