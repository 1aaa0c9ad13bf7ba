package broker

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sluicehq/sluice/rules"
)

func TestFileSourceRefusals(t *testing.T) {
	const secret = "0123-leaky-value"
	cases := []struct {
		name, content string
		mode          os.FileMode
		key           string
		wantErr       string
	}{
		{"group readable", "k: " + secret, 0o640, "k", "mode 0640"},
		{"world readable", "k: " + secret, 0o604, "k", "mode 0604"},
		{"syntax error", "k: \"" + secret + "\n  - [", 0o600, "k", "not valid YAML"},
		{"number", "k: 0123\n", 0o600, "k", "must be a string"},
		{"list", "k: [" + secret + "]\n", 0o600, "k", "must be a string"},
		{"not a mapping", "- " + secret + "\n", 0o600, "k", "want a mapping"},
		{"duplicate", "k: a\nk: b\n", 0o600, "k", "duplicate"},
		{"missing key", "k: " + secret + "\n", 0o600, "other", `no key "other"`},
		{"empty value", "k: \"\"\n", 0o600, "k", "empty"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "s.yaml")
			if err := os.WriteFile(path, []byte(c.content), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, c.mode); err != nil {
				t.Fatal(err)
			}
			src, err := NewFileSource(path, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, err = src.Fetch(context.Background(), rules.SecretSpec{Name: c.key})
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Fatalf("err = %v, want %q", err, c.wantErr)
			}
			if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "0123") {
				t.Fatalf("error leaks the value: %v", err)
			}
		})
	}
}

func TestFileSourceJSONAndDirectory(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "s.json")
	if err := os.WriteFile(path, []byte(`{"api": "sk-json-1", "n": "x"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := NewFileSource(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	v, err := src.Fetch(context.Background(), rules.SecretSpec{Name: "api"})
	if err != nil || v.Reveal() != "sk-json-1" {
		t.Fatalf("Fetch = %v, %v", v, err)
	}
	dirSrc, _ := NewFileSource(dir, nil)
	if _, err := dirSrc.Fetch(context.Background(), rules.SecretSpec{Name: "api"}); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("directory: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := src.Fetch(ctx, rules.SecretSpec{Name: "api"}); err == nil {
		t.Fatal("cancelled context ignored")
	}
}
