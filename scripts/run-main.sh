#!/usr/bin/env bash
# The main job on the model shipped in the repo: check it against transformers' reference
# logits, then generate from it.
set -euo pipefail
model="${1:-models/qwen3next-tiny-realvocab}"
name=$(basename "$model")
golden="tests/data/golden/$name/golden.safetensors"
if [ -f "$golden" ]; then
  echo "== recur verify --model $model"
  build/recur verify --model "$model" --golden "$golden"
fi
echo "== recur generate --model $model --prompt-ids 9707,11,1879 --max-tokens 16"
build/recur generate --model "$model" --prompt-ids 9707,11,1879 --max-tokens 16
