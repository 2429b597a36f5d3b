#!/usr/bin/env bash
# recur generate --prompt-cache: a second run whose prompt starts like the first one's prefills
# only the rest (the snapshot at the first prompt's last 16-token block boundary) and gives the
# tokens a run without the cache gives; a file for another model is ignored, saying so.
set -euo pipefail
recur="$1"; root="$2"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
model="$root/models/qwen3next-tiny"
first=$(python3 -c "import random; random.seed(1); print(','.join(str(random.randrange(256)) for _ in range(70)))")
second="$first,5,6,7,8,9"
run() { "$recur" generate --model "$1" --prompt-ids "$2" --max-tokens 4 --threads 2 --stats "${@:3}"; }
run "$model" "$first" --prompt-cache "$dir/cache.bin" > "$dir/1.out" 2> "$dir/1.err"
grep -q "prefix cache: no file" "$dir/1.err"
grep -q "prefix cache written to" "$dir/1.err"
run "$model" "$second" --prompt-cache "$dir/cache.bin" > "$dir/2.out" 2> "$dir/2.err"
grep -q "(blocks: 4, snapshots: 1)" "$dir/2.err"
run "$model" "$second" --prefix-cache-mb 0 > "$dir/plain.out" 2> "$dir/plain.err"
cmp "$dir/2.out" "$dir/plain.out"
python3 - "$dir/2.err" "$dir/plain.err" <<'PY'
import json, sys
def stats(path):
    return json.loads([l for l in open(path) if l.startswith("{")][-1])
cached, plain = stats(sys.argv[1]), stats(sys.argv[2])
assert cached["prefix_cache_hit_tokens"] == 64 and cached["prompt_tokens"] == 75 - 64, cached
assert plain["prompt_tokens"] == 75, plain
PY
# Another model's file: ignored, and the prompt prefilled whole.
run "$root/models/qwen3_5-tiny" "$second" --prompt-cache "$dir/cache.bin" > /dev/null 2> "$dir/3.err"
grep -q "ignored: written for other weights" "$dir/3.err"
echo "prompt_cache: ok"
