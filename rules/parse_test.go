package rules

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"
)

// parseErrs parses doc and returns its problems; it fails the test if the
// document parses.
func parseErrs(t *testing.T, doc string) Errors {
	t.Helper()
	cfg, err := Parse([]byte(doc), "t.yaml")
	if err == nil {
		t.Fatalf("Parse succeeded (%+v); want errors for:\n%s", cfg, doc)
	}
	var es Errors
	if !errors.As(err, &es) {
		t.Fatalf("Parse error %T (%v); want Errors", err, err)
	}
	return es
}

// hasErr reports whether some problem is at line (0: any) and path with msg in its message.
func hasErr(es Errors, line int, path, msg string) bool {
	for _, e := range es {
		if (line == 0 || e.Line == line) && e.Path == path && strings.Contains(e.Msg, msg) {
			return true
		}
	}
	return false
}

func TestParseQuickstart(t *testing.T) {
	data, err := os.ReadFile("../examples/quickstart/sluice.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := Parse(data, "sluice.yaml")
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	if cfg.Version != 1 || cfg.Server.Listen != "127.0.0.1:3128" {
		t.Errorf("version/listen = %d/%q", cfg.Version, cfg.Server.Listen)
	}
	if got := cfg.Server.ReadHeaderTimeout.Std(); got != 10*time.Second {
		t.Errorf("read_header_timeout = %v", got)
	}
	if cfg.Server.MaxHeaderBytes != 64<<10 {
		t.Errorf("max_header_bytes = %d", cfg.Server.MaxHeaderBytes)
	}
	if l := cfg.Tenants[0].Limits; l == nil || l.EgressBytesPerSecond != 5_000_000 || l.RequestsPerSecond != 20 {
		t.Errorf("limits = %+v", l)
	}
	if got := cfg.Tenants[0].Allow[0].Inject[0].Value; got != "Bearer ${secret:github}" {
		t.Errorf("inject value = %q", got)
	}
	if cfg.source != "sluice.yaml" || cfg.lines["tenants[0].allow[0].host"] == 0 {
		t.Errorf("line map not kept: source %q, host line %d", cfg.source, cfg.lines["tenants[0].allow[0].host"])
	}
}

func TestParseLineMap(t *testing.T) {
	doc := "version: 1\n" + // 1
		"tenants:\n" + // 2
		"  - id: a\n" + // 3
		"    allow:\n" + // 4
		"      - host: x.example\n" + // 5
		"      - host: y.example\n" + // 6
		"        ports:\n" + // 7
		"          - 80\n" + // 8
		"          - 8080\n" // 9
	cfg, err := Parse([]byte(doc), "t.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for path, line := range map[string]int{
		"version": 1, "tenants": 2, "tenants[0]": 3, "tenants[0].id": 3, "tenants[0].allow": 4,
		"tenants[0].allow[1]": 6, "tenants[0].allow[1].ports": 7, "tenants[0].allow[1].ports[1]": 9,
	} {
		if got := cfg.lines[path]; got != line {
			t.Errorf("line of %s = %d; want %d", path, got, line)
		}
	}
}

func TestParseErrors(t *testing.T) {
	const v1 = "version: 1\n"
	tests := []struct {
		name string
		doc  string
		line int
		path string
		msg  string
	}{
		{"empty file", "", 0, "", "empty configuration"},
		{"only comments", "# nothing\n", 0, "", "empty configuration"},
		{"explicit null", "~\n", 1, "", "empty configuration"},
		{"top-level list", "- version: 1\n", 1, "", "top level must be a mapping"},
		{"top-level scalar", "hello\n", 1, "", "top level must be a mapping"},
		{"two documents", v1 + "---\n" + v1, 2, "", "more than one YAML document"},
		{"bad yaml", "version: 1\ntenants: [\n", 0, "", "invalid YAML"},
		{"version missing", "tenants: []\n", 1, "version", "required"},
		{"version 2", "version: 2\n", 1, "version", "unsupported version 2"},
		{"version null", "version:\n", 1, "version", "required"},
		{"version string", "version: \"1\"\n", 1, "version", "want integer"},
		{"unknown top key", v1 + "tennants: []\n", 2, "tennants", "unknown key"},
		{"unknown nested key", v1 + "tenants:\n  - id: a\n    allow:\n      - hots: x\n", 5, "tenants[0].allow[0].hots", "unknown key"},
		{"unknown server key", v1 + "server:\n  listn: x\n", 3, "server.listn", "unknown key"},
		{"port as string", v1 + "tenants:\n  - id: a\n    allow:\n      - host: x\n        ports: [443, https]\n", 6, "tenants[0].allow[0].ports[1]", `want integer, got "https"`},
		{"port quoted number", v1 + "tenants:\n  - id: a\n    allow:\n      - host: x\n        ports: [\"443\"]\n", 6, "tenants[0].allow[0].ports[0]", `want integer, got "443"`},
		{"port float", v1 + "tenants:\n  - id: a\n    allow:\n      - host: x\n        ports: [44.3]\n", 6, "tenants[0].allow[0].ports[0]", "want integer"},
		{"ports scalar", v1 + "tenants:\n  - id: a\n    allow:\n      - host: x\n        ports: 443\n", 6, "tenants[0].allow[0].ports", "want a list"},
		{"huge int", v1 + "limits:\n  max_connections: 99999999999999999999\n", 3, "limits.max_connections", ""},
		{"bool as string", v1 + "tenants:\n  - id: a\n    allow:\n      - host: x\n        inspect: \"true\"\n", 6, "tenants[0].allow[0].inspect", "want true or false"},
		{"bool as yes", v1 + "audit:\n  compress: yes\n", 3, "audit.compress", "want true or false"},
		{"bool as 1", v1 + "audit:\n  compress: 1\n", 3, "audit.compress", "want true or false"},
		{"float as string", v1 + "tenants:\n  - id: a\n    limits:\n      requests_per_second: \"20\"\n", 5, "tenants[0].limits.requests_per_second", "want a number"},
		{"float nan", v1 + "tenants:\n  - id: a\n    limits:\n      requests_per_second: .nan\n", 5, "tenants[0].limits.requests_per_second", "finite"},
		{"float inf", v1 + "tenants:\n  - id: a\n    limits:\n      requests_per_second: .inf\n", 5, "tenants[0].limits.requests_per_second", "finite"},
		{"int as float", v1 + "tenants:\n  - id: a\n    limits:\n      burst: 1.5\n", 5, "tenants[0].limits.burst", "want integer"},
		{"string as int", v1 + "tenants:\n  - id: 42\n", 3, "tenants[0].id", "want a string"},
		{"string as timestamp", v1 + "secrets:\n  - name: 2024-01-01\n", 3, "secrets[0].name", "want a string"},
		{"string as list", v1 + "tenants:\n  - id: [a]\n", 3, "tenants[0].id", "want a string, got a list"},
		{"struct as scalar", v1 + "server: 127.0.0.1:3128\n", 2, "server", "want a mapping"},
		{"list as mapping", v1 + "tenants:\n  id: a\n", 3, "tenants", "want a list"},
		{"duration integer", v1 + "server:\n  idle_timeout: 30\n", 3, "server.idle_timeout", "want a duration string"},
		{"duration no unit", v1 + "server:\n  idle_timeout: \"30\"\n", 3, "server.idle_timeout", "want a duration"},
		{"duration garbage", v1 + "server:\n  idle_timeout: soon\n", 3, "server.idle_timeout", "want a duration"},
		{"duration negative", v1 + "server:\n  idle_timeout: -5s\n", 3, "server.idle_timeout", "negative"},
		{"size negative int", v1 + "server:\n  max_header_bytes: -1\n", 3, "server.max_header_bytes", "negative"},
		{"size negative string", v1 + "server:\n  max_header_bytes: -5MB\n", 3, "server.max_header_bytes", "negative"},
		{"size garbage", v1 + "server:\n  max_header_bytes: lots\n", 3, "server.max_header_bytes", "want a size"},
		{"size lower-case unit", v1 + "server:\n  max_header_bytes: 5mb\n", 3, "server.max_header_bytes", "want a size"},
		{"size bits", v1 + "server:\n  max_header_bytes: 5Mb\n", 3, "server.max_header_bytes", "want a size"},
		{"size fraction", v1 + "server:\n  max_header_bytes: 1.5MB\n", 3, "server.max_header_bytes", "want a size"},
		{"size overflow", v1 + "server:\n  max_header_bytes: 99999999TiB\n", 3, "server.max_header_bytes", "too large"},
		{"size bool", v1 + "server:\n  max_header_bytes: true\n", 3, "server.max_header_bytes", "want a size"},
		{"duplicate top key", v1 + "server:\n  listen: a\nserver:\n  listen: b\n", 4, "server", "duplicate key (first defined on line 2)"},
		{"duplicate nested key", v1 + "tenants:\n  - id: a\n    id: b\n", 4, "tenants[0].id", "duplicate key"},
		{"duplicate version", v1 + v1, 2, "version", "duplicate key"},
		{"merge key", v1 + "base: &b {listen: x}\n", 2, "base", "unknown key"},
		{"merge key use", v1 + "server:\n  <<: {listen: x}\n", 3, "server", "merge keys"},
		{"custom tag", v1 + "server:\n  listen: !env PROXY\n", 3, "server.listen", "unsupported YAML tag"},
		{"non-string key", v1 + "server:\n  [a]: x\n", 3, "server", "keys must be plain strings"},
		{"integer key", v1 + "server:\n  80: x\n", 3, `server."80"`, "invalid key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			es := parseErrs(t, tt.doc)
			if !hasErr(es, tt.line, tt.path, tt.msg) {
				t.Errorf("want an error at line %d, path %q, containing %q; got:\n%v", tt.line, tt.path, tt.msg, es)
			}
			for _, e := range es {
				if want := "t.yaml:"; !strings.HasPrefix(e.Error(), want) {
					t.Errorf("error %q does not start with %q", e.Error(), want)
				}
			}
		})
	}
}

// Viper folds key case and splits keys on dots. Host and header names are
// values, so any key viper would reshape is an error, never a silent rewrite.
func TestParseViperTraps(t *testing.T) {
	const v1 = "version: 1\n"
	tests := []struct {
		name string
		doc  string
		line int
		path string
	}{
		{"upper-case section", v1 + "Server:\n  listen: x\n", 2, `"Server"`},
		{"upper-case key", v1 + "server:\n  Listen: x\n", 3, `server."Listen"`},
		{"case duplicate", v1 + "tenants: []\nTenants: []\n", 3, `"Tenants"`},
		{"dotted key", v1 + "server.listen: x\n", 2, `"server.listen"`},
		{"host as rule key", v1 + "tenants:\n  - id: a\n    allow:\n      - api.github.com: {ports: [443]}\n", 5, `tenants[0].allow[0]."api.github.com"`},
		{"host as tenant key", v1 + "tenants:\n  - id: a\n    api.github.com:\n      ports: [443]\n", 4, `tenants[0]."api.github.com"`},
		{"header as key", v1 + "tenants:\n  - id: a\n    allow:\n      - host: x\n        inject:\n          - Authorization: Bearer\n", 7, `tenants[0].allow[0].inject[0]."Authorization"`},
		{"hyphenated key", v1 + "server:\n  read-header-timeout: 5s\n", 3, `server."read-header-timeout"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			es := parseErrs(t, tt.doc)
			if !hasErr(es, tt.line, tt.path, "invalid key") {
				t.Errorf("want an invalid-key error at line %d, path %s; got:\n%v", tt.line, tt.path, es)
			}
		})
	}
	// Map-shaped allowlists (host names as keys) are refused by type, too.
	es := parseErrs(t, v1+"tenants:\n  - id: a\n    allow:\n      api.github.com: {ports: [443]}\n")
	if !hasErr(es, 5, "tenants[0].allow", "want a list") {
		t.Errorf("map-shaped allow: got %v", es)
	}
}

// This is the trap the YAML walk exists for: viper alone accepts these
// documents and reshapes them without a word.
func TestViperAloneReshapesKeys(t *testing.T) {
	var cfg Config
	if err := decodeViper([]byte("version: 1\nSERVER:\n  Listen: a\n"), &cfg); err != nil || cfg.Server.Listen != "a" {
		t.Fatalf("viper case folding: err %v, listen %q (if viper now refuses this, the walk is merely redundant)", err, cfg.Server.Listen)
	}
	cfg = Config{}
	if err := decodeViper([]byte("version: 1\nserver.listen: b\n"), &cfg); err != nil || cfg.Server.Listen != "b" {
		t.Fatalf("viper dot splitting: err %v, listen %q", err, cfg.Server.Listen)
	}
}

func TestParseCollectsAllErrors(t *testing.T) {
	doc := "version: 1\n" + // 1
		"server:\n" + // 2
		"  idle_timeout: 30\n" + // 3
		"  bogus: 1\n" + // 4
		"tenants:\n" + // 5
		"  - id: a\n" + // 6
		"    allow:\n" + // 7
		"      - host: x\n" + // 8
		"        ports: [http]\n" + // 9
		"        Methods: [GET]\n" // 10
	es := parseErrs(t, doc)
	if len(es) != 4 {
		t.Fatalf("got %d errors; want 4:\n%v", len(es), es)
	}
	for i, line := range []int{3, 4, 9, 10} {
		if es[i].Line != line {
			t.Errorf("error %d at line %d; want %d (sorted by line)", i, es[i].Line, line)
		}
	}
	if !strings.Contains(es.Error(), "t.yaml:9: tenants[0].allow[0].ports[0]: want integer, got \"http\"") {
		t.Errorf("formatted errors:\n%s", es.Error())
	}
}

func TestParseNeverEchoesSensitiveValues(t *testing.T) {
	doc := "version: 1\ntenants:\n  - id: a\n    credentials:\n      - name: c\n        hash: 1234567890123\n" +
		"    allow:\n      - host: x\n        inject:\n          - header: X-Key\n            value: 98765432109876\n"
	es := parseErrs(t, doc)
	if len(es) != 2 {
		t.Fatalf("got %v; want 2 errors", es)
	}
	for _, secret := range []string{"1234567890123", "98765432109876"} {
		if strings.Contains(es.Error(), secret) {
			t.Errorf("error output echoes a sensitive value: %s", es.Error())
		}
	}
}

func TestParseAccepts(t *testing.T) {
	for name, doc := range map[string]string{
		"minimal":        "version: 1\n",
		"null sections":  "version: 1\nserver:\naudit: ~\ntenants:\n",
		"aliases":        "version: 1\ntenants:\n  - id: a\n    allow:\n      - host: x.example\n        ports: &p [443, 8443]\n      - host: y.example\n        ports: *p\n",
		"sizes":          "version: 1\nserver:\n  max_header_bytes: 1024\naudit:\n  rotate_size: 5 MB\n",
		"flow style":     "{version: 1, tenants: [{id: a, allow: [{host: x.example}]}]}\n",
		"int for float":  "version: 1\ntenants:\n  - id: a\n    limits: {requests_per_second: 20}\n",
		"hex version":    "version: 0x1\n",
		"comment trails": "version: 1 # the only version\n",
	} {
		if _, err := Parse([]byte(doc), name); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	cfg, err := Parse([]byte("version: 1\ntenants:\n  - id: a\n    allow:\n      - host: x.example\n        ports: &p [443, 8443]\n      - host: y.example\n        ports: *p\n"), "a")
	if err != nil || len(cfg.Tenants[0].Allow[1].Ports) != 2 {
		t.Errorf("alias not expanded: %v %+v", err, cfg)
	}
	cfg, err = Parse([]byte("version: 1\naudit:\n  rotate_size: 5 MB\n  rotate_age: 24h\n"), "a")
	if err != nil || cfg.Audit.RotateSize != 5_000_000 || cfg.Audit.RotateAge.Std() != 24*time.Hour {
		t.Errorf("units: %v %+v", err, cfg.Audit)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]Size{
		"0": 0, "1024": 1024, "64KiB": 64 << 10, "5MB": 5_000_000, "1GiB": 1 << 30, "2kB": 2000,
		"2KB": 2000, "3B": 3, "1TiB": 1 << 40, "1 GB": 1_000_000_000,
	} {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "-5MB", "5mb", "5Mb", "1.5MB", "5  MB", " 5MB", "MB", "5 ", "0x10", "1e3", "99999999999999999999", "9999999TiB", "+5"} {
		if got, err := ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) = %d; want an error", in, got)
		}
	}
}

// Aliases can make a small file name a huge tree (128^3 injections here);
// the walk must stop early instead of following every one.
func TestParseAliasBomb(t *testing.T) {
	inject := "[&j {header: A, value: \"${secret:s}\"}" + strings.Repeat(", *j", 127) + "]"
	allow := "[&r {host: a.example, inject: " + inject + "}" + strings.Repeat(", *r", 127) + "]"
	doc := "version: 1\n" +
		"secrets:\n  - {name: s, source: file, hosts: [a.example]}\n" +
		"tenants: [&a {id: a, allow: " + allow + "}" + strings.Repeat(", *a", 127) + "]\n"
	_, err := Parse([]byte(doc), "bomb.yaml")
	if err == nil || !strings.Contains(err.Error(), "too heavily aliased") {
		t.Fatalf("alias bomb: %v", err)
	}
}

func TestParseStopsAfterManyErrors(t *testing.T) {
	doc := "version: 1\ntenants:\n" + strings.Repeat("  - id: 1\n", 1000)
	es := parseErrs(t, doc)
	if len(es) > maxErrors+1 || !strings.Contains(es.Error(), "too many errors") {
		t.Errorf("%d errors", len(es))
	}
}

// The viper decoder is strict on its own too, for Configs that reach it
// by another route.
func TestDecodeViperStrict(t *testing.T) {
	for name, doc := range map[string]string{
		"weak string":    "version: 1\nserver:\n  listen: 5\n",
		"weak int":       "version: \"1\"\n",
		"weak bool":      "version: 1\naudit:\n  compress: \"true\"\n",
		"unused key":     "version: 1\nbogus: 1\n",
		"nested unused":  "version: 1\nserver:\n  bogus: 1\n",
		"duration int":   "version: 1\nserver:\n  idle_timeout: 30\n",
		"duration neg":   "version: 1\nserver:\n  idle_timeout: -1s\n",
		"size negative":  "version: 1\nserver:\n  max_header_bytes: -1\n",
		"size garbage":   "version: 1\nserver:\n  max_header_bytes: lots\n",
		"duplicate keys": "version: 1\nversion: 1\n",
	} {
		var cfg Config
		if err := decodeViper([]byte(doc), &cfg); err == nil {
			t.Errorf("%s: viper decode accepted it", name)
		}
	}
}
