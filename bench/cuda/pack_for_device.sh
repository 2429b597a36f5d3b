#!/usr/bin/env bash
# Packs the CUDA build for the device machine (no package registry, no build of ours there):
# build-cuda/recur and the CUDA test binary, stripped, with the shared libraries they load that
# the device image lacks, as .devbin/bins.tar.xz (git-ignored; carry .devbin with the run).
# cuBLAS, the CUDA runtime and NCCL come from the image's PyTorch packages; bench/cuda/device_env.sh
# unpacks the rest and sets the library path there.
# Usage: bench/cuda/pack_for_device.sh [build dir, default build-cuda]
set -euo pipefail
build=${1:-build-cuda}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
ninja -C "$build" recur tests/test_cuda >/dev/null
mkdir -p "$stage/lib" .devbin
cp "$build/recur" "$build/tests/test_cuda" "$stage/"
strip "$stage/recur" "$stage/test_cuda"
# Every library but the C/C++ runtime, the driver and what the image's PyTorch brings.
ldd "$build/recur" "$build/tests/test_cuda" | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*|libcuda)\.so' |
  grep -Ev '/lib(cublas|cublasLt|cudart|nccl)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
strip --strip-unneeded "$stage"/lib/*.so* 2>/dev/null || true
(cd "$stage" && tar cf - ./* | xz -9e -T2 > "$OLDPWD/.devbin/bins.tar.xz")
ls -l .devbin/bins.tar.xz
