#!/usr/bin/env bash
# Packs the CUDA build for the device machine (no package registry, no build of ours there):
# build-cuda/recur and the CUDA test binary, stripped, with the shared libraries they load that
# the device image lacks and libcrash_stack.so (bench/cuda/crash_stack.cpp), as
# .devbin/bins.tar.xz (git-ignored; carry .devbin with the run).
# cuBLAS, the CUDA runtime and NCCL come from the image's PyTorch packages; bench/cuda/device_env.sh
# unpacks the rest and sets the library path there.
# Usage: bench/cuda/pack_for_device.sh [--all-tests] [build dir, default build-cuda]
#   --all-tests: test_model and test_engine too (RECUR_TEST_DEVICE=cuda runs them on the GPU).
set -euo pipefail
bins=(recur tests/test_cuda)
if [ "${1:-}" = --all-tests ]; then
  bins+=(tests/test_model tests/test_engine)
  shift
fi
build=${1:-build-cuda}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
ninja -C "$build" "${bins[@]}" crash_stack >/dev/null
# An object whose headers ninja never recorded is not rebuilt when a header changes. Session 52
# found four compiled against an older CudaOps::Impl (its members at other offsets) beside the
# rest, which crashed the profile tests inside cuLaunchKernelEx: refuse to pack such a build.
unrecorded=$(ninja -C "$build" -t deps | grep -E '\.o: #deps 0,' || true)
if [ -n "$unrecorded" ]; then
  echo "objects with no recorded headers (rebuild them: ninja -C $build -t clean, then build):" >&2
  echo "$unrecorded" >&2
  exit 1
fi
mkdir -p "$stage/lib" .devbin
for b in "${bins[@]}"; do
  cp "$build/$b" "$stage/"
  strip "$stage/$(basename "$b")"
done
# Every library but the C/C++ runtime, the driver and what the image's PyTorch brings.
(cd "$build" && ldd "${bins[@]}") | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*|libcuda)\.so' |
  grep -Ev '/lib(cublas|cublasLt|cudart|nccl)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
cp "$build/bench/libcrash_stack.so" "$stage/lib/"  # LD_PRELOAD it there to see where a crash is
strip --strip-unneeded "$stage"/lib/*.so* 2>/dev/null || true
(cd "$stage" && tar cf - ./* | xz -9e -T2 > "$OLDPWD/.devbin/bins.tar.xz")
ls -l .devbin/bins.tar.xz
# What a run carries: the tracked tree (as it is in the working tree) and .devbin, at most 64 MiB.
# (Files moved out for a call are missing: du counts the rest and fails, which is no error here.)
tracked=$({ git ls-files -z | xargs -0 du -cb 2>/dev/null || true; } | tail -1 | cut -f1)
devbin=$(du -sb .devbin | cut -f1)
echo "a run would carry $(((tracked + devbin) >> 20)) MiB (tracked $((tracked >> 20)), .devbin $((devbin >> 20)))"
if (((tracked + devbin) >> 20 >= 64)); then
  echo "over 64 MiB: move the largest test models out for the call, e.g." \
    "models/qwen3next-tiny-realvocab and models/qwen3next-seed-48L"
fi
