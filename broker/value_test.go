package broker

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

func TestValueNeverPrints(t *testing.T) {
	const secret = "hunter2-super-secret"
	v := NewValue([]byte(secret))
	type exported struct{ V Value }
	type unexported struct{ v Value }
	var outs []string
	for _, verb := range []string{"%s", "%v", "%+v", "%#v", "%x", "%X", "%q", "%d", "%T %v", "%10s", "%-8q"} {
		outs = append(outs,
			fmt.Sprintf(verb, v), fmt.Sprintf(verb, &v),
			fmt.Sprintf(verb, exported{v}), fmt.Sprintf(verb, unexported{v}),
			fmt.Sprintf(verb, []Value{v}), fmt.Sprintf(verb, map[string]Value{"k": v}),
			fmt.Sprintf(verb, Rendered{Value: v, Secrets: []string{"n"}, values: []Value{v}}),
		)
	}
	j, err := json.Marshal(map[string]any{"a": v, "b": exported{v}, "c": []Value{v}})
	if err != nil {
		t.Fatal(err)
	}
	outs = append(outs, string(j), fmt.Sprint(fmt.Errorf("wrap %v", v)))
	var logs bytes.Buffer
	for _, h := range []slog.Handler{slog.NewTextHandler(&logs, nil), slog.NewJSONHandler(&logs, nil)} {
		l := slog.New(h)
		l.Info("x", "v", v, "p", &v, "s", exported{v}, "u", unexported{v}, "r", Rendered{Value: v})
		l.Info("y", slog.Any("v", v), slog.Group("g", "v", v))
	}
	outs = append(outs, logs.String())
	for _, o := range outs {
		if strings.Contains(o, secret) || strings.Contains(o, fmt.Sprintf("%x", secret)) {
			t.Fatalf("secret leaked: %s", o)
		}
	}
	if !strings.Contains(logs.String(), Redacted) {
		t.Fatal("logs do not show the redaction marker")
	}
	if v.Reveal() != secret || string(v.Bytes()) != secret || v.Len() != len(secret) {
		t.Fatal("Reveal/Bytes/Len do not return the secret")
	}
	b := v.Bytes()
	b[0] = 'X'
	if v.Reveal() != secret {
		t.Fatal("Bytes returned the internal buffer")
	}
	if !(Value{}).IsZero() || v.IsZero() {
		t.Fatal("IsZero")
	}
}

func TestSanitizeErr(t *testing.T) {
	inner := fmt.Errorf("upstream said: token hvs.ABC rejected")
	err := sanitizeErr(fmt.Errorf("login: %w", inner), "hvs.ABC", "")
	if strings.Contains(err.Error(), "hvs.ABC") || !strings.Contains(err.Error(), Redacted) {
		t.Fatalf("not sanitised: %v", err)
	}
	if errors.Unwrap(err) != nil {
		t.Fatal("sanitised error still wraps the original")
	}
	clean := fmt.Errorf("read: %w", inner)
	if sanitizeErr(clean, "other") != clean || sanitizeErr(nil, "x") != nil {
		t.Fatal("clean errors must pass unchanged")
	}
}
