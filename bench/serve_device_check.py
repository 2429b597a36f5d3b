# Sends the same greedy requests to a running recur serve; writes their outputs as JSON.
import json, sys, threading, urllib.request
port, out = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
def post(path, body, stream=False):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        if not stream: return json.load(r)
        text = ""
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch: text += ch[0].get("text") or ""
        return text
res = {"chat": post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hello there, how are you?"}], "max_tokens": 32, "temperature": 0})["choices"][0]["message"]}
prompts = [f"Story number {i}: once upon a time" + " and then" * i for i in range(16)]
streams = [None] * len(prompts)
def run(i): streams[i] = post("/v1/completions", {"model": model, "prompt": prompts[i], "max_tokens": 48, "temperature": 0, "stream": True}, True)
ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
[t.start() for t in ts]; [t.join() for t in ts]
res["streams"] = streams
res["metrics"] = [l for l in urllib.request.urlopen(base + "/metrics").read().decode().splitlines() if l.startswith(("recur_live", "recur_state", "recur_kv", "recur_running", "recur_requests"))]
json.dump(res, open(out, "w"), indent=1)
