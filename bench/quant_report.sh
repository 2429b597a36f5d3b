#!/usr/bin/env bash
# The accuracy of each quantized format on the shipped references: `recur verify --quantize F
# --report` per model, as the markdown tables README.md shows.
#   bench/quant_report.sh [build/recur]
set -euo pipefail
recur="${1:-build/recur}"
root="$(cd "$(dirname "$0")/.." && pwd)"
models="qwen3next-seed-48L qwen3_5-seed-48L qwen3next-tiny qwen3_5-tiny qwen3_5-moe-tiny qwen3next-tiny-realvocab"
for q in fp8 int8 q4; do
  echo "--quantize $q"
  echo
  echo "| model | max abs error | KL mean | KL max | top-1 agreement |"
  echo "| --- | --- | --- | --- | --- |"
  for m in $models; do
    line=$("$recur" verify --model "$root/models/$m" --golden "$root/tests/data/golden/$m/golden.safetensors" \
           --quantize "$q" --report | tail -1)
    err=$(sed -n 's/.*max_abs_err=\([^ ]*\).*/\1/p' <<<"$line")
    klm=$(sed -n 's/.*kl_mean=\([^ ]*\).*/\1/p' <<<"$line"); klx=$(sed -n 's/.*kl_max=\([^ ]*\).*/\1/p' <<<"$line")
    top=$(sed -n 's/.*top1=\([^ ]*\) (\(.*\)).*/\1 (\2)/p' <<<"$line")
    echo "| $m | $(printf %.3g "$err") | ${klm:-n/a} | ${klx:-n/a} | $top |"
  done
  echo
done
