package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/spf13/viper"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/internal/metrics"
	"github.com/sluicehq/sluice/rules"
)

// reloader keeps the running policy in step with the config file: file
// watch, SIGHUP and a slow poll (in case the watcher dies) all lead to one
// debounced reload that reads the bytes, skips them if unchanged, decodes
// strictly, validates, compiles and only then swaps. A file that fails any
// step never replaces the running policy.
type reloader struct {
	path    string
	v       *viper.Viper
	last    []byte
	lastBad []byte
	log     *slog.Logger
	metrics *metrics.Metrics
	audit   *audit.Writer
	apply   func(*rules.Config, *rules.Policy) error

	debounce time.Duration
	poll     time.Duration
}

func (r *reloader) run(ctx context.Context) {
	if r.debounce == 0 {
		r.debounce = 250 * time.Millisecond
	}
	if r.poll == 0 {
		r.poll = 10 * time.Second
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	// Watch the directory, not the file: editors and config management
	// replace files by rename, which ends a watch on the old inode.
	var events <-chan fsnotify.Event
	var errs <-chan error
	w, err := fsnotify.NewWatcher()
	if err == nil {
		if err = w.Add(filepath.Dir(r.path)); err == nil {
			events, errs = w.Events, w.Errors
		}
		defer w.Close()
	}
	if err != nil {
		r.log.Warn("config file watch unavailable; relying on SIGHUP and polling", "err", err)
	}

	poll := time.NewTicker(r.poll)
	defer poll.Stop()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	base := filepath.Base(r.path)
	// The debounced reload reports what armed it, so an operator can tell a
	// SIGHUP from a file change in the log and the audit record.
	pending := "change"
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				events = nil
				r.log.Warn("config file watch ended; relying on SIGHUP and polling")
				continue
			}
			if name := filepath.Base(ev.Name); name == base || name == kubeDataLink {
				if pending != "sighup" {
					pending = "change"
				}
				timer.Reset(r.debounce)
			}
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			r.log.Warn("config file watch error", "err", err)
		case <-hup:
			pending = "sighup"
			timer.Reset(r.debounce)
		case <-poll.C:
			r.reload(ctx, "poll")
		case <-timer.C:
			r.reload(ctx, pending)
			pending = "change"
		}
	}
}

// kubeDataLink is how a Kubernetes ConfigMap volume publishes an update: it
// swaps the "..data" symlink in the mounted directory, and the config file
// (itself a symlink through ..data) sees no event of its own.
const kubeDataLink = "..data"

func (r *reloader) reload(ctx context.Context, trigger string) {
	data, err := os.ReadFile(r.path)
	if err != nil {
		r.fail(ctx, trigger, err)
		return
	}
	if bytes.Equal(data, r.last) || (r.lastBad != nil && bytes.Equal(data, r.lastBad)) {
		if trigger != "poll" {
			r.metrics.Reload("unchanged")
		}
		return
	}
	// Decode the bytes just compared, never a second read of the file: a
	// file rewritten between two reads would leave r.last naming bytes that
	// were never applied, and a later write of those bytes would be skipped
	// as unchanged while another policy stays in force.
	cfg, pol, err := configFromBytes(r.path, data, r.v)
	if err == nil {
		err = r.apply(cfg, pol)
	}
	if err != nil {
		r.fail(ctx, trigger, err)
		// The same bad bytes are reported once, not at every poll.
		r.lastBad = data
		return
	}
	r.last, r.lastBad = data, nil
	r.metrics.Reload("ok")
	r.log.Info("policy reloaded", "trigger", trigger, "policy", pol.Version(), "tenants", len(pol.Tenants()))
	_ = r.audit.Write(ctx, &audit.Record{Time: time.Now().UTC(), Kind: audit.KindConfigReload, Decision: audit.DecisionAllow, Policy: pol.Version(), Message: "policy reloaded (" + trigger + ")"})
}

func (r *reloader) fail(ctx context.Context, trigger string, err error) {
	r.metrics.Reload("failed")
	r.log.Error("config reload failed; the running policy stays in force", "trigger", trigger, "err", err)
	_ = r.audit.Write(ctx, &audit.Record{Time: time.Now().UTC(), Kind: audit.KindConfigReload, Decision: audit.DecisionError, Message: "config reload failed; previous policy kept"})
}

// configFromBytes is loadConfig for bytes already read: decode strictly,
// resolve paths against the config's directory, apply the flag and
// environment overrides, compile.
func configFromBytes(path string, data []byte, v *viper.Viper) (*rules.Config, *rules.Policy, error) {
	cfg, err := rules.Parse(data, path)
	if err != nil {
		return nil, nil, err
	}
	resolvePaths(cfg, filepath.Dir(path))
	for _, o := range serverOverrides {
		if v != nil && v.IsSet(o.flag) && v.GetString(o.flag) != "" {
			*o.field(cfg) = v.GetString(o.flag)
		}
	}
	pol, err := rules.Compile(cfg)
	if err != nil {
		return nil, nil, err
	}
	return cfg, pol, nil
}
