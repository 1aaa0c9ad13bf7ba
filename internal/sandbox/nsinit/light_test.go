package nsinit

import (
	"os/exec"
	"strings"
	"testing"
)

// TestStaysLight guards the point of this package: its init function runs
// the sandbox's init before the rest of the binary is initialised, which
// only saves anything while the package itself depends on little. Each
// package listed here either initialises late (sorted after the packages
// the heavy ones need) or is heavy itself.
func TestStaysLight(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Skipf("go list unavailable: %v", err)
	}
	forbidden := []string{"net", "net/http", "path/filepath", "log/slog", "os/exec", "os/user", "crypto/tls", "crypto/rand"}
	deps := strings.Fields(string(out))
	for _, d := range deps {
		for _, f := range forbidden {
			if d == f {
				t.Errorf("nsinit depends on %s, which would delay the sandbox init's start-up", d)
			}
		}
		if (strings.HasPrefix(d, "github.com/") && !strings.HasPrefix(d, "github.com/sluicehq/sluice/internal/sandbox/nsinit")) ||
			strings.HasPrefix(d, "google.golang.org/") {
			t.Errorf("nsinit depends on %s", d)
		}
	}
	if len(deps) < 5 {
		t.Fatalf("go list returned too little to check: %q", out)
	}
}
