#!/usr/bin/env bash
# Runs the shared proxy benchmark harness (../shared/bench/run.sh) with sluice
# as an extra peer, with policy, authentication-free bound listeners, audit
# logging and (for the interception scenarios) secret injection and response
# scrubbing all on. Arguments are passed to the harness (e.g. --quick).
#
# The harness cannot send proxy credentials on its plain-proxy peer, so both
# sluice instances use --bind-tenant: the listener itself carries the tenant,
# as a launcher's bridge does. Everything else is the production path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
harness=${BENCH_HARNESS:-$repo/../shared/bench/run.sh}
work=${BENCH_SLUICE_WORK:-/tmp/sluice-bench}
mkdir -p "$work" && chmod 700 "$work"
if [ -n "${SLUICE_BIN:-}" ]; then cp "$SLUICE_BIN" "$work/sluice"; else (cd "$repo" && go build -trimpath -o "$work/sluice" ./cmd/sluice); fi

umask 077
printf 'bench: bench-secret-value-0123456789\n' >"$work/secrets.yaml"

cat >"$work/plain.yaml" <<YAML
version: 1
audit:
  path: $work/audit-plain.jsonl
  fsync: interval
tenants:
  - id: bench
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - host: 127.0.0.1
        ports: [18100, 18443]
YAML

cat >"$work/mitm.yaml" <<YAML
version: 1
audit:
  path: $work/audit-mitm.jsonl
  fsync: interval
broker:
  file:
    path: $work/secrets.yaml
secrets:
  - name: bench
    source: file
    hosts: [127.0.0.1]
tenants:
  - id: bench
    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - host: 127.0.0.1
        ports: [18443]
        inject:
          - header: X-Bench-Auth
            value: "\${secret:bench}"
      - host: 127.0.0.1
        ports: [18100]
YAML
rm -f "$work"/audit-*.jsonl*

export EXTRA_PROXY_NAME=sluice
export EXTRA_PROXY_URL=http://127.0.0.1:19000
export EXTRA_PROXY_CMD="$work/sluice serve --config $work/plain.yaml --listen 127.0.0.1:19000 --admin 127.0.0.1:19090 --bind-tenant bench --log-level warn"
export EXTRA_MITM_PROXY_NAME=sluice-mitm
export EXTRA_MITM_PROXY_URL=http://127.0.0.1:19001
export EXTRA_MITM_PROXY_CMD="$work/sluice serve --config $work/mitm.yaml --listen 127.0.0.1:19001 --admin 127.0.0.1:19091 --bind-tenant bench --log-level warn --upstream-ca \$BENCH_UPSTREAM_CA --ca-cert \$BENCH_MITM_CA_CERT --ca-key \$BENCH_MITM_CA_KEY --allow-readable-ca-key"
exec "$harness" "$@"
