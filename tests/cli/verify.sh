#!/usr/bin/env bash
# recur verify passes every mode on the nine reference models shipped in the repo (Qwen3-Next,
# Qwen3.5 and Kimi-Linear; kimi-linear-var and kimi-linear-bf16 are shapes no other test uses,
# made by scripts/make_kimi_references.py), and fails
# (non-zero) when the tolerance is impossibly tight, when any logit, ours or the reference's,
# is NaN or infinite, and when the reference names ids outside the vocabulary; with the attention
# cache in bf16, f16 and fp8 (--kv-cache-dtype) it stays within bounds on the 48-layer models.
set -euo pipefail
recur="$1"; root="$2"
for m in qwen3next-tiny qwen3next-seed-48L qwen3next-tiny-realvocab qwen3_5-tiny qwen3_5-seed-48L \
    qwen3_5-moe-tiny kimi-linear-tiny kimi-linear-var kimi-linear-bf16; do
  out=$("$recur" verify --model "$root/models/$m" --golden "$root/tests/data/golden/$m/golden.safetensors")
  echo "$out" | tail -1 | sed "s/^/$m: /"
  for mode in whole chunks17 token decode; do
    grep -q " $mode " <<<"$out" || { echo "$m: mode $mode missing"; exit 1; }
  done
done
if "$recur" verify --model "$root/models/qwen3next-tiny" \
    --golden "$root/tests/data/golden/qwen3next-tiny/golden.safetensors" --tolerance 1e-9 >/dev/null; then
  echo "verify passed with tolerance 1e-9: the comparison cannot fail"; exit 1
fi
# The attention cache in bf16, f16 and fp8 (--kv-cache-dtype): 1/2, 1/2 and 1/4 of the f32
# cache's bytes per token, at errors far below a misread cache's (measured on the CPU: bf16
# 2.4e-3 / 2.2e-3 / 6.5e-3, f16 4.5e-4 / 3.7e-4 / 1.1e-3, fp8 0.22 / 0.027 on the 48-layer ones;
# bench/kv_cache_report.sh gives them all). f16's 2e-3 is under bf16's errors: an f16 cache
# rounded as bf16 fails it.
for m in qwen3next-seed-48L qwen3_5-seed-48L kimi-linear-tiny; do
  golden="$root/tests/data/golden/$m/golden.safetensors"
  f32=$("$recur" verify --model "$root/models/$m" --golden "$golden" | sed -n 's/^attention cache: F32, \([0-9]*\) bytes per token$/\1/p')
  for t in bf16:BF16:2:0.05 f16:F16:2:2e-3 fp8:F8_E4M3:4:0.5; do
    IFS=: read -r flag name div tol <<<"$t"
    [ "$m" = kimi-linear-tiny ] && [ "$flag" = fp8 ] && continue  # random latent: 1.9 (see README)
    out=$("$recur" verify --model "$root/models/$m" --golden "$golden" --kv-cache-dtype "$flag" --tolerance "$tol") ||
      { echo "$m --kv-cache-dtype $flag:"; echo "$out"; exit 1; }
    grep -q "^attention cache: $name, $((f32 / div)) bytes per token$" <<<"$out" ||
      { echo "$m --kv-cache-dtype $flag: not $((f32 / div)) bytes per token"; echo "$out"; exit 1; }
    echo "$out" | tail -1 | sed "s/^/$m --kv-cache-dtype $flag: /"
  done
  "$recur" verify --model "$root/models/$m" --golden "$golden" --kv-cache-dtype fp8 --report | tail -1 |
    grep -q "kv_cache=F8_E4M3$" || { echo "$m: no fp8 report line"; exit 1; }
done
# Tensor parallelism (in-process ranks on the CPU): the references pass at the default 1e-3
# over 2 ranks, and over 4 where their heads split that far; heads that do not split are
# refused with an error (exit 2) that says why.
for t in qwen3next-tiny:4 qwen3next-seed-48L:2 qwen3next-tiny-realvocab:2 qwen3_5-tiny:4 \
    qwen3_5-seed-48L:2 qwen3_5-moe-tiny:4 qwen3next-fp8-tiny:4 kimi-linear-tiny:2; do
  IFS=: read -r m most <<<"$t"
  for n in 2 4; do
    [ "$n" -gt "$most" ] && continue
    out=$("$recur" verify --model "$root/models/$m" --golden "$root/tests/data/golden/$m/golden.safetensors" \
          --tensor-parallel "$n" --threads 2) || { echo "$m --tensor-parallel $n:"; echo "$out"; exit 1; }
    echo "$out" | tail -1 | grep -q "PASS$" || { echo "$m --tensor-parallel $n: $out"; exit 1; }
    echo "$out" | tail -1 | sed "s/^/$m --tensor-parallel $n: /"
  done
done
for t in "qwen3next-seed-48L:4:2 value heads, which do not divide among 4 ranks" \
    "kimi-linear-var:2:Kimi Delta Attention has 3 heads, which do not divide among 2 ranks"; do
  IFS=: read -r m n why <<<"$t"
  rc=0
  out=$("$recur" verify --model "$root/models/$m" --golden "$root/tests/data/golden/$m/golden.safetensors" \
        --tensor-parallel "$n" 2>&1) || rc=$?
  [ "$rc" = 2 ] && grep -q "$why" <<<"$out" || {
    echo "$m --tensor-parallel $n: exit status $rc, expected 2 and '$why':"; echo "$out"; exit 1; }
done

# A golden file that is not one gives a clear error and a non-zero status.
if "$recur" verify --model "$root/models/qwen3next-tiny" --golden "$root/models/qwen3next-tiny/config.json" 2>/dev/null; then
  echo "verify accepted a non-safetensors golden file"; exit 1
fi
# The verdict is the last line, against the tolerance.
out=$("$recur" verify --model "$root/models/qwen3next-tiny" \
      --golden "$root/tests/data/golden/qwen3next-tiny/golden.safetensors")
echo "$out" | tail -1 | grep -q "^max_abs_err=.* tolerance=1.0e-03 PASS$" || {
  echo "verify: last line is not a PASS verdict: $(echo "$out" | tail -1)"; exit 1; }

# Any NaN or infinity fails, in our logits or in the reference (std::max would drop a NaN
# and report the error of the other values). Broken copies of the tiny model and of its
# reference's first prompt:
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
edit="$root/tests/cli/safetensors_edit.py"
tiny="$root/models/qwen3next-tiny"
p0="$tmp/p0.safetensors"
python3 "$edit" "$root/tests/data/golden/qwen3next-tiny/golden.safetensors" "$p0" --keep p0.
broken_model() {  # NAME [safetensors_edit.py options]: a copy of the tiny model
  local dir="$tmp/$1"; shift
  mkdir -p "$dir"
  cp "$tiny/config.json" "$tiny/generation_config.json" "$dir/"
  python3 "$edit" "$tiny/model.safetensors" "$dir/model.safetensors" "$@"
  echo "$dir"
}
expect_fail() {  # NAME STATUS PATTERN MODEL GOLDEN
  local out rc=0
  out=$("$recur" verify --model "$4" --golden "$5" 2>&1) || rc=$?
  [ "$rc" = "$2" ] || { echo "$1: exit status $rc, expected $2:"; echo "$out"; exit 1; }
  grep -q -- "$3" <<<"$out" || { echo "$1: output lacks '$3':"; echo "$out"; exit 1; }
  tail -1 <<<"$out" | grep -q "FAIL$" || [ "$2" = 2 ] || { echo "$1: no FAIL verdict"; exit 1; }
}
"$recur" verify --model "$tiny" --golden "$p0" >/dev/null || { echo "p0 alone does not pass"; exit 1; }
expect_fail nan-weights 1 "FAIL: our logit 0 at prompt token 0 is nan" \
  "$(broken_model nan --fill model.embed_tokens.weight nan)" "$p0"
expect_fail inf-weights 1 "FAIL: our logit 0 at prompt token 0 is \(nan\|inf\|-inf\)" \
  "$(broken_model inf --fill model.embed_tokens.weight inf)" "$p0"
one_nan=$(broken_model one-nan --set model.embed_tokens.weight 5 nan)
expect_fail one-nan-weight 1 "is nan" "$one_nan" "$p0"
eps="$(broken_model eps)"
python3 - "$eps/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["rms_norm_eps"] = -1
json.dump(c, open(sys.argv[1], "w"))
PY
# rms_norm_eps = -1: NaN logits, unless the config is refused first (exit 2, an error).
out=$("$recur" verify --model "$eps" --golden "$p0" 2>&1) && { echo "eps=-1: verify passed"; echo "$out"; exit 1; }
grep -q "is nan\|is inf\|is -inf\|error:" <<<"$out" || { echo "eps=-1: $out"; exit 1; }
python3 "$edit" "$p0" "$tmp/ref-nan.safetensors" --set p0.logits 3 nan
expect_fail ref-nan 1 "FAIL: the reference logit 3 at prompt token 0 is nan" "$tiny" "$tmp/ref-nan.safetensors"
python3 "$edit" "$p0" "$tmp/ref-inf.safetensors" --set p0.gen_logits 261 inf
expect_fail ref-inf 1 "FAIL: the reference logit 5 at decode step 1 is inf" "$tiny" "$tmp/ref-inf.safetensors"
# Reference ids are input too: checked against the vocabulary before anything is run.
python3 "$edit" "$p0" "$tmp/bad-id.safetensors" --set p0.ids 0 999999
expect_fail bad-id 2 "p0.ids\[0\] = 999999 is outside the vocabulary \[0, 256)" "$tiny" "$tmp/bad-id.safetensors"
# A tolerance that no error can be compared with is refused by name.
for t in nan inf -1; do
  out=$("$recur" verify --model "$tiny" --golden "$p0" --tolerance "$t" 2>&1) && { echo "--tolerance $t accepted"; exit 1; }
  grep -q -- "--tolerance: must be a finite number >= 0, got $t" <<<"$out" || { echo "--tolerance $t: $out"; exit 1; }
done
# Prompts are numbered from 0 without gaps: p1 gone leaves p2.. that would go unchecked; a file
# without p0 has no prompts. Both are errors, never a PASS over what is left.
python3 "$edit" "$root/tests/data/golden/qwen3next-tiny/golden.safetensors" "$tmp/gap.safetensors" \
  --keep p0. --keep p2. --keep p3.
expect_fail prompt-gap 2 "p2.gen belongs to prompt 2, but prompt 1 has no p1.ids" "$tiny" "$tmp/gap.safetensors"
python3 "$edit" "$p0" "$tmp/none.safetensors" --keep q
expect_fail no-prompts 2 "error: no prompts (p0.ids, ...) in" "$tiny" "$tmp/none.safetensors"
echo "verify: ok"
