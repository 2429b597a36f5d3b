#!/usr/bin/env bash
# Installs the Debian 12 packages recur builds and tests with; installs only what is missing.
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev libcpp-httplib-dev libpcre2-dev libutf8proc-dev libcli11-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libhwy-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
