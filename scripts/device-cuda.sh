#!/usr/bin/env bash
# Runs on the GPU machine over a build made here with `cmake --preset cuda`: the CUDA op tests,
# verify on the three reference models, the engine invariants on CUDA, the benchmark of the
# published 80B configuration cut to 6 layers, and transformers' baseline in the same session.
# Usage (device): scripts/device-cuda.sh OUTDIR [quick]
set -uo pipefail
out="${1:-/tmp/out}"; mode="${2:-full}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
b="${RECUR_BIN:-build-cuda}"
nvidia-smi -L | tee "$out/gpu.txt"
{ $b/${RECUR_TESTS:-tests/}test_cuda --gtest_filter=-*Bench* 2>&1 | tail -30; } | tee "$out/test_cuda.txt"
for m in qwen3next-tiny qwen3next-seed-48L qwen3next-tiny-realvocab; do
  $b/recur verify --device cuda --tolerance 2e-3 --model models/$m \
    --golden tests/data/golden/$m/golden.safetensors 2>&1 | tee "$out/verify_$m.txt" | tail -1
done
[ "$mode" = quick ] && exit 0
RECUR_TEST_DEVICE=cuda $b/${RECUR_TESTS:-tests/}test_engine --gtest_filter='Engine*' 2>&1 | tail -15 | tee "$out/test_engine_cuda.txt"
$b/recur bench --config configs/qwen3-next-80b-a3b-instruct.json --random-weights --layers 6 \
  --device cuda --batch 1,16,64 --prompt-len 2048 --gen-len 64 2>&1 | tee "$out/bench_recur.json"
PYTHONUNBUFFERED=1 timeout 300 python3 bench/hf_gpu_baseline.py \
  --config configs/qwen3-next-80b-a3b-instruct.json --layers 6 2>&1 | tail -5 | tee "$out/bench_hf.json"
