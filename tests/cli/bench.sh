#!/usr/bin/env bash
# recur bench on the CPU: the JSON carries every figure it promises, finite and positive, for
# both decode ways (synchronous fixed ids, and the pipelined greedy decode with its picks),
# from a model directory and from a config with random weights, and for decode at given
# contexts; bad options fail clearly.
set -euo pipefail
recur="$1"; root="$2"
check() {
  python3 - "$1" "$2" <<'PY'
import json, math, sys
out, batches = json.loads(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
def pos(x, what):
    assert isinstance(x, (int, float)) and math.isfinite(x) and x > 0, f"{what}: {x!r}"
for key in ("copy_bandwidth_gb_s", "prefill_tok_s", "prefill_tflop_s", "weight_bytes"):
    pos(out[key], key)
assert [d["batch"] for d in out["decode"]] == batches, out["decode"]
for d in out["decode"]:
    for key in ("tok_s", "step_ms", "weight_bytes_per_step", "achieved_bandwidth_gb_s",
                "fraction_of_copy_bandwidth"):
        pos(d[key], f"b{d['batch']} {key}")
    p = d["greedy_pipelined"]
    for key in ("tok_s", "step_ms", "steps", "achieved_bandwidth_gb_s"):
        pos(p[key], f"b{d['batch']} greedy_pipelined {key}")
    assert 1 <= p["distinct_ids_per_step"] <= d["batch"], p
print("bench:", " ".join(f"b{d['batch']} {d['tok_s']:.0f}/{d['greedy_pipelined']['tok_s']:.0f} tok/s"
                         for d in out["decode"]))
PY
}
out=$("$recur" bench --model "$root/models/qwen3next-tiny-realvocab" --batch 1,3 --prompt-len 24 --gen-len 6 --threads 2)
check "$out" 1,3
# Over 2 tensor-parallel ranks, from a directory and from random weights, said in the JSON.
for src in "--model $root/models/qwen3next-tiny" \
    "--config $root/models/qwen3_5-moe-tiny/config.json --random-weights"; do
  # shellcheck disable=SC2086
  out=$("$recur" bench $src --batch 1,2 --prompt-len 16 --gen-len 5 --threads 2 --tensor-parallel 2)
  check "$out" 1,2
  python3 -c 'import json,sys; assert json.loads(sys.argv[1])["tensor_parallel"] == 2' "$out"
done
out=$("$recur" bench --config "$root/models/qwen3next-tiny/config.json" --random-weights --layers 2 --batch 2 --prompt-len 8 --gen-len 5 --threads 2)
check "$out" 2
# --quantize: random weights quantized as a checkpoint's would be; the CPU's read bandwidth and
# each decode's fraction of it; the weights take fewer bytes than bf16's.
q4=$("$recur" bench --config "$root/models/qwen3next-tiny/config.json" --random-weights --layers 2 --batch 2 --prompt-len 8 --gen-len 5 --threads 2 --quantize q4)
check "$q4" 2
python3 - "$out" "$q4" <<'PY'
import json, sys
bf16, q4 = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert q4["quantize"] == "q4" and bf16["quantize"] == "none", (q4["quantize"], bf16["quantize"])
assert q4["read_bandwidth_gb_s"] > 0 and q4["read_bandwidth_threads"] == 2, q4
assert all(d["fraction_of_read_bandwidth"] > 0 for d in q4["decode"]), q4["decode"]
assert q4["weight_bytes"] < bf16["weight_bytes"], (q4["weight_bytes"], bf16["weight_bytes"])
PY
# --decode-contexts: batch-1 decode timed at each context, each step against the first's.
ctx=$("$recur" bench --model "$root/models/qwen3next-tiny" --batch 1 --prompt-len 8 --gen-len 5 --threads 2 --decode-contexts 40,120)
python3 - "$ctx" <<'PY'
import json, math, sys
rows = json.loads(sys.argv[1])["decode_at_context"]
assert [r["context"] for r in rows] == [40, 120], rows
for r in rows:
    for key in ("tok_s", "step_ms", "attention_cache_bytes_read", "attention_cache_gb_s"):
        assert math.isfinite(r[key]) and r[key] > 0, (key, r)
assert rows[0]["step_vs_first_context"] == 1.0, rows[0]
ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
assert abs(rows[1]["step_vs_first_context"] - ratio) < 1e-9 * ratio, (rows[1], ratio)
assert rows[1]["attention_cache_bytes_read"] > rows[0]["attention_cache_bytes_read"], rows
PY
if "$recur" bench --model "$root/models/qwen3next-tiny" --gen-len 3 2>/dev/null; then
  echo "bench accepted --gen-len 3 (fewer steps than its warm-up)"; exit 1
fi
if "$recur" bench --model "$root/models/qwen3next-tiny" --batch 1,x 2>/dev/null; then
  echo "bench accepted --batch 1,x"; exit 1
fi
for bad in "--dtype f64" "--gen-len 2000000000" "--threads -5"; do
  # shellcheck disable=SC2086  # the option and its value are two words
  if "$recur" bench --config "$root/configs/qwen3-next-cpu-bench.json" --random-weights $bad \
       2>/dev/null; then
    echo "bench accepted $bad"; exit 1
  fi
done
echo "bench: ok"
