#!/usr/bin/env bash
# On the GPU machine: recur serve --device cuda and --device cpu answer the same greedy chat request and
# 16 concurrent greedy streams identically; SIGTERM exits 0. Usage (device): OUT=dir scripts/device-serve.sh
set -u; export LD_LIBRARY_PATH=$PWD/.devlibs; B=${RECUR_BIN:-.devbin-srv}/recur; M=models/qwen3next-tiny-realvocab
nvidia-smi -L; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
for dev in cuda cpu; do
  port=18080; [ $dev = cpu ] && port=18081
  $B serve --model $M --device $dev --port $port > $OUT/serve_$dev.log 2>&1 & pid=$!
  for i in $(seq 120); do curl -sf 127.0.0.1:$port/health >/dev/null && break; sleep 0.5; done
  timeout 120 python3 bench/serve_device_check.py $port $OUT/out_$dev.json; echo "client $dev rc=$?"
  kill -TERM $pid; wait $pid; echo "serve $dev exit status $?"
done
python3 - <<'PY'
import json, os
a = json.load(open(os.environ["OUT"] + "/out_cuda.json")); b = json.load(open(os.environ["OUT"] + "/out_cpu.json"))
print("chat equal:", a["chat"] == b["chat"]); print("cuda chat:", json.dumps(a["chat"])[:300])
eq = [x == y for x, y in zip(a["streams"], b["streams"])]
print("streams equal:", sum(eq), "of", len(eq)); print("cuda metrics after:", a["metrics"])
PY
tail -3 $OUT/serve_cuda.log
