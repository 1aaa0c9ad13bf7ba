#!/usr/bin/env bash
# Builds a real Vault server binary from its Go module so the broker's tests can
# run against `vault server -dev` on loopback. The binary is cached outside the
# repository (Vault's code and binary are never committed). Prints the path.
set -euo pipefail

VAULT_VERSION=${VAULT_VERSION:-v1.21.0}
CACHE=${SLUICE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice}
OUT="$CACHE/vault-$VAULT_VERSION/vault"

if [ -x "$OUT" ] && "$OUT" version >/dev/null 2>&1; then
  echo "$OUT"
  exit 0
fi

mkdir -p "$(dirname "$OUT")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "building vault $VAULT_VERSION into $OUT (the first time takes ~15 min on 2 cores)" >&2
dir=$(go mod download -json "github.com/hashicorp/vault@$VAULT_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$dir" ] || { echo "build-vault: module github.com/hashicorp/vault@$VAULT_VERSION not downloaded" >&2; exit 1; }

cp "$dir/go.mod" "$dir/go.sum" "$work/"
chmod u+w "$work/go.mod" "$work/go.sum"
cd "$work"
go mod edit -module sluice-vault-build
# Vault's go.mod points its api and sdk modules at folders of its own repository
# (./api, ./sdk, ./api/auth/...); drop those so the published versions are used.
sed -n -E 's/^replace[[:space:]]+([^[:space:]]+)[[:space:]]+=>[[:space:]]+\.\/.*/\1/p' go.mod | while read -r mod; do
  go mod edit -dropreplace="$mod"
done
go mod edit -require="github.com/hashicorp/vault@$VAULT_VERSION"
GOFLAGS=-mod=mod go build -trimpath -o "$OUT.tmp" github.com/hashicorp/vault
mv "$OUT.tmp" "$OUT"
echo "$OUT"
