#!/usr/bin/env bash
# `recur chat-template` prints exactly what transformers' apply_chat_template renders for the
# reference cases, and fails cleanly (message on stderr, nothing on stdout) on bad input.
# Usage: bash chat_template.sh <path-to-recur> <repo-root>
set -euo pipefail

recur="$1"
root="$2"
model="$root/models/qwen3next-tiny-realvocab"
cases="$root/tests/data/tokenizer-qwen3/chat_template.json"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

pass=0
fail=0
ok() { pass=$((pass + 1)); }
ko() {
  echo "FAIL: $1"
  fail=$((fail + 1))
}

# Writes case $1 of the reference data as a request file and its expected bytes.
extract_case() {
  python3 - "$cases" "$1" "$work/request.json" "$work/expected.txt" <<'EOF'
import json, sys
cases = json.load(open(sys.argv[1], encoding="utf-8"))
c = cases[int(sys.argv[2])]
request = {"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"]}
if c["tools"] is not None:
    request["tools"] = c["tools"]
if c["extra"]:
    request["chat_template_kwargs"] = c["extra"]
with open(sys.argv[3], "w", encoding="utf-8") as f:
    json.dump(request, f, ensure_ascii=False)
with open(sys.argv[4], "wb") as f:
    f.write(c["rendered"].encode("utf-8"))
EOF
}

count="$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))))' "$cases")"
for ((i = 0; i < count; i++)); do
  extract_case "$i"
  if "$recur" chat-template --model "$model" --request "$work/request.json" >"$work/actual.txt" &&
    cmp -s "$work/expected.txt" "$work/actual.txt"; then
    ok
  else
    ko "reference case $i differs"
    diff <(od -c "$work/expected.txt") <(od -c "$work/actual.txt") | head -20 || true
  fi
done

# The request can come on standard input.
extract_case 9
if "$recur" chat-template --model "$model" --request - <"$work/request.json" >"$work/actual.txt" &&
  cmp -s "$work/expected.txt" "$work/actual.txt"; then
  ok
else
  ko "request from stdin"
fi

# Failures: non-zero exit, a message on stderr, nothing on stdout.
expect_failure() {
  local what="$1" needle="$2"
  shift 2
  if "$@" >"$work/out.txt" 2>"$work/err.txt"; then
    ko "$what: exited 0"
  elif [[ -s "$work/out.txt" ]]; then
    ko "$what: wrote to stdout"
  elif ! grep -qF -- "$needle" "$work/err.txt"; then
    ko "$what: stderr lacks '$needle': $(cat "$work/err.txt")"
  else
    ok
  fi
}

expect_failure "missing model dir" "no chat template" \
  "$recur" chat-template --model "$work/no-such-model" --request "$work/request.json"
printf '{"messages": [' >"$work/broken.json"
expect_failure "invalid request JSON" "not valid JSON" \
  "$recur" chat-template --model "$model" --request "$work/broken.json"
expect_failure "missing request file" "cannot open" \
  "$recur" chat-template --model "$model" --request "$work/absent.json"

mkdir -p "$work/raising"
printf "{{ raise_exception('Only user turns, please.') }}\n" >"$work/raising/chat_template.jinja"
expect_failure "template raise_exception" "Only user turns, please." \
  "$recur" chat-template --model "$work/raising" --request "$work/request.json"

mkdir -p "$work/unsupported"
printf "line one\n{%% include 'x.jinja' %%}\n" >"$work/unsupported/chat_template.jinja"
expect_failure "unsupported construct" "line 2, column 4" \
  "$recur" chat-template --model "$work/unsupported" --request "$work/request.json"

echo "$pass passed, $fail failed"
[[ "$fail" -eq 0 ]]
