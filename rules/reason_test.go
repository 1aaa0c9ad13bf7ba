package rules

import (
	"regexp"
	"testing"
)

func TestReasons(t *testing.T) {
	seen := map[Reason]bool{}
	code := regexp.MustCompile(`^[a-z][a-z_]*[a-z]$`)
	for _, r := range AllReasons() {
		if seen[r] {
			t.Errorf("duplicate reason %q", r)
		}
		seen[r] = true
		if !code.MatchString(string(r)) || !r.Valid() {
			t.Errorf("reason %q is not a snake_case code", r)
		}
	}
	for _, r := range []Reason{
		"allowed", "denied_by_rule", "not_allowlisted", "unknown_tenant", "ambiguous_path", "invalid_host",
		"auth_required", "auth_invalid", "auth_expired", "auth_throttled", "bad_request", "host_mismatch",
		"destination_not_permitted", "sni_mismatch", "sni_missing", "upstream_error", "upstream_timeout",
		"rate_limited", "tunnel_limit", "secret_unavailable", "exfiltration_attempt",
		"interception_unavailable", "audit_unavailable", "shutting_down", "injection_requires_tls",
	} {
		if !seen[r] {
			t.Errorf("reason %q missing from AllReasons", r)
		}
	}
	if Reason("made_up").Valid() || Reason("").Valid() {
		t.Error("unknown reason reported valid")
	}
}
