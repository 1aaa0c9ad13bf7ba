package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/rules"
)

// maxConfigBytes bounds what `rules check|test` read: a config is small, and
// a path to a device or a huge file should fail rather than exhaust memory.
const maxConfigBytes = 16 << 20

func newRulesCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rules",
		Short: "Check policy files and test requests against them",
	}
	cmd.AddCommand(newRulesCheckCmd(), newRulesTestCmd(), newRulesSuggestCmd())
	return cmd
}

func newRulesCheckCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "check FILE...",
		Short: "Parse and compile config files; exit 2 if any is invalid",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			out, errOut := cmd.OutOrStdout(), cmd.ErrOrStderr()
			bad := false
			for _, file := range args {
				pol, err := loadPolicy(file)
				if err != nil {
					bad = true
					fmt.Fprintln(errOut, describeConfigError(file, err))
					continue
				}
				fmt.Fprintf(out, "%s: ok (%d tenants, %d rules, %d secrets)\n",
					file, len(pol.Tenants()), pol.RuleCount(), len(pol.Secrets()))
			}
			if bad {
				return &exitError{code: 2}
			}
			return nil
		},
	}
}

func newRulesTestCmd() *cobra.Command {
	var configPath, tenant string
	cmd := &cobra.Command{
		Use:   "test --config FILE --tenant T METHOD URL",
		Short: "Decide one request the way the proxy would; exit 0 if allowed, 3 if denied",
		Long: `Decide one request the way the proxy would: normalise the URL's host and
path, consult the tenant's policy, and say whether a CONNECT to the URL's
host:port would be denied, spliced or intercepted. For an https URL the
proxy sees the CONNECT first and, when it intercepts, the request inside.
METHOD CONNECT takes host:port instead of a URL.

Exit status: 0 allowed (including report mode's would-deny), 3 denied,
2 invalid config.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			pol, err := loadPolicy(configPath)
			if err != nil {
				fmt.Fprintln(cmd.ErrOrStderr(), describeConfigError(configPath, err))
				return &exitError{code: 2}
			}
			allowed := runRulesTest(cmd.OutOrStdout(), pol, tenant, args[0], args[1])
			if !allowed {
				return &exitError{code: 3}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&configPath, "config", "", "config file (required)")
	cmd.Flags().StringVar(&tenant, "tenant", "", "tenant id (required)")
	_ = cmd.MarkFlagRequired("config")
	_ = cmd.MarkFlagRequired("tenant")
	return cmd
}

// loadPolicy reads, parses and compiles one config file.
func loadPolicy(path string) (*rules.Policy, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxConfigBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxConfigBytes {
		return nil, fmt.Errorf("larger than %d bytes", maxConfigBytes)
	}
	cfg, err := rules.Parse(data, path)
	if err != nil {
		return nil, err
	}
	return rules.Compile(cfg)
}

// describeConfigError formats every problem, one per line. Parse and Compile
// errors already start with "file:line:"; others get the file name.
func describeConfigError(file string, err error) string {
	var es rules.Errors
	if errors.As(err, &es) {
		return es.Error()
	}
	var pe *os.PathError
	if errors.As(err, &pe) {
		return fmt.Sprintf("%s: %v", file, pe.Err)
	}
	return fmt.Sprintf("%s: %v", file, err)
}

// runRulesTest prints the decision for one request and reports whether the
// proxy would let it through.
func runRulesTest(w io.Writer, pol *rules.Policy, tenant, method, rawURL string) bool {
	denyInput := func(reason rules.Reason, why string) bool {
		fmt.Fprintf(w, "decision: deny\nreason:   %s\nwhy:      %s\n", reason, why)
		return false
	}
	if !isMethodToken(method) {
		return denyInput(rules.ReasonBadRequest, fmt.Sprintf("invalid method %q", method))
	}
	mode := "-"
	if t, ok := pol.Tenant(tenant); ok {
		mode = "enforce"
		if t.Report {
			mode = "report"
		}
	}

	var scheme, authority, path string
	if method == "CONNECT" {
		scheme, authority = "https", rawURL
		if strings.Contains(rawURL, "/") {
			return denyInput(rules.ReasonBadRequest, "CONNECT takes host:port, not a URL")
		}
	} else {
		u, err := url.Parse(rawURL)
		if err != nil {
			return denyInput(rules.ReasonBadRequest, "unparsable URL")
		}
		scheme = strings.ToLower(u.Scheme)
		if scheme != "http" && scheme != "https" {
			return denyInput(rules.ReasonBadRequest, "the URL must be absolute http:// or https://")
		}
		if u.User != nil {
			return denyInput(rules.ReasonBadRequest, "userinfo in URL")
		}
		authority = u.Host
		if path, err = rules.NormalizePath(u.EscapedPath()); err != nil {
			return denyInput(rules.ReasonAmbiguousPath, err.Error())
		}
	}
	defPort := 80
	if scheme == "https" {
		defPort = 443
	}
	if method == "CONNECT" {
		defPort = 0 // the port is required
	}
	nh, isIP, port, err := rules.ParseAuthority(authority, defPort)
	if err != nil {
		return denyInput(rules.ReasonInvalidHost, err.Error())
	}

	fmt.Fprintf(w, "tenant:   %s (mode %s)\n", tenant, mode)
	hostport := net.JoinHostPort(nh, strconv.Itoa(port))
	if path != "" {
		fmt.Fprintf(w, "target:   %s %s://%s%s\n", method, scheme, hostport, path)
	} else {
		fmt.Fprintf(w, "target:   CONNECT %s\n", hostport)
	}

	cd := pol.Decide(rules.Query{Tenant: tenant, Host: nh, IsIP: isIP, Port: port, Connect: true})
	tunnel := "deny"
	switch {
	case !cd.Allowed:
	case cd.WouldDeny:
		tunnel = "splice (report mode: enforce would deny)"
	case cd.Intercept:
		tunnel = "intercept (requests inside are decided one by one)"
	default:
		tunnel = "splice (requests inside are not inspected; SNI must match)"
	}
	fmt.Fprintf(w, "connect:  %s -> %s [%s%s]\n", hostport, tunnel, cd.Reason, ruleSuffix(cd))

	// The proxy takes plain http as absolute-form requests and https only
	// through CONNECT; a spliced tunnel is decided by the CONNECT alone.
	final := cd
	if method != "CONNECT" && (scheme == "http" || (cd.Allowed && cd.Intercept && !cd.WouldDeny)) {
		final = pol.Decide(rules.Query{Tenant: tenant, Host: nh, IsIP: isIP, Port: port, Method: method, Path: path})
	}
	verdict := "deny"
	if final.Allowed {
		verdict = "allow"
		if final.WouldDeny {
			verdict = "allow (report mode: enforce would deny)"
		}
	}
	fmt.Fprintf(w, "decision: %s\n", verdict)
	rule := "-"
	if final.Rule != nil {
		rule = final.Rule.ID
	}
	fmt.Fprintf(w, "rule:     %s\nreason:   %s\n", rule, final.Reason)
	return final.Allowed
}

func ruleSuffix(d rules.Decision) string {
	if d.Rule == nil {
		return ""
	}
	return ", rule " + d.Rule.ID
}

func isMethodToken(m string) bool {
	if m == "" {
		return false
	}
	for i := 0; i < len(m); i++ {
		c := m[i]
		if c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0 {
			continue
		}
		return false
	}
	return true
}
