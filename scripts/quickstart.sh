#!/usr/bin/env bash
# Runs sluice on the quickstart example. On first run it creates, under
# examples/quickstart/state/ (never committed): an interception CA, a token
# key, a demo secrets file for the `file` source, and a sandbox token. Then it
# prints how to send a request through the proxy and starts `sluice serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${SLUICE_BIN:-bin/sluice}
[ -x "$BIN" ] || go build -o "$BIN" ./cmd/sluice
EX=examples/quickstart
ST=$EX/state
mkdir -p "$ST" && chmod 700 "$ST"

[ -f "$ST/ca.pem" ] || "$BIN" ca init --cert "$ST/ca.pem" --key "$ST/ca-key.pem"
[ -f "$ST/token.key" ] || "$BIN" token keygen --key "$ST/token.key"
if [ ! -f "$ST/secrets.yaml" ]; then
  umask 077
  # A stand-in value: put a real token here (or use the vault source) to call
  # the real API. The sandbox never sees it either way.
  printf 'github: demo-not-a-real-token\n' >"$ST/secrets.yaml"
fi
[ -f "$ST/ca-bundle.pem" ] || "$BIN" ca bundle --cert "$ST/ca.pem" --out "$ST/ca-bundle.pem"
TOKEN=$("$BIN" token mint --key "$ST/token.key" --tenant demo --sandbox quickstart --ttl 24h)

cat <<MSG

  Sluice quickstart — proxy on 127.0.0.1:3128, admin on 127.0.0.1:9090,
  audit log in $ST/audit.jsonl. In another terminal:

    export https_proxy=http://demo:$TOKEN@127.0.0.1:3128 http_proxy=\$https_proxy
    curl --cacert $ST/ca-bundle.pem https://pypi.org/simple/ -o /dev/null -w '%{http_code}\n'   # allowed
    curl -i https://example.com/                                                          # denied: not_allowlisted
    curl --cacert $ST/ca-bundle.pem https://api.github.com/user                            # key injected by sluice
    $BIN rules test --config $EX/sluice.yaml --tenant demo GET https://gist.github.com/
    $BIN logs --config $EX/sluice.yaml

MSG
exec "$BIN" serve --config "$EX/sluice.yaml"
