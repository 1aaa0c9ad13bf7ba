package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/internal/identity"
)

// newTokenCmd manages sandbox credentials: static per-tenant secrets (stored in
// the config only as hashes) and minted, expiring sandbox tokens.
func newTokenCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "token",
		Short: "Create sandbox credentials (static secrets, their hashes, token keys, minted tokens)",
		Long: "Sandboxes authenticate to the proxy with Proxy-Authorization: Basic, user = tenant id,\n" +
			"password = a static secret (`token new`, stored hashed in the config) or a minted token\n" +
			"(`token mint`, signed with the key from `token keygen`).",
		Args: noArgsQuiet,
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	cmd.AddCommand(newTokenNewCmd(), newTokenHashCmd(), newTokenKeygenCmd(), newTokenMintCmd())
	return cmd
}

// noArgsQuiet refuses positional arguments without repeating them: under
// `sluice token` an argument is quite likely a pasted secret, and cobra's own
// message would print it.
func noArgsQuiet(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("%s takes no arguments (%d given; not repeated here in case one is a secret)", cmd.CommandPath(), len(args))
	}
	return nil
}

func newTokenNewCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "new",
		Short: "Print a new static secret and, on the second line, its hash for the config",
		Long: "Print a new random static secret (first line) and its hash (second line).\n" +
			"Put the hash in tenants[].credentials[].hash and give the secret to the sandbox's\n" +
			"owner: this is the only time it is shown, and sluice never stores it.",
		Args: noArgsQuiet,
		RunE: func(cmd *cobra.Command, _ []string) error {
			secret, err := identity.NewSecret()
			if err != nil {
				return err
			}
			hash, err := identity.HashSecret(secret)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s\n%s\n", secret, hash)
			return err
		},
	}
}

func newTokenHashCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hash < secret",
		Short: "Read a static secret from stdin and print its hash for the config",
		Long: "Read a static secret from standard input (one line) and print the hash to put in\n" +
			"tenants[].credentials[].hash. The secret is never accepted as an argument, since\n" +
			"arguments are visible to every user of the machine and end up in shell history.",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return errors.New("token hash reads the secret from stdin, never from arguments (arguments are visible in ps and shell history); the argument was not used and is not repeated here")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			in := cmd.InOrStdin()
			if f, ok := in.(*os.File); ok {
				if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
					fmt.Fprintln(cmd.ErrOrStderr(), "paste the secret, then press Enter:")
				}
			}
			secret, err := readSecretLine(in)
			if err != nil {
				return err
			}
			hash, err := identity.HashSecret(secret)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), hash)
			return err
		},
	}
	// pflag quotes the whole offending argument for an unknown shorthand
	// ("-sSECRET"); replace every flag error with one that repeats nothing.
	cmd.SetFlagErrorFunc(func(*cobra.Command, error) error {
		return errors.New("token hash takes no flags; pipe the secret to its stdin")
	})
	return cmd
}

// readSecretLine reads exactly one line (a final newline, LF or CRLF, is
// optional) of bounded length. Errors never include what was read.
func readSecretLine(r io.Reader) (string, error) {
	data, err := io.ReadAll(io.LimitReader(r, identity.MaxSecretLen+3))
	if err != nil {
		return "", fmt.Errorf("reading the secret from stdin: %w", err)
	}
	if len(data) > identity.MaxSecretLen+2 {
		return "", fmt.Errorf("the secret on stdin is longer than %d characters", identity.MaxSecretLen)
	}
	data = bytes.TrimSuffix(data, []byte("\n"))
	data = bytes.TrimSuffix(data, []byte("\r"))
	if len(data) == 0 {
		return "", errors.New("no secret on stdin")
	}
	if bytes.ContainsAny(data, "\r\n") {
		return "", errors.New("stdin holds more than one line; give exactly one secret")
	}
	return string(data), nil
}

func newTokenKeygenCmd() *cobra.Command {
	var keyPath string
	cmd := &cobra.Command{
		Use:   "keygen --key FILE",
		Short: "Create the key that signs sandbox tokens (mode 0600; never overwrites)",
		Long: "Create a random 32-byte HMAC key for minted sandbox tokens and write it to FILE with\n" +
			"mode 0600 (parent directories 0700). An existing file is never overwritten. Point\n" +
			"identity.token_key_file at it; only the proxy and the launcher need it.",
		Args: noArgsQuiet,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := identity.GenerateKeyFile(keyPath); err != nil {
				return err
			}
			// Load it back so success means `sluice serve` will accept the file.
			if _, err := identity.LoadKeyFile(keyPath); err != nil {
				return fmt.Errorf("token keygen: verify the new key: %w", err)
			}
			_, err := fmt.Fprintf(cmd.OutOrStdout(), "wrote token key to %s (mode 0600)\n", keyPath)
			return err
		},
	}
	cmd.Flags().StringVar(&keyPath, "key", "", "file to write the token key to")
	_ = cmd.MarkFlagRequired("key")
	return cmd
}

func newTokenMintCmd() *cobra.Command {
	var keyPath, tenant, sandbox string
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "mint --key FILE --tenant T --sandbox S [--ttl 1h]",
		Short: "Print a sandbox token for tenant T and sandbox S, valid for --ttl",
		Long: "Mint a sandbox token signed with the key in FILE and print it. The sandbox sends it as\n" +
			"the proxy password with the tenant id as user. Revoke it by listing the sandbox id or\n" +
			"the token id in identity.revoked.",
		Args: noArgsQuiet,
		RunE: func(cmd *cobra.Command, _ []string) error {
			key, err := identity.LoadKeyFile(keyPath)
			if err != nil {
				return err
			}
			now := time.Now()
			tok, err := identity.Mint(key, tenant, sandbox, ttl, now)
			if err != nil {
				return err
			}
			if _, err := fmt.Fprintln(cmd.OutOrStdout(), tok); err != nil {
				return err
			}
			_, err = fmt.Fprintf(cmd.ErrOrStderr(), "token for tenant %s, sandbox %s, expires %s\n",
				tenant, sandbox, now.Add(ttl).UTC().Truncate(time.Second).Format(time.RFC3339))
			return err
		},
	}
	cmd.Flags().StringVar(&keyPath, "key", "", "token key file (from `sluice token keygen`)")
	cmd.Flags().StringVar(&tenant, "tenant", "", "tenant id the token is for")
	cmd.Flags().StringVar(&sandbox, "sandbox", "", "sandbox id the token is for")
	cmd.Flags().DurationVar(&ttl, "ttl", time.Hour, "how long the token is valid (1s to 720h)")
	for _, f := range []string{"key", "tenant", "sandbox"} {
		_ = cmd.MarkFlagRequired(f)
	}
	return cmd
}
