package rules

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/viper"
	"gopkg.in/yaml.v3"
)

// Parse decodes a configuration file strictly. source names the file in error
// messages. Every problem is reported (as Errors), each with its line and key
// path: unknown keys, wrong types, values that would need weak typing, bad
// durations and sizes, duplicate keys, and keys that viper would silently
// reshape (upper case is folded, dots split a key into a nested path).
//
// Decoding itself goes through viper with a strict mapstructure configuration;
// a walk over the same bytes as a yaml.Node checks the document against the
// schema first, because only the node tree knows lines and original key
// spellings. Parse does not validate meaning (hosts, ports, references):
// Compile does.
func Parse(data []byte, source string) (*Config, error) {
	el := &errList{source: source, lines: map[string]int{}}
	root, err := parseNode(data)
	if err != nil {
		var fe *FieldError
		if errors.As(err, &fe) {
			fe.Source = source
			return nil, Errors{fe}
		}
		return nil, Errors{{Source: source, Msg: err.Error()}}
	}
	w := walker{el: el}
	w.walk(root, reflect.TypeFor[Config](), "")
	checkVersion(root, el)
	if err := el.err(); err != nil {
		return nil, err
	}

	cfg := &Config{}
	if err := decodeViper(data, cfg); err != nil {
		// The walk accepts only what the decoder should accept; reaching here
		// means the two disagree, which must still fail closed.
		return nil, Errors{{Source: source, Msg: "decode: " + err.Error()}}
	}
	cfg.source = source
	cfg.lines = el.lines
	return cfg, nil
}

// parseNode reads exactly one YAML document and returns its top-level node.
func parseNode(data []byte) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, &FieldError{Msg: "empty configuration: want a mapping with version: 1"}
		}
		return nil, fmt.Errorf("invalid YAML: %s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		line := extra.Line
		if err != nil {
			line = 0
		}
		return nil, &FieldError{Line: line, Msg: "more than one YAML document; a config file holds exactly one"}
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 {
		return nil, &FieldError{Msg: "empty configuration: want a mapping with version: 1"}
	}
	root := doc.Content[0]
	if root.Kind == yaml.ScalarNode && root.Tag == "!!null" {
		return nil, &FieldError{Line: root.Line, Msg: "empty configuration: want a mapping with version: 1"}
	}
	if root.Kind != yaml.MappingNode {
		return nil, &FieldError{Line: root.Line, Msg: fmt.Sprintf("top level must be a mapping, got %s", nodeKind(root))}
	}
	return root, nil
}

func checkVersion(root *yaml.Node, el *errList) {
	for i := 0; i+1 < len(root.Content); i += 2 {
		if root.Content[i].Value == "version" {
			v := root.Content[i+1]
			if v.Tag == "!!int" && v.Value != "1" {
				var n int64
				if v.Decode(&n) == nil && n == 1 {
					return
				}
				el.addAt(v.Line, "version", "unsupported version %s; this sluice reads version 1", v.Value)
			}
			if v.Tag == "!!null" {
				el.addAt(v.Line, "version", "required: version: 1")
			}
			return
		}
	}
	el.addAt(root.Line, "version", "required: add \"version: 1\" at the top level")
}

func decodeViper(data []byte, cfg *Config) error {
	v := viper.New()
	v.SetConfigType("yaml")
	if err := v.ReadConfig(bytes.NewReader(data)); err != nil {
		return err
	}
	return v.Unmarshal(cfg, func(dc *mapstructure.DecoderConfig) {
		dc.ErrorUnused = true
		dc.WeaklyTypedInput = false
		dc.ZeroFields = true
		dc.DecodeHook = decodeUnits
	})
}

// schemaKey is the only shape a key may have. Anything else is either not in
// the schema or would be reshaped by viper (case folding, dot splitting).
var schemaKey = regexp.MustCompile(`^[a-z][a-z0-9_]*$`)

// walker checks a YAML node tree against the Config type and records the line
// of every key path it visits.
type walker struct {
	el          *errList
	inAlias     int // depth of alias expansions being walked
	aliasVisits int
	stopped     bool
}

// Aliases let a small file name the same subtree over and over (the "billion
// laughs"), and the walk follows them, so nodes reached through an alias are
// counted and bounded. Nodes written out are visited once each.
const (
	maxAliasVisits = 100_000
	maxErrors      = 200
)

func (w *walker) walk(n *yaml.Node, t reflect.Type, path string) {
	if w.stopped {
		return
	}
	if len(w.el.errs) >= maxErrors {
		w.stopped = true
		w.el.addAt(n.Line, path, "too many errors; stopping here")
		return
	}
	if n.Kind == yaml.AliasNode {
		n = n.Alias
		w.inAlias++
		defer func() { w.inAlias-- }()
	}
	if w.inAlias > 0 {
		if w.aliasVisits++; w.aliasVisits > maxAliasVisits {
			w.stopped = true
			w.el.addAt(n.Line, path, "document too heavily aliased (more than %d nodes reached through aliases)", maxAliasVisits)
			return
		}
	}
	if path != "" {
		if _, seen := w.el.lines[path]; !seen {
			w.el.lines[path] = n.Line
		}
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // unset: the zero value, which Compile defaults or rejects
	}
	if n.Tag != "" && !strings.HasPrefix(n.Tag, "!!") {
		w.el.addAt(n.Line, path, "unsupported YAML tag %s", n.Tag)
		return
	}
	switch t {
	case durationType:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!str" {
			w.el.addAt(n.Line, path, "want a duration string such as \"30s\", got %s", describe(n, false))
			return
		}
		if _, err := ParseDuration(n.Value); err != nil {
			w.el.addAt(n.Line, path, "%s", err.Error())
		}
		return
	case sizeType:
		if n.Kind == yaml.ScalarNode && n.Tag == "!!int" {
			var v int64
			if err := n.Decode(&v); err != nil {
				w.el.addAt(n.Line, path, "size %s is out of range", n.Value)
			} else if v < 0 {
				w.el.addAt(n.Line, path, "size must not be negative, got %s", n.Value)
			}
			return
		}
		if n.Kind != yaml.ScalarNode || n.Tag != "!!str" {
			w.el.addAt(n.Line, path, "want a size such as \"64KiB\" or an integer, got %s", describe(n, false))
			return
		}
		if _, err := ParseSize(n.Value); err != nil {
			w.el.addAt(n.Line, path, "%s", err.Error())
		}
		return
	}
	switch t.Kind() {
	case reflect.Pointer:
		w.walk(n, t.Elem(), path)
	case reflect.Struct:
		w.walkStruct(n, t, path)
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			w.el.addAt(n.Line, path, "want a list, got %s", describe(n, false))
			return
		}
		for i, c := range n.Content {
			w.walk(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i))
		}
	case reflect.String:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!str" {
			w.el.addAt(n.Line, path, "want a string, got %s (quote it if it is meant as text)", describe(n, w.sensitive(path)))
		}
	case reflect.Int:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!int" {
			w.el.addAt(n.Line, path, "want integer, got %s", describe(n, false))
			return
		}
		var v int64
		if err := n.Decode(&v); err != nil || v > math.MaxInt32 || v < math.MinInt32 {
			w.el.addAt(n.Line, path, "integer %s is out of range", n.Value)
		}
	case reflect.Float64:
		if n.Kind != yaml.ScalarNode || (n.Tag != "!!int" && n.Tag != "!!float") {
			w.el.addAt(n.Line, path, "want a number, got %s", describe(n, false))
			return
		}
		var v float64
		if err := n.Decode(&v); err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
			w.el.addAt(n.Line, path, "want a finite number, got %s", n.Value)
		}
	case reflect.Bool:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
			w.el.addAt(n.Line, path, "want true or false, got %s", describe(n, false))
		}
	default:
		w.el.addAt(n.Line, path, "internal: no schema rule for %s", t)
	}
}

func (w *walker) walkStruct(n *yaml.Node, t reflect.Type, path string) {
	if n.Kind != yaml.MappingNode {
		w.el.addAt(n.Line, path, "want a mapping, got %s", describe(n, false))
		return
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.AliasNode {
			k = k.Alias
		}
		if k.Kind != yaml.ScalarNode || k.Tag == "!!merge" {
			if k.Tag == "!!merge" {
				w.el.addAt(k.Line, path, "YAML merge keys (<<) are not supported; write the keys out")
			} else {
				w.el.addAt(k.Line, path, "keys must be plain strings, got %s", nodeKind(k))
			}
			continue
		}
		name := k.Value
		sub := name
		if path != "" {
			sub = path + "." + name
		}
		if first, dup := seen[name]; dup {
			w.el.addAt(k.Line, sub, "duplicate key (first defined on line %d)", first)
			continue
		}
		seen[name] = k.Line
		if k.Tag != "!!str" || !schemaKey.MatchString(name) {
			w.el.addAt(k.Line, joinPath(path, fmt.Sprintf("%q", name)),
				"invalid key %q: keys are lower-case schema names (viper would fold case and split on dots); host and header names belong in values, e.g. host: api.example.com", name)
			continue
		}
		f, ok := fieldByKey(t, name)
		if !ok {
			w.el.addAt(k.Line, sub, "unknown key %q (valid keys here: %s)", name, strings.Join(keysOf(t), ", "))
			continue
		}
		w.el.lines[sub] = k.Line
		w.walk(v, f.Type, sub)
	}
}

func (w *walker) sensitive(path string) bool {
	// Only the leaf key matters; both sensitive fields are strings in lists.
	last := path[strings.LastIndexByte(path, '.')+1:]
	return last == "hash" || last == "value"
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func fieldByKey(t reflect.Type, key string) (reflect.StructField, bool) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.IsExported() && f.Tag.Get("mapstructure") == key {
			return f, true
		}
	}
	return reflect.StructField{}, false
}

func keysOf(t reflect.Type) []string {
	var ks []string
	for i := 0; i < t.NumField(); i++ {
		if f := t.Field(i); f.IsExported() {
			ks = append(ks, f.Tag.Get("mapstructure"))
		}
	}
	return ks
}

func nodeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return "a scalar"
	default:
		return "an unexpected node"
	}
}

// describe names what the document holds at n, for type errors. A value in a
// sensitive field is never echoed (it may be a pasted credential).
func describe(n *yaml.Node, sensitive bool) string {
	if n.Kind != yaml.ScalarNode {
		return nodeKind(n)
	}
	kind := map[string]string{
		"!!str": "string", "!!int": "integer", "!!float": "number", "!!bool": "boolean",
		"!!timestamp": "timestamp", "!!binary": "binary",
	}[n.Tag]
	if kind == "" {
		kind = n.Tag
	}
	if sensitive {
		return kind + " (value not shown)"
	}
	v := n.Value
	if len(v) > 64 {
		v = v[:64] + "..."
	}
	if n.Tag == "!!str" {
		return strconv.Quote(v)
	}
	return kind + " " + v
}
