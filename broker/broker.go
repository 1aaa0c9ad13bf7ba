package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/sluicehq/sluice/rules"
)

// Defaults for unset BrokerConfig fields.
const (
	DefaultRefresh      = time.Minute
	DefaultMaxStaleness = 10 * time.Minute
)

// fetchConcurrency bounds parallel fetches in one refresh, so a config with
// many secrets does not open as many connections to Vault at once.
const fetchConcurrency = 4

var (
	// ErrUnavailable: the secret has never been fetched successfully.
	ErrUnavailable = errors.New("secret unavailable")
	// ErrStale: the last successful fetch is older than the secret's maximum staleness.
	ErrStale = errors.New("secret stale")
	// ErrUnknown: no secret of that name is configured.
	ErrUnknown = errors.New("secret not configured")
)

// SecretError is every error Get, Render and Ready return about one secret.
// It names the secret and never holds its value.
type SecretError struct {
	Name string
	Err  error // ErrUnavailable, ErrStale or ErrUnknown
}

func (e *SecretError) Error() string { return fmt.Sprintf("broker: secret %q: %v", e.Name, e.Err) }
func (e *SecretError) Unwrap() error { return e.Err }

// Options are the Broker's collaborators; all are optional.
type Options struct {
	Logger *slog.Logger
	// Now is the clock used for staleness; default time.Now.
	Now func() time.Time
	// Sources replace or add sources by Name(); without an entry, "vault" and
	// "file" are built from the BrokerConfig when a secret first needs them.
	Sources []Source
}

// Broker caches secrets and keeps them fresh. Get is safe for concurrent use
// and does no I/O.
type Broker struct {
	cfg      rules.BrokerConfig
	log      *slog.Logger
	now      func() time.Time
	refresh  time.Duration
	defStale time.Duration

	snap atomic.Pointer[snapshot]

	fetchMu sync.Mutex // one refresh or Update at a time

	mu      sync.Mutex // guards the fields below
	specs   map[string]rules.SecretSpec
	sources map[string]Source
	running map[string]bool // sources whose Run was started
	runCtx  context.Context // set by Start
	wg      sync.WaitGroup

	kick chan struct{}
}

type snapshot struct {
	entries map[string]*entry
}

// entry is immutable once published in a snapshot.
type entry struct {
	spec     rules.SecretSpec
	value    Value
	fetched  time.Time // zero: never fetched
	maxStale time.Duration
}

// New validates the broker config and secret specs. It does no I/O beyond
// reading files the Vault TLS settings name; secrets are first fetched by Start.
func New(cfg rules.BrokerConfig, specs []rules.SecretSpec, opts Options) (*Broker, error) {
	b := &Broker{
		cfg:      cfg,
		log:      opts.Logger,
		now:      opts.Now,
		refresh:  cfg.Refresh.Std(),
		defStale: cfg.MaxStaleness.Std(),
		sources:  map[string]Source{},
		running:  map[string]bool{},
		specs:    map[string]rules.SecretSpec{},
		kick:     make(chan struct{}, 1),
	}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	if b.now == nil {
		b.now = time.Now
	}
	if b.refresh <= 0 {
		b.refresh = DefaultRefresh
	}
	if b.defStale <= 0 {
		b.defStale = DefaultMaxStaleness
	}
	for _, s := range opts.Sources {
		b.sources[s.Name()] = s
	}
	b.snap.Store(&snapshot{entries: map[string]*entry{}})
	if err := b.setSpecs(specs); err != nil {
		return nil, err
	}
	return b, nil
}

// setSpecs validates specs, makes sure their sources exist and publishes a
// snapshot in which unchanged secrets keep their values and new or changed
// ones are unavailable until fetched. It returns the names to fetch.
func (b *Broker) setSpecs(specs []rules.SecretSpec) error {
	next := make(map[string]rules.SecretSpec, len(specs))
	for i, s := range specs {
		if s.Name == "" {
			return fmt.Errorf("broker: secrets[%d]: name is empty", i)
		}
		if _, dup := next[s.Name]; dup {
			return fmt.Errorf("broker: secret %q declared twice", s.Name)
		}
		if err := b.validateSpec(s); err != nil {
			return err
		}
		next[s.Name] = s
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	newSources := map[string]Source{}
	for _, s := range next {
		if _, ok := b.sources[s.Source]; ok {
			continue
		}
		if _, ok := newSources[s.Source]; ok {
			continue
		}
		src, err := b.buildSource(s.Source)
		if err != nil {
			return fmt.Errorf("broker: secret %q: %w", s.Name, err)
		}
		newSources[s.Source] = src
	}
	maps.Copy(b.sources, newSources)
	if b.runCtx != nil {
		b.startRunners()
	}

	old := b.snap.Load().entries
	entries := make(map[string]*entry, len(next))
	for name, s := range next {
		e := &entry{spec: s, maxStale: b.maxStale(s)}
		if o := old[name]; o != nil && sameOrigin(o.spec, s) {
			e.value, e.fetched = o.value, o.fetched
		}
		entries[name] = e
	}
	b.specs = next
	b.snap.Store(&snapshot{entries: entries})
	return nil
}

func (b *Broker) validateSpec(s rules.SecretSpec) error {
	if s.Source == "vault" {
		if err := validateKVPath(s.Path); err != nil {
			return fmt.Errorf("broker: secret %q: %w", s.Name, err)
		}
		if s.Field == "" {
			return fmt.Errorf("broker: secret %q: field is required for source vault", s.Name)
		}
	}
	if ms := b.maxStale(s); ms < b.refresh {
		return fmt.Errorf("broker: secret %q: max staleness %v is shorter than the refresh interval %v, so it would go stale between refreshes", s.Name, ms, b.refresh)
	}
	return nil
}

func (b *Broker) maxStale(s rules.SecretSpec) time.Duration {
	if d := s.MaxStaleness.Std(); d > 0 {
		return d
	}
	return b.defStale
}

// sameOrigin reports whether two specs fetch the same value, so a reload that
// changes only hosts, limits or staleness keeps the cached value.
func sameOrigin(a, b rules.SecretSpec) bool {
	return a.Source == b.Source && a.Path == b.Path && a.Field == b.Field && a.Key == b.Key
}

func (b *Broker) buildSource(name string) (Source, error) {
	switch name {
	case "vault":
		return NewVaultSource(b.cfg.Vault, b.log)
	case "file":
		return NewFileSource(b.cfg.File.Path, b.log)
	case "":
		return nil, errors.New("source is empty: want vault or file")
	default:
		return nil, fmt.Errorf("unknown source %q: want vault or file", name)
	}
}

// startRunners starts Run for every source that has one and is not running.
// Called with b.mu held and b.runCtx set.
func (b *Broker) startRunners() {
	for name, src := range b.sources {
		r, ok := src.(runner)
		if !ok || b.running[name] {
			continue
		}
		b.running[name] = true
		ctx := b.runCtx
		b.wg.Go(func() { r.Run(ctx, b.Kick) })
	}
}

// Kick asks for a refresh now instead of at the next interval (used by
// sources that notice a change, and on SIGHUP). It never blocks.
func (b *Broker) Kick() {
	select {
	case b.kick <- struct{}{}:
	default:
	}
}

// Start fetches every secret once, then keeps refreshing them in the
// background every broker.refresh until ctx ends (Wait waits for that). A
// secret that cannot be fetched does not fail Start: it stays unavailable,
// Get refuses it and Ready reports it, while secrets that did arrive serve.
func (b *Broker) Start(ctx context.Context) error {
	b.mu.Lock()
	if b.runCtx != nil {
		b.mu.Unlock()
		return errors.New("broker: already started")
	}
	b.runCtx = ctx
	b.startRunners()
	b.mu.Unlock()

	b.refreshAll(ctx, nil)
	b.wg.Go(func() { b.loop(ctx) })
	return nil
}

// Wait blocks until the background work started by Start has ended.
func (b *Broker) Wait() { b.wg.Wait() }

func (b *Broker) loop(ctx context.Context) {
	t := time.NewTicker(b.refresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-b.kick:
		}
		b.refreshAll(ctx, nil)
	}
}

// Update replaces the set of secrets after a config reload: removed secrets
// are dropped at once, secrets whose origin (source, path, field, key) is
// unchanged keep their cached value, and new or changed ones are fetched
// before Update returns. Invalid specs leave the broker unchanged. A fetch
// failure is not an error here: the secret is unavailable and Ready says so.
func (b *Broker) Update(ctx context.Context, specs []rules.SecretSpec) error {
	b.fetchMu.Lock()
	defer b.fetchMu.Unlock()
	if err := b.setSpecs(specs); err != nil {
		return err
	}
	var missing []string
	for name, e := range b.snap.Load().entries {
		if e.fetched.IsZero() {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		b.refreshLocked(ctx, missing)
	}
	return nil
}

// refreshAll fetches the named secrets (all when names is nil).
func (b *Broker) refreshAll(ctx context.Context, names []string) {
	b.fetchMu.Lock()
	defer b.fetchMu.Unlock()
	b.refreshLocked(ctx, names)
}

type fetchResult struct {
	spec  rules.SecretSpec
	value Value
	err   error
	at    time.Time
}

func (b *Broker) refreshLocked(ctx context.Context, names []string) {
	b.mu.Lock()
	var todo []rules.SecretSpec
	if names == nil {
		for _, s := range b.specs {
			todo = append(todo, s)
		}
	} else {
		for _, n := range names {
			if s, ok := b.specs[n]; ok {
				todo = append(todo, s)
			}
		}
	}
	sources := maps.Clone(b.sources)
	b.mu.Unlock()

	results := make([]fetchResult, len(todo))
	var g errgroup.Group
	g.SetLimit(fetchConcurrency)
	for i, s := range todo {
		g.Go(func() error {
			v, err := sources[s.Source].Fetch(ctx, s)
			results[i] = fetchResult{spec: s, value: v, err: err, at: b.now()}
			return nil
		})
	}
	_ = g.Wait()

	b.mu.Lock()
	defer b.mu.Unlock()
	old := b.snap.Load().entries
	entries := maps.Clone(old)
	for _, r := range results {
		o := old[r.spec.Name]
		if o == nil || !sameOrigin(o.spec, r.spec) {
			continue // removed or changed by an Update meanwhile
		}
		if r.err != nil {
			b.logFailure(o, r.err)
			continue
		}
		if r.value.IsZero() {
			b.logFailure(o, errors.New("source returned an empty value"))
			continue
		}
		e := *o
		switch {
		case o.fetched.IsZero():
			b.log.Info("broker: secret available", "secret", r.spec.Name, "source", r.spec.Source)
		case !o.value.Equal(r.value):
			b.log.Info("broker: secret rotated", "secret", r.spec.Name, "source", r.spec.Source)
		case b.now().Sub(o.fetched) > o.maxStale:
			b.log.Info("broker: secret fresh again", "secret", r.spec.Name, "source", r.spec.Source)
		}
		e.value, e.fetched = r.value, r.at
		entries[r.spec.Name] = &e
	}
	b.snap.Store(&snapshot{entries: entries})
}

func (b *Broker) logFailure(e *entry, err error) {
	attrs := []any{"secret", e.spec.Name, "source", e.spec.Source, "err", err}
	if e.fetched.IsZero() {
		b.log.Error("broker: secret fetch failed; secret unavailable", attrs...)
		return
	}
	age := b.now().Sub(e.fetched)
	attrs = append(attrs, "age", age.Round(time.Millisecond).String(), "max_staleness", e.maxStale.String())
	if age > e.maxStale {
		b.log.Error("broker: secret refresh failed; secret stale, requests needing it are refused", attrs...)
		return
	}
	b.log.Warn("broker: secret refresh failed; serving cached value", attrs...)
}

// Get returns the cached value of a secret. It does no I/O. The error is a
// *SecretError wrapping ErrUnknown, ErrUnavailable or ErrStale.
func (b *Broker) Get(name string) (Value, error) {
	return b.snap.Load().get(name, b.now())
}

func (s *snapshot) get(name string, now time.Time) (Value, error) {
	e := s.entries[name]
	switch {
	case e == nil:
		return Value{}, &SecretError{Name: name, Err: ErrUnknown}
	case e.fetched.IsZero():
		return Value{}, &SecretError{Name: name, Err: ErrUnavailable}
	case now.Sub(e.fetched) > e.maxStale:
		return Value{}, &SecretError{Name: name, Err: ErrStale}
	}
	return e.value, nil
}

// Ready returns nil when every configured secret is fresh, else an error
// listing (by name) each one that is not.
func (b *Broker) Ready() error {
	s, now := b.snap.Load(), b.now()
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(s.entries)) {
		if _, err := s.get(name, now); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Ages returns, for every secret fetched at least once, the time since its
// last successful fetch (for a metric). Never-fetched secrets are absent.
func (b *Broker) Ages() map[string]time.Duration {
	s, now := b.snap.Load(), b.now()
	out := make(map[string]time.Duration, len(s.entries))
	for name, e := range s.entries {
		if !e.fetched.IsZero() {
			out[name] = now.Sub(e.fetched)
		}
	}
	return out
}

// Names returns the configured secret names, sorted.
func (b *Broker) Names() []string {
	return slices.Sorted(maps.Keys(b.snap.Load().entries))
}
