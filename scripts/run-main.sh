#!/usr/bin/env bash
# The main job on the model shipped in the repo: check it against transformers' reference
# logits, then serve it over HTTP (OpenAI and Anthropic APIs) until Ctrl-C / SIGTERM.
#   HOST=0.0.0.0 PORT=9000 make run    # to listen elsewhere
#   DEVICE=cuda RECUR=build-cuda/recur make run   # serve on the GPU (the cuda preset's build)
set -euo pipefail
model="${1:-models/qwen3next-tiny-realvocab}"
host="${HOST:-127.0.0.1}"
port="${PORT:-8080}"
device="${DEVICE:-cpu}"
recur="${RECUR:-build/recur}"
name=$(basename "$model")
golden="tests/data/golden/$name/golden.safetensors"
if [ -f "$golden" ]; then
  echo "== recur verify --model $model"
  "$recur" verify --model "$model" --golden "$golden" | tail -n 1  # on the CPU
fi
echo "== recur serve --model $model --host $host --port $port --device $device"
exec "$recur" serve --model "$model" --host "$host" --port "$port" --device "$device"
