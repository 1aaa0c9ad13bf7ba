package rules

// Reason is a machine-readable code for a decision. Every package that denies
// or records a request uses these constants, so the audit log, metrics and the
// denial header the sandbox sees share one bounded vocabulary.
type Reason string

const (
	// ReasonAllowed: an allow rule matched and no deny rule did.
	ReasonAllowed Reason = "allowed"
	// ReasonDeniedByRule: an explicit deny rule matched (deny beats allow).
	ReasonDeniedByRule Reason = "denied_by_rule"
	// ReasonNotAllowlisted: no rule of the tenant matched; the default is deny.
	ReasonNotAllowlisted Reason = "not_allowlisted"
	// ReasonUnknownTenant: the principal's tenant is not in the current policy.
	ReasonUnknownTenant Reason = "unknown_tenant"
	// ReasonAmbiguousPath: the request path could not be normalised safely
	// (encoded slash, backslash, NUL, "//", invalid escape; see NormalizePath).
	ReasonAmbiguousPath Reason = "ambiguous_path"
	// ReasonInvalidHost: the destination host could not be normalised
	// (see NormalizeHost), or was empty.
	ReasonInvalidHost Reason = "invalid_host"

	// ReasonAuthRequired: no proxy credential was presented (407).
	ReasonAuthRequired Reason = "auth_required"
	// ReasonAuthInvalid: the credential is unknown, malformed or revoked.
	ReasonAuthInvalid Reason = "auth_invalid"
	// ReasonAuthExpired: a minted sandbox token is past its expiry.
	ReasonAuthExpired Reason = "auth_expired"
	// ReasonAuthThrottled: too many authentication failures from this source.
	ReasonAuthThrottled Reason = "auth_throttled"
	// ReasonBadRequest: the request is malformed (duplicate Host, bad port,
	// unsupported scheme, oversized headers, ...).
	ReasonBadRequest Reason = "bad_request"
	// ReasonHostMismatch: an absolute-form URL names a different host than the
	// Host header, or a request inside a tunnel names a host or port other
	// than the CONNECT target.
	ReasonHostMismatch Reason = "host_mismatch"
	// ReasonDestinationNotPermitted: netguard refused the resolved address
	// (private, loopback, link-local, metadata, the proxy itself, ...).
	ReasonDestinationNotPermitted Reason = "destination_not_permitted"
	// ReasonSNIMismatch: a spliced tunnel's TLS ClientHello names a server
	// other than the CONNECT host.
	ReasonSNIMismatch Reason = "sni_mismatch"
	// ReasonSNIMissing: a spliced tunnel's ClientHello has no SNI (or is not TLS).
	ReasonSNIMissing Reason = "sni_missing"
	// ReasonUpstreamError: the upstream could not be reached or failed (DNS,
	// connect, TLS, protocol).
	ReasonUpstreamError Reason = "upstream_error"
	// ReasonUpstreamTimeout: the upstream did not answer in time.
	ReasonUpstreamTimeout Reason = "upstream_timeout"
	// ReasonRateLimited: a request, byte or connection rate limit was exceeded.
	ReasonRateLimited Reason = "rate_limited"
	// ReasonTunnelLimit: too many concurrent tunnels for the tenant or process.
	ReasonTunnelLimit Reason = "tunnel_limit"
	// ReasonConnectionLimit: the tenant already holds its maximum number of
	// client connections (limits.max_connections).
	ReasonConnectionLimit Reason = "connection_limit"
	// ReasonInjectionRequiresTLS: the rule injects a secret but the request
	// is cleartext HTTP and the rule does not set inject_over_http.
	ReasonInjectionRequiresTLS Reason = "injection_requires_tls"
	// ReasonSecretUnavailable: a secret the rule injects has no fresh value;
	// the request fails closed (503) rather than go out without it.
	ReasonSecretUnavailable Reason = "secret_unavailable"
	// ReasonExfiltrationAttempt: a secret's placeholder (or value) was sent
	// toward a host that secret may not be sent to.
	ReasonExfiltrationAttempt Reason = "exfiltration_attempt"
	// ReasonInterceptionUnavailable: the policy needs the tunnel intercepted but
	// no interception CA is loaded, so it is refused rather than spliced.
	ReasonInterceptionUnavailable Reason = "interception_unavailable"
	// ReasonAuditUnavailable: the audit log cannot be written and audit
	// on_failure is "closed".
	ReasonAuditUnavailable Reason = "audit_unavailable"
	// ReasonShuttingDown: the proxy is draining and accepts no new work.
	ReasonShuttingDown Reason = "shutting_down"
)

// AllReasons returns every reason code, for bounded metric label sets and
// for checking records. The slice is new on each call.
func AllReasons() []Reason {
	return []Reason{
		ReasonAllowed, ReasonDeniedByRule, ReasonNotAllowlisted, ReasonUnknownTenant,
		ReasonAmbiguousPath, ReasonInvalidHost, ReasonAuthRequired, ReasonAuthInvalid,
		ReasonAuthExpired, ReasonAuthThrottled, ReasonBadRequest, ReasonHostMismatch,
		ReasonDestinationNotPermitted, ReasonSNIMismatch, ReasonSNIMissing,
		ReasonUpstreamError, ReasonUpstreamTimeout, ReasonRateLimited, ReasonTunnelLimit, ReasonConnectionLimit,
		ReasonInjectionRequiresTLS, ReasonSecretUnavailable, ReasonExfiltrationAttempt, ReasonInterceptionUnavailable,
		ReasonAuditUnavailable, ReasonShuttingDown,
	}
}

// Valid reports whether r is one of the defined codes.
func (r Reason) Valid() bool {
	for _, x := range AllReasons() {
		if x == r {
			return true
		}
	}
	return false
}
