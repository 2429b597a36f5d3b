#!/usr/bin/env bash
# recur generate reproduces the greedy continuation that transformers computed (p1 of the
# tiny model's reference file), and rejects bad ids with a clear error.
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
got=$("$recur" generate --model "$model" --prompt-ids "$prompt" --max-tokens "$n")
[ "$got" = "$gen" ] || { echo "generate: got $got, expected $gen"; exit 1; }
err=$(mktemp)
if "$recur" generate --model "$model" --prompt-ids 1,99999 --max-tokens 2 2>"$err"; then
  echo "generate accepted a token id outside the vocabulary"; exit 1
fi
grep -q "outside the vocabulary" "$err" || { cat "$err"; exit 1; }
rm -f "$err"
echo "generate: ok ($n tokens match transformers)"
