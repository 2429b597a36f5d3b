#!/usr/bin/env bash
# recur verify passes every mode on the three reference models shipped in the repo, and fails
# (non-zero) when the tolerance is impossibly tight, so the check can fail.
set -euo pipefail
recur="$1"; root="$2"
for m in qwen3next-tiny qwen3next-seed-48L qwen3next-tiny-realvocab; do
  out=$("$recur" verify --model "$root/models/$m" --golden "$root/tests/data/golden/$m/golden.safetensors")
  echo "$out" | tail -1 | sed "s/^/$m: /"
  for mode in whole chunks17 token decode; do
    echo "$out" | grep -q " $mode " || { echo "$m: mode $mode missing"; exit 1; }
  done
done
if "$recur" verify --model "$root/models/qwen3next-tiny" \
    --golden "$root/tests/data/golden/qwen3next-tiny/golden.safetensors" --tolerance 1e-9 >/dev/null; then
  echo "verify passed with tolerance 1e-9: the comparison cannot fail"; exit 1
fi
# A golden file that is not one gives a clear error and a non-zero status.
if "$recur" verify --model "$root/models/qwen3next-tiny" --golden "$root/models/qwen3next-tiny/config.json" 2>/dev/null; then
  echo "verify accepted a non-safetensors golden file"; exit 1
fi
echo "verify: ok"
