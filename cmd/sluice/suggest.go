package main

import (
	"encoding/json"
	"time"

	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/internal/audit"
)

// newRulesSuggestCmd drafts an allowlist from audit records. It is attached
// under `sluice rules`.
func newRulesSuggestCmd() *cobra.Command {
	var (
		tenant, configPath, since, until string
		minWildcard                      int
		asJSON                           bool
	)
	cmd := &cobra.Command{
		Use:   "suggest --tenant T [PATH...]",
		Short: "Draft an allow: block for a tenant from its audit records",
		Long: `Read the tenant's allowed and report-mode (would_deny, not_allowlisted) records and
print a draft allow: block (hosts, ports, methods) to review and paste under the
tenant. Sibling subdomains are grouped into a wildcard only when at least
--min-wildcard of them were seen, and a comment says so. Hosts that matched an
explicit deny rule are never suggested.`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if tenant == "" {
				return &exitError{code: 2, msg: "suggest needs --tenant"}
			}
			if minWildcard < 2 {
				return &exitError{code: 2, msg: "--min-wildcard must be at least 2"}
			}
			now := time.Now()
			from, err := audit.ParseTimeBound(since, now)
			if err != nil {
				return &exitError{code: 2, msg: "--since: " + err.Error()}
			}
			to, err := audit.ParseTimeBound(until, now)
			if err != nil {
				return &exitError{code: 2, msg: "--until: " + err.Error()}
			}
			files, err := auditFiles(configPath, args)
			if err != nil {
				return &exitError{code: 2, msg: err.Error()}
			}
			filter := audit.Filter{Tenant: tenant, Since: from, Until: to}
			g := audit.NewSuggester(tenant, minWildcard)
			st, err := audit.Scan(cmd.Context(), files, func(r *audit.Record, _ audit.Location) error {
				if filter.Match(r) {
					g.Add(r)
				}
				return nil
			})
			if err != nil {
				return err
			}
			reportSkipped(cmd.ErrOrStderr(), st)
			s := g.Result()
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(&s)
			}
			return s.WriteYAML(cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&tenant, "tenant", "", "tenant to draft rules for (required)")
	fs.StringVarP(&configPath, "config", "c", "", "configuration file whose audit.path to read")
	fs.StringVar(&since, "since", "", "only records at or after this time (2h or RFC 3339)")
	fs.StringVar(&until, "until", "", "only records before this time")
	fs.IntVar(&minWildcard, "min-wildcard", 3, "sibling subdomains needed before they are grouped into a wildcard")
	fs.BoolVar(&asJSON, "json", false, "print the draft as JSON instead of YAML")
	return cmd
}
