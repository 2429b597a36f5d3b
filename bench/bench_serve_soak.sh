#!/usr/bin/env bash
# Soak test of `recur serve` (not part of CI): 64 concurrent streaming clients with random
# prompt/output lengths, a share of them cancelled at random mid-stream, for DURATION seconds;
# then /metrics must be back to idle (slots and blocks 0, live buffers at the idle count) and
# every request accounted for. Exits non-zero otherwise.
#   bench/bench_serve_soak.sh [DURATION_S=120] [BUILD_DIR=build] [extra bench_serve options]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
duration="${1:-120}"
build="${2:-$root/build}"
shift $(( $# > 2 ? 2 : $# ))
exec "$build/bench/bench_serve" --recur "$build/recur" --soak "$duration" --clients 64 \
  --prompt-tokens 64 --output-tokens 256 --cancel-prob 0.25 "$@"
