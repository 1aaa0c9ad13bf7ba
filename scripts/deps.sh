#!/usr/bin/env bash
# Installs the Debian packages the test suite uses when they are missing:
# curl (clients inside the launcher's sandbox), bubblewrap (the launcher
# benchmark's comparison), iproute2 and procps (inspecting namespaces and
# processes), python3 (small helper servers in the launcher tests). Needs root on Debian; does nothing when all are present.
set -euo pipefail
need=()
for pkg_cmd in curl:curl bubblewrap:bwrap iproute2:ip procps:ps python3:python3; do
  pkg=${pkg_cmd%%:*} cmd=${pkg_cmd##*:}
  command -v "$cmd" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "deps: missing ${need[*]}; install them (as root: apt-get install ${need[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
