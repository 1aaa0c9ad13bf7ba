# Sluice — the two commands a newcomer needs are `make run` and `make test`.
GO      ?= go
BIN     := bin/sluice
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)

.PHONY: build run test test-short deps vault bench lint

build:
	$(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/sluice

# Run sluice on the quickstart example: a local config, the `file` secret
# source, a fresh interception CA and token key (created on first run under
# examples/quickstart/state/). No Vault needed.
run: build
	scripts/quickstart.sh

# The whole test suite with the race detector: installs what a fresh Debian
# machine lacks (root), builds the Vault dev server once (cached outside the
# repo), then runs every test, including the real-Vault and launcher tests.
# Packages run one at a time (-p 1): the end-to-end tests measure rates and
# timeouts, and two packages loading both cores at once make those flaky.
test: deps vault
	SLUICE_VAULT_BIN="$$(scripts/build-vault.sh)" $(GO) test -race -count=1 -p 1 -timeout 60m ./...

# Unit and loopback tests only (no Vault build, no package installs).
test-short:
	$(GO) test -race -count=1 -short ./...

deps:
	scripts/deps.sh

vault:
	scripts/build-vault.sh >/dev/null

lint:
	gofmt -l . | tee /dev/stderr | (! read)
	$(GO) vet ./...

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 2000x ./rules/ ./internal/... ./certs/ ./broker/ ./proxy/
