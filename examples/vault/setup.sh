#!/usr/bin/env bash
# Prepares a Vault server (VAULT_ADDR, VAULT_TOKEN with admin rights) for
# examples/vault/sluice.yaml: KV v2 secrets, a read-only policy, an AppRole
# with short-lived renewable tokens, and a response-wrapped secret id written
# to vault/secret-id next to vault/role-id (both mode 0600).
# Values are read from the environment so they never appear on a command line.
set -euo pipefail
cd "$(dirname "$0")"
: "${VAULT_ADDR:?set VAULT_ADDR}" "${VAULT_TOKEN:?set VAULT_TOKEN}"
: "${GITHUB_TOKEN:?set GITHUB_TOKEN to the token sluice should inject}"
: "${OPENAI_API_KEY:?set OPENAI_API_KEY to the key sluice should inject}"

vault kv put secret/ci/github token=- <<<"$GITHUB_TOKEN" >/dev/null
vault kv put secret/ci/openai api_key=- <<<"$OPENAI_API_KEY" >/dev/null
vault policy write sluice-read sluice-policy.hcl >/dev/null
vault auth list -format=json | grep -q '"approle/"' || vault auth enable approle >/dev/null
vault write auth/approle/role/sluice token_policies=sluice-read token_ttl=1h token_max_ttl=24h >/dev/null

umask 077
mkdir -p vault
vault read -field=role_id auth/approle/role/sluice/role-id > vault/role-id
# A wrapping token is single-use: sluice unwraps it at its first login. Re-run
# this line (or let Vault Agent do it) before sluice needs to log in again.
vault write -wrap-ttl=10m -field=wrapping_token -f auth/approle/role/sluice/secret-id > vault/secret-id
echo "wrote $(pwd)/vault/role-id and $(pwd)/vault/secret-id"
