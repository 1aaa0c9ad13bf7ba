package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/sluicehq/sluice/certs"
)

// newCACmd manages the interception CA: creating it and exporting the trust
// bundle that sandboxes install.
func newCACmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "ca",
		Short: "Manage the interception CA (create it, export the sandbox trust bundle)",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(newCAInitCmd(), newCABundleCmd())
	return cmd
}

func newCAInitCmd() *cobra.Command {
	var certPath, keyPath string
	var validity time.Duration
	cmd := &cobra.Command{
		Use:   "init --cert FILE --key FILE [--validity 43800h]",
		Short: "Create a new ECDSA P-256 interception CA (never overwrites existing files)",
		Long: "Create a new ECDSA P-256 interception CA. The certificate is written with mode 0644,\n" +
			"the PKCS#8 key with mode 0600. Existing files are never overwritten. The key is never printed.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := certs.CreateCA(certPath, keyPath, certs.CAOptions{Validity: validity}); err != nil {
				return err
			}
			// Load what was written, so a success message means the pair
			// really is usable by `sluice serve`.
			ca, err := certs.LoadCA(certPath, keyPath)
			if err != nil {
				return fmt.Errorf("ca init: verify the new CA: %w", err)
			}
			c := ca.Certificate()
			_, err = fmt.Fprintf(cmd.OutOrStdout(),
				"created interception CA %q\n  certificate: %s\n  key:         %s (mode 0600)\n  sha256:      %s\n  expires:     %s\n",
				c.Subject.CommonName, certPath, keyPath, ca.Fingerprint(), c.NotAfter.UTC().Format(time.RFC3339))
			return err
		},
	}
	cmd.Flags().StringVar(&certPath, "cert", "", "file to write the CA certificate to (PEM)")
	cmd.Flags().StringVar(&keyPath, "key", "", "file to write the CA private key to (PKCS#8 PEM, mode 0600)")
	cmd.Flags().DurationVar(&validity, "validity", certs.DefaultCAValidity, "how long the CA is valid")
	_ = cmd.MarkFlagRequired("cert")
	_ = cmd.MarkFlagRequired("key")
	return cmd
}

func newCABundleCmd() *cobra.Command {
	var certPath, outPath string
	var roots []string
	var force bool
	cmd := &cobra.Command{
		Use:   "bundle --cert FILE [--out FILE]",
		Short: "Write the sandbox trust bundle: system roots followed by the interception CA",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			caCert, err := certs.ReadCACertificate(certPath, time.Now())
			if err != nil {
				return err
			}
			if len(roots) == 0 {
				roots = certs.SystemRootFiles()
			}
			var buf bytes.Buffer
			if err := certs.WriteTrustBundle(&buf, caCert, roots); err != nil {
				return err
			}
			if outPath == "" || outPath == "-" {
				_, err := cmd.OutOrStdout().Write(buf.Bytes())
				return err
			}
			return writeBundleFile(outPath, buf.Bytes(), force)
		},
	}
	cmd.Flags().StringVar(&certPath, "cert", "", "the CA certificate (PEM); its key is not needed")
	cmd.Flags().StringVar(&outPath, "out", "-", "output file, or - for stdout")
	cmd.Flags().StringSliceVar(&roots, "system-roots", nil, "PEM root bundle(s) to start from, first existing wins (default: the usual Linux locations)")
	cmd.Flags().BoolVar(&force, "force", false, "replace --out if it exists")
	_ = cmd.MarkFlagRequired("cert")
	return cmd
}

// writeBundleFile writes a public bundle with mode 0644. Without force an
// existing file is an error, because a mistyped --out could otherwise clobber
// the CA key; with force the file is replaced atomically (temp + rename) so a
// sandbox never reads half a bundle.
func writeBundleFile(path string, data []byte, force bool) error {
	if !force {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("ca bundle: %s already exists (use --force to replace it)", path)
		}
		if err != nil {
			return fmt.Errorf("ca bundle: %w", err)
		}
		if _, err := f.Write(data); err != nil {
			f.Close()
			os.Remove(path)
			return fmt.Errorf("ca bundle: write %s: %w", path, err)
		}
		if err := f.Close(); err != nil {
			os.Remove(path)
			return fmt.Errorf("ca bundle: write %s: %w", path, err)
		}
		return nil
	}
	if fi, err := os.Lstat(path); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("ca bundle: %s is not a regular file", path)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("ca bundle: %w", err)
	}
	name := tmp.Name()
	defer os.Remove(name)
	err = tmp.Chmod(0o644)
	if err == nil {
		_, err = io.Copy(tmp, bytes.NewReader(data))
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(name, path)
	}
	if err != nil {
		return fmt.Errorf("ca bundle: write %s: %w", path, err)
	}
	return nil
}
