#!/usr/bin/env bash
# recur generate reproduces the greedy continuation that transformers computed (p1 of the
# tiny model's reference file), reports why each completion ended (warning first when
# --max-tokens runs past the context), and rejects bad ids with a clear error.
set -euo pipefail
recur="$1"; root="$2"
model="$root/models/qwen3next-tiny"
expected=$(python3 - "$root/tests/data/golden/qwen3next-tiny/golden.safetensors" <<'PY'
import json, struct, sys
data = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', data[:8])[0]
hdr = json.loads(data[8:8 + n])
def ids(key):
    b, e = hdr[key]['data_offsets']
    raw = data[8 + n + b: 8 + n + e]
    return list(struct.unpack('<%dq' % (len(raw) // 8), raw))
print(','.join(map(str, ids('p1.ids'))))
print(','.join(map(str, ids('p1.gen'))))
PY
)
prompt=$(echo "$expected" | sed -n 1p)
gen=$(echo "$expected" | sed -n 2p)
n=$(echo "$gen" | tr ',' '\n' | wc -l)
err=$(mktemp)
got=$("$recur" generate --model "$model" --prompt-ids "$prompt" --max-tokens "$n" 2>"$err")
[ "$got" = "$gen" ] || { echo "generate: got $got, expected $gen"; exit 1; }
# Over 2 and 4 tensor-parallel ranks (threads of the process): the same continuation.
for tp in 2 4; do
  got=$("$recur" generate --model "$model" --prompt-ids "$prompt" --max-tokens "$n" \
        --tensor-parallel "$tp" --threads "$tp" 2>/dev/null)
  [ "$got" = "$gen" ] || { echo "generate --tensor-parallel $tp: got $got, expected $gen"; exit 1; }
done
# Why it ended is reported beside the ids.
grep -q "^prompt 0: finish_reason=length (max_tokens reached), $n tokens$" "$err" || {
  echo "generate: no finish reason for --max-tokens:"; cat "$err"; exit 1; }
! grep -q "warning" "$err" || { echo "generate: unexpected warning:"; cat "$err"; exit 1; }

# --max-tokens past the context: a warning first, then the context ends the completion and
# the finish reason says so (the last token is sampled at the last position, never fed).
got=$("$recur" generate --model "$model" --prompt-ids 1,2,3 --max-tokens 50 --max-context 8 2>"$err")
grep -q "^warning: prompt 0: 3 prompt tokens + max tokens 50 exceed the 8-token context" "$err" || {
  echo "generate: no warning for --max-tokens past the context:"; cat "$err"; exit 1; }
grep -q "^prompt 0: finish_reason=length (the context length is reached), 6 tokens$" "$err" || {
  echo "generate: the context's end is not reported:"; cat "$err"; exit 1; }
[ "$(echo "$got" | tr ',' '\n' | wc -l)" = 6 ] || { echo "generate: got $got"; exit 1; }
printf '{"ids": [1, 2, 3], "max_tokens": 50}\n{"ids": [1], "max_tokens": 2}\n' >"$err.jsonl"
got=$("$recur" generate --model "$model" --prompts "$err.jsonl" --max-context 8 2>"$err")
python3 - "$got" <<'EOF' || { cat "$err"; exit 1; }
import json, sys
lines = [json.loads(l) for l in sys.argv[1].splitlines()]
assert [l["finish_reason"] for l in lines] == ["length", "length"], lines
assert [l.get("finish_detail") for l in lines] == ["the context length is reached",
                                                    "max_tokens reached"], lines
EOF
grep -q "^warning: prompt 0: 3 prompt tokens" "$err" && ! grep -q "prompt 1" "$err" || {
  echo "generate --prompts: warnings:"; cat "$err"; exit 1; }
rm -f "$err.jsonl"
if "$recur" generate --model "$model" --prompt-ids 1,99999 --max-tokens 2 2>"$err"; then
  echo "generate accepted a token id outside the vocabulary"; exit 1
fi
grep -q "outside the vocabulary" "$err" || { cat "$err"; exit 1; }
# --json-schema: the random real-vocabulary model writes a value of the schema, sampled too;
# a constraint the matcher does not follow is refused by name.
realvocab="$root/models/qwen3next-tiny-realvocab"
echo '{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
       "required": ["answer"], "additionalProperties": false}' >"$err.schema"
for t in 0 1; do
  text=$("$recur" generate --model "$realvocab" --prompt "Is it?" --max-tokens 200 --temperature "$t" \
         --json-schema "$err.schema" --text 2>"$err")
  python3 -c 'import json, sys; v = json.loads(sys.argv[1]); assert v["answer"] in ("yes", "no") and len(v) == 1, v' \
    "$text" || { echo "generate --json-schema (temperature $t): $text"; cat "$err"; exit 1; }
done
echo '{"type": "string", "pattern": "a+"}' >"$err.schema"
if "$recur" generate --model "$realvocab" --prompt "x" --json-schema "$err.schema" 2>"$err"; then
  echo "generate accepted a schema with pattern"; exit 1
fi
grep -q "'pattern' is not supported" "$err" || { cat "$err"; exit 1; }
# Bad arguments are named before any work: a missing model directory, a prompt-cache file
# whose directory does not exist, out-of-range sampling values, a malformed --prompts line.
expect_error() {  # expected message, then the arguments
  local want="$1"; shift
  if "$recur" generate "$@" >/dev/null 2>"$err"; then echo "generate $*: accepted"; exit 1; fi
  grep -q -- "$want" "$err" || { echo "generate $*: stderr lacks '$want':"; cat "$err"; exit 1; }
}
expect_error "--model /nonexistent/model: no such directory" --model /nonexistent/model --prompt hi
expect_error "--prompt-cache /nonexistent/dir/f: no directory" --model "$model" --prompt-ids 1 \
  --prompt-cache /nonexistent/dir/f
expect_error "--top-k" --model "$model" --prompt-ids 1 --top-k -5
expect_error "--top-p" --model "$model" --prompt-ids 1 --top-p 2
echo '{"ids": "x"}' >"$err.jsonl"
expect_error '"ids" must be a list of token ids' --model "$model" --prompts "$err.jsonl"
rm -f "$err" "$err.schema" "$err.jsonl"
echo "generate: ok ($n tokens match transformers)"
