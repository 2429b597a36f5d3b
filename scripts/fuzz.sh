#!/usr/bin/env bash
# Coverage-guided fuzzing of everything that reads untrusted bytes (tests/fuzz/fuzz_targets.h),
# with clang's libFuzzer under ASan and UBSan: scripts/fuzz.sh [SECONDS] [TARGET ...]
# (default: 60 s for each target). Inputs the fuzzer finds interesting go to
# build-fuzz/corpus/<target>; an input that fails a check or crashes is written to
# build-fuzz/artifacts/ and the script stops with its name. Add it to
# tests/fuzz/corpus/<target>/ as crash-<what> once fixed: test_fuzz replays it in every build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then  # every tests/fuzz/fuzz_NAME.cpp
  for f in tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp | sed 's/^fuzz_//')"); done
fi

command -v clang++ >/dev/null || {
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-dev
}
scripts/install-deps.sh
cmake --preset fuzz >/dev/null
cmake --build build-fuzz --target "${targets[@]/#/fuzz_}"

mkdir -p build-fuzz/artifacts
for t in "${targets[@]}"; do
  len_control=100  # libFuzzer's default: inputs grow slowly from a few bytes
  case "$t" in
    checkpoint) max_len=65536 ;;  # safetensors headers of the tiny models are ~30 KB
    template) max_len=8192 ;;
    # 48 operations of at most 7 bytes; long inputs from the start, since each runs slowly
    # (an engine and its requests) and short ones hold only a few operations
    engine) max_len=512 len_control=0 ;;
    *) max_len=4096 ;;
  esac
  mkdir -p "build-fuzz/corpus/$t"
  echo "== fuzz_$t: ${seconds} s"
  # Leaks are not this run's question (the ASan test preset covers them); a slow input is.
  ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
    "build-fuzz/tests/fuzz_$t" -max_total_time="$seconds" -max_len="$max_len" -timeout=10 \
    -len_control="$len_control" -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/artifacts/$t-" \
    "build-fuzz/corpus/$t" "tests/fuzz/corpus/$t"
done
