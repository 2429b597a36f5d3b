#!/usr/bin/env bash
# Quantized weights end to end: the block-FP8 checkpoint (qwen3next-fp8-tiny, the released
# format) passes `recur verify` in every mode; corrupt FP8 checkpoints give errors that name the
# tensor or field; `--quantize fp8|int8|q4` on a bf16 reference reports its figures.
set -euo pipefail
recur="$1"; root="$2"
fp8="$root/models/qwen3next-fp8-tiny"
golden="$root/tests/data/golden/qwen3next-fp8-tiny/golden.safetensors"

out=$("$recur" verify --model "$fp8" --golden "$golden")
echo "$out" | tail -1 | sed "s/^/qwen3next-fp8-tiny: /"
for mode in whole chunks17 token decode; do
  grep -q " $mode " <<<"$out" || { echo "mode $mode missing"; exit 1; }
done
echo "$out" | tail -1 | grep -q "^max_abs_err=.* tolerance=1.0e-03 PASS$" || { echo "$out"; exit 1; }
# The weights are held as fp8 (1 byte each, scales aside), not widened: under half of bf16's.
mib=$(echo "$out" | sed -n 's/^weights: \([0-9.]*\) MiB.*/\1/p')
python3 -c "import sys; sys.exit(0 if $mib < 6.6 else 1)" || { echo "weights take $mib MiB"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# broken NAME EDIT...: a copy of the FP8 model with edits (python statements over `h`, the
# header dict, `body`, the tensors' bytes by name, and `config`).
broken() {
  local dir="$tmp/$1"; shift
  mkdir -p "$dir"
  cp "$fp8/generation_config.json" "$dir/"
  python3 - "$fp8" "$dir" "$@" <<'PY'
import json, struct, sys
src, dst, edits = sys.argv[1], sys.argv[2], sys.argv[3:]
data = open(f"{src}/model.safetensors", "rb").read()
n = struct.unpack("<Q", data[:8])[0]
h = json.loads(data[8:8 + n]); h.pop("__metadata__", None)
body = {k: bytearray(data[8 + n + e["data_offsets"][0]:8 + n + e["data_offsets"][1]]) for k, e in h.items()}
config = json.load(open(f"{src}/config.json"))
for e in edits:
    exec(e)
out, at = {}, 0
for k in h:
    out[k] = {"dtype": h[k]["dtype"], "shape": h[k]["shape"], "data_offsets": [at, at + len(body[k])]}
    at += len(body[k])
head = json.dumps(out).encode()
with open(f"{dst}/model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + b"".join(body[k] for k in h))
json.dump(config, open(f"{dst}/config.json", "w"))
PY
  echo "$dir"
}
expect_error() {  # NAME PATTERN MODEL
  local out rc=0
  out=$("$recur" verify --model "$3" --golden "$golden" 2>&1) || rc=$?
  [ "$rc" = 2 ] || { echo "$1: exit status $rc, expected 2:"; echo "$out"; exit 1; }
  grep -q -- "$2" <<<"$out" || { echo "$1: output lacks '$2':"; echo "$out"; exit 1; }
}
w=model.layers.0.mlp.experts.3.down_proj.weight
expect_error missing-scale "F8_E4M3 tensor '$w' has no block scales: tensor '${w}_scale_inv' is missing" \
  "$(broken missing "del h['${w}_scale_inv']; del body['${w}_scale_inv']")"
# [H, I] = [256, 192]: scales [2, 2]; one column short.
expect_error scale-shape "tensor '${w}_scale_inv' has shape \[2, 1\], expected \[2, 2\]" \
  "$(broken shape "h['${w}_scale_inv']['shape'] = [2, 1]; body['${w}_scale_inv'] = body['${w}_scale_inv'][:8]")"
norm=model.layers.1.input_layernorm.weight
expect_error fp8-norm "tensor '$norm' is F8_E4M3, but it is a vector weight" \
  "$(broken norm "h['$norm']['dtype'] = 'F8_E4M3'; body['$norm'] = body['$norm'][:len(body['$norm']) // 2]")"
expect_error nan "F8_E4M3 tensor '$w' holds NaN at row 1, column 5" \
  "$(broken nan "body['$w'][192 + 5] = 0xff")"
expect_error fmt "quantization_config: fmt \"e5m2\" is not supported" \
  "$(broken fmt "config['quantization_config']['fmt'] = 'e5m2'")"
expect_error method "quant_method 'gptq' is not supported" \
  "$(broken method "config['quantization_config']['quant_method'] = 'gptq'")"
expect_error block "weight_block_size \[128\] is not two positive integers" \
  "$(broken block "config['quantization_config']['weight_block_size'] = [128]")"
expect_error no-config "tensor 'model.layers.0.linear_attn.in_proj_qkvz.weight' is F8_E4M3, but config.json has no block-FP8 quantization_config" \
  "$(broken noconfig "del config['quantization_config']")"
expect_error scale-dtype "tensor '${w}_scale_inv' has dtype F8_E4M3" \
  "$(broken scaledtype "h['${w}_scale_inv']['dtype'] = 'F8_E4M3'; body['${w}_scale_inv'] = body['${w}_scale_inv'][:4]")"

# Scales in bf16 (as Qwen3.5's FP8 releases store them) read exactly as f32 ones: two copies
# whose f32 scales are rounded to bf16, one keeping them f32 and one storing them bf16, give the
# same logits (verify prints the same errors).
round_bf16="
import struct
for k in [k for k in h if k.endswith('_scale_inv')]:
    vals = struct.unpack(f'<{len(body[k]) // 4}f', body[k])
    hi = [struct.unpack('<I', struct.pack('<f', v))[0] for v in vals]
    hi = [(x + 0x7fff + ((x >> 16) & 1)) >> 16 for x in hi]
    if STORE_BF16:
        h[k]['dtype'] = 'BF16'; body[k] = bytearray(struct.pack(f'<{len(hi)}H', *hi))
    else:
        body[k] = bytearray(struct.pack(f'<{len(hi)}I', *[x << 16 for x in hi]))"
as_f32=$("$recur" verify --model "$(broken scales-f32 "STORE_BF16 = False" "$round_bf16")" --golden "$golden" --report)
as_bf16=$("$recur" verify --model "$(broken scales-bf16 "STORE_BF16 = True" "$round_bf16")" --golden "$golden" --report)
[ "$as_f32" = "$as_bf16" ] || { echo "bf16 scales differ from the same scales in f32:"; diff <(echo "$as_f32") <(echo "$as_bf16"); exit 1; }
[ "$as_f32" != "$("$recur" verify --model "$fp8" --golden "$golden" --report)" ] ||
  { echo "rounding the scales to bf16 changed nothing: the comparison proves nothing"; exit 1; }

# --quantize on a bf16 reference: figures (max error, KL, top-1), exit 0; a format name that
# does not exist is refused.
for q in fp8 int8 q4; do
  out=$("$recur" verify --model "$root/models/qwen3_5-moe-tiny" --quantize $q --report \
        --golden "$root/tests/data/golden/qwen3_5-moe-tiny/golden.safetensors")
  echo "$out" | tail -1 | sed "s/^/qwen3_5-moe-tiny --quantize $q: /"
  echo "$out" | tail -1 | grep -q "^report: max_abs_err=.* kl_mean=.* kl_max=.* top1=[0-9]*/312 " ||
    { echo "$out"; exit 1; }
  grep -q "^weights: .* MiB at load (--quantize $q)$" <<<"$out" || { echo "$out"; exit 1; }
  # Quantized, not exact: a tolerance of 1e-3 fails.
  if "$recur" verify --model "$root/models/qwen3_5-moe-tiny" --quantize $q \
      --golden "$root/tests/data/golden/qwen3_5-moe-tiny/golden.safetensors" >/dev/null; then
    echo "--quantize $q passed at 1e-3: nothing was quantized"; exit 1
  fi
done
if "$recur" verify --model "$fp8" --golden "$golden" --quantize q3 >/dev/null 2>&1; then
  echo "--quantize q3 accepted"; exit 1
fi
# --fp8-activations picks how a GPU's prompts feed FP8 products; the CPU multiplies f32
# activations either way, so f16 passes as the default did. Other names are refused by name.
"$recur" verify --model "$fp8" --golden "$golden" --fp8-activations f16 | tail -1 |
  grep -q "^max_abs_err=.* tolerance=1.0e-03 PASS$" || { echo "--fp8-activations f16 failed"; exit 1; }
out=$("$recur" verify --model "$fp8" --golden "$golden" --fp8-activations int8 2>&1) &&
  { echo "--fp8-activations int8 accepted"; exit 1; }
grep -q "fp8-activations.*e4m3.*f16" <<<"$out" || { echo "$out"; exit 1; }
echo "quantized: ok"
