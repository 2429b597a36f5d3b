#!/usr/bin/env bash
# The main job on the model shipped in the repo: check it against transformers' reference
# logits, then serve it over HTTP (OpenAI and Anthropic APIs) until Ctrl-C / SIGTERM.
#   HOST=0.0.0.0 PORT=9000 make run    # to listen elsewhere
set -euo pipefail
model="${1:-models/qwen3next-tiny-realvocab}"
host="${HOST:-127.0.0.1}"
port="${PORT:-8080}"
name=$(basename "$model")
golden="tests/data/golden/$name/golden.safetensors"
if [ -f "$golden" ]; then
  echo "== recur verify --model $model"
  build/recur verify --model "$model" --golden "$golden" | tail -n 1
fi
echo "== recur serve --model $model --host $host --port $port"
exec build/recur serve --model "$model" --host "$host" --port "$port"
