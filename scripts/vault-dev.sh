#!/usr/bin/env bash
# Starts a throwaway in-memory Vault dev server on loopback for trying the
# Vault example, using the binary from scripts/build-vault.sh (or $SLUICE_VAULT_BIN).
# Prints shell `export` lines; eval them. Never use a dev server for real secrets.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${SLUICE_VAULT_BIN:-$("$here/build-vault.sh")}
port=${VAULT_DEV_PORT:-8200}
dir=$(mktemp -d)
token="root-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"

HOME="$dir" "$bin" server -dev -dev-listen-address="127.0.0.1:$port" \
  -dev-root-token-id="$token" -dev-no-store-token >"$dir/vault.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do
  if VAULT_ADDR="http://127.0.0.1:$port" "$bin" status >/dev/null 2>&1; then
    echo "export VAULT_ADDR=http://127.0.0.1:$port"
    echo "export VAULT_TOKEN=$token"
    echo "# vault dev server pid $pid, log $dir/vault.log; stop with: kill $pid"
    exit 0
  fi
  kill -0 "$pid" 2>/dev/null || { cat "$dir/vault.log" >&2; exit 1; }
  sleep 0.2
done
echo "vault dev server did not become ready; see $dir/vault.log" >&2
kill "$pid"
exit 1
