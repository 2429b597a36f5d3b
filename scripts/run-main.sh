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
  # On the CPU. The last line is the verdict against the tolerance: PASS, or FAIL and then
  # every line, so that the failing prompt and mode show; a FAIL stops here.
  echo "== recur verify --model $model (logits against transformers')"
  if ! out=$("$recur" verify --model "$model" --golden "$golden" 2>&1); then
    echo "$out"
    echo "== verify: FAIL; not serving a model whose logits disagree with transformers'" >&2
    exit 1
  fi
  echo "$out" | tail -n 1
fi
echo "== recur serve --model $model --host $host --port $port --device $device"
exec "$recur" serve --model "$model" --host "$host" --port "$port" --device "$device"
