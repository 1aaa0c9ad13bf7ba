# Read-only access to the KV v2 secrets sluice injects; nothing else.
path "secret/data/ci/*" {
  capabilities = ["read"]
}
