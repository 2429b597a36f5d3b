#!/usr/bin/env bash
# Installs the Debian 12 packages recur builds and tests with; installs only what is missing.
# Then the npm packages of the server's end-to-end tests (tests/server), when not yet there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
packages=(build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev libpcre2-dev libutf8proc-dev libcli11-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libhwy-dev
  python3-dev pybind11-dev python3-pytest python3-pip python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js runs the server tests with the official OpenAI and Anthropic SDKs; one already on the
# PATH is kept.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
server_tests="$root/tests/server"
if [ ! -f "$server_tests/node_modules/openai/package.json" ] ||
  [ ! -f "$server_tests/node_modules/@anthropic-ai/sdk/package.json" ] ||
  [ ! -f "$server_tests/node_modules/tiktoken/package.json" ]; then
  echo "installing the server tests' npm packages (npm ci in tests/server)"
  (cd "$server_tests" && npm ci --no-audit --no-fund --loglevel=error)
fi
