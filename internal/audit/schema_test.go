package audit

import (
	"context"
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// jsonSchema is the part of docs/audit-schema.json this check understands:
// required fields, per-kind required fields (allOf if/then), property types,
// enums, consts, patterns and additionalProperties: false.
type jsonSchema struct {
	Required   []string              `json:"required"`
	Properties map[string]schemaProp `json:"properties"`
	AllOf      []struct {
		If struct {
			Properties struct {
				Kind struct {
					Const string `json:"const"`
				} `json:"kind"`
			} `json:"properties"`
		} `json:"if"`
		Then struct {
			Required []string `json:"required"`
		} `json:"then"`
	} `json:"allOf"`
	AdditionalProperties *bool `json:"additionalProperties"`
}

type schemaProp struct {
	Type       string                `json:"type"`
	Enum       []any                 `json:"enum"`
	Const      any                   `json:"const"`
	Pattern    string                `json:"pattern"`
	Properties map[string]schemaProp `json:"properties"`
}

func TestRecordsConformToSchema(t *testing.T) {
	data, err := os.ReadFile("../../docs/audit-schema.json")
	if err != nil {
		t.Fatal(err)
	}
	var s jsonSchema
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatal(err)
	}
	if s.AdditionalProperties == nil || *s.AdditionalProperties {
		t.Fatal("schema must forbid additional properties")
	}
	// Every Record field is in the schema.
	rt := reflect.TypeFor[Record]()
	for i := range rt.NumField() {
		k, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
		if _, ok := s.Properties[k]; !ok {
			t.Errorf("schema lacks property %q", k)
		}
	}

	_, files := writeFixture(t, t.TempDir())
	var lines [][]byte
	kinds := map[string]bool{}
	Scan(context.Background(), files, func(r *Record, _ Location) error {
		lines = append(lines, AppendJSON(nil, r))
		kinds[string(r.Kind)] = true
		return nil
	})
	gap, _ := appendLine(nil, 9, "", appendBody(nil, gapRecord(time.Now(), 3, FailClosed)))
	lines = append(lines, gap)
	kinds["audit_gap"] = true
	if len(kinds) != 8 {
		t.Fatalf("fixture covers kinds %v, want all 8", kinds)
	}
	for _, line := range lines {
		var m map[string]any
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatal(err)
		}
		for _, k := range s.Required {
			if _, ok := m[k]; !ok {
				t.Errorf("%s: missing required %q", line, k)
			}
		}
		for _, a := range s.AllOf {
			if m["kind"] == a.If.Properties.Kind.Const {
				for _, k := range a.Then.Required {
					if _, ok := m[k]; !ok {
						t.Errorf("%s: kind %s needs %q", line, m["kind"], k)
					}
				}
			}
		}
		checkProps(t, string(line), s.Properties, m)
	}
}

func checkProps(t *testing.T, line string, props map[string]schemaProp, m map[string]any) {
	for k, v := range m {
		p, ok := props[k]
		if !ok {
			t.Errorf("%s: property %q not in schema", line, k)
			continue
		}
		switch p.Type {
		case "string":
			s, ok := v.(string)
			if !ok {
				t.Errorf("%s: %q is not a string", line, k)
			} else if p.Pattern != "" && !regexp.MustCompile(p.Pattern).MatchString(s) {
				t.Errorf("%s: %q does not match %s", line, k, p.Pattern)
			}
		case "integer":
			if f, ok := v.(float64); !ok || f != float64(int64(f)) {
				t.Errorf("%s: %q is not an integer", line, k)
			}
		case "number":
			if _, ok := v.(float64); !ok {
				t.Errorf("%s: %q is not a number", line, k)
			}
		case "boolean":
			if _, ok := v.(bool); !ok {
				t.Errorf("%s: %q is not a boolean", line, k)
			}
		case "array":
			if _, ok := v.([]any); !ok {
				t.Errorf("%s: %q is not an array", line, k)
			}
		case "object":
			o, ok := v.(map[string]any)
			if !ok {
				t.Errorf("%s: %q is not an object", line, k)
			} else {
				checkProps(t, line, p.Properties, o)
			}
		}
		if p.Enum != nil && !slices.Contains(p.Enum, v) {
			t.Errorf("%s: %q = %v not in %v", line, k, v, p.Enum)
		}
		if p.Const != nil && p.Const != v {
			t.Errorf("%s: %q = %v, want %v", line, k, v, p.Const)
		}
	}
}
