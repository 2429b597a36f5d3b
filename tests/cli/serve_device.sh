#!/usr/bin/env bash
# recur serve --device: an unknown or unavailable device is refused before anything is served,
# with a message naming it and exit status 2 (as for recur generate); cpu serves; a port in use
# is refused before the model loads. (The
# end-to-end suites under tests/server serve with --device cpu.)
# Usage: bash serve_device.sh <path-to-recur> <repo-root>
set -euo pipefail
recur="$1"
root="$2"
model="$root/models/qwen3next-tiny-realvocab"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# expect_refused DEVICE PATTERN: exit status 2, PATTERN on stderr, no URL on stdout.
expect_refused() {
  local status=0
  timeout 60 "$recur" serve --model "$model" --port 0 --device "$1" >"$work/out" 2>"$work/err" ||
    status=$?
  [ "$status" -eq 2 ] || { echo "--device $1: exit status $status, expected 2"; cat "$work/err"; exit 1; }
  grep -q -- "$2" "$work/err" || { echo "--device $1: stderr lacks '$2':"; cat "$work/err"; exit 1; }
  if grep -q "http://" "$work/out"; then echo "--device $1: served anyway"; exit 1; fi
  for cmd in generate; do
    status=0
    "$recur" "$cmd" --model "$model" --prompt-ids 1,2 --max-tokens 1 --device "$1" \
      >/dev/null 2>"$work/err" || status=$?
    [ "$status" -eq 2 ] || { echo "$cmd --device $1: exit status $status"; exit 1; }
    grep -q -- "$2" "$work/err" || { echo "$cmd --device $1:"; cat "$work/err"; exit 1; }
  done
}

expect_refused tpu "expected cpu, cuda, cuda:N or cuda:N,M"
expect_refused cuda:x "cuda:x"
# A device list names one device per tensor-parallel rank (here one rank).
expect_refused cuda:0,1 "names 2 devices for 1 tensor-parallel ranks"
# No machine here has 1,000 GPUs; a build without CUDA says it has none.
expect_refused cuda:999 "cuda:999\|CUDA"

# A missing model directory is named before anything else is said about it.
status=0
"$recur" serve --model /nonexistent/model --port 0 >"$work/out" 2>"$work/err" || status=$?
[ "$status" -eq 2 ] || { echo "missing model: exit status $status"; exit 1; }
grep -q -- "--model /nonexistent/model: no such directory" "$work/err" || { cat "$work/err"; exit 1; }
if grep -q "warning" "$work/err"; then echo "missing model: a warning first"; cat "$work/err"; exit 1; fi

# cpu: serves, answers /health, and stops cleanly on SIGTERM.
"$recur" serve --model "$model" --port 0 --device cpu >"$work/out" 2>"$work/err" &
pid=$!
for _ in $(seq 600); do
  grep -q "http://" "$work/out" && break
  kill -0 "$pid" 2>/dev/null || { echo "serve --device cpu exited:"; cat "$work/err"; exit 1; }
  sleep 0.1
done
url=$(grep -o "http://[0-9.:]*" "$work/out" | head -1)
[ -n "$url" ] || { echo "serve --device cpu did not start"; kill "$pid"; exit 1; }
grep -q "on cpu" "$work/out" || { echo "the start-up line does not name the device"; kill "$pid"; exit 1; }
health=$(python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + "/health").read().decode())' "$url")
[ "$health" = '{"status":"ok"}' ] || { echo "health: $health"; kill "$pid"; exit 1; }
# A second server on the same port is refused before it loads anything.
port="${url##*:}"
status=0
timeout 60 "$recur" serve --model "$model" --port "$port" >"$work/out2" 2>"$work/err2" || status=$?
[ "$status" -eq 2 ] || { echo "port in use: exit status $status"; cat "$work/err2"; kill "$pid"; exit 1; }
grep -q "cannot listen on 127.0.0.1:$port: Address already in use" "$work/err2" ||
  { echo "port in use:"; cat "$work/err2"; kill "$pid"; exit 1; }
if grep -q "loading" "$work/out2"; then echo "port in use: loaded first"; kill "$pid"; exit 1; fi
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
[ "$status" -eq 0 ] || { echo "exit status after SIGTERM: $status"; exit 1; }
echo "serve --device: all checks passed"
