#!/usr/bin/env bash
# The accuracy of each attention-cache type on the shipped references: `recur verify
# --kv-cache-dtype T --report` per model, as the markdown table README.md shows.
#   bench/kv_cache_report.sh [build/recur] [extra verify flags, e.g. --device cuda]
set -euo pipefail
recur="${1:-build/recur}"
shift || true
root="$(cd "$(dirname "$0")/.." && pwd)"
models="qwen3next-seed-48L qwen3_5-seed-48L qwen3next-tiny qwen3_5-tiny qwen3_5-moe-tiny \
qwen3next-tiny-realvocab kimi-linear-tiny kimi-linear-var kimi-linear-bf16"
echo "| model | cache | max abs error | KL mean | KL max | top-1 agreement |"
echo "| --- | --- | --- | --- | --- | --- |"
for m in $models; do
  for t in f32 bf16 f16 fp8; do
    line=$("$recur" verify --model "$root/models/$m" --golden "$root/tests/data/golden/$m/golden.safetensors" \
           --kv-cache-dtype "$t" --report "$@" | tail -1)
    err=$(sed -n 's/.*max_abs_err=\([^ ]*\).*/\1/p' <<<"$line")
    klm=$(sed -n 's/.*kl_mean=\([^ ]*\).*/\1/p' <<<"$line"); klx=$(sed -n 's/.*kl_max=\([^ ]*\).*/\1/p' <<<"$line")
    top=$(sed -n 's/.*top1=\([^ ]*\) (\([^)]*\)).*/\1 (\2)/p' <<<"$line")
    echo "| $m | $t | $(printf %.3g "$err") | ${klm:-n/a} | ${klx:-n/a} | $top |"
  done
done
