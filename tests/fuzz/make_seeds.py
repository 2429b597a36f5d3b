#!/usr/bin/env python3
"""Writes the seed inputs of each fuzz target into corpus/<target>/seed-*: valid and nearly
valid inputs from which the fuzzers mutate. Inputs that found bugs sit beside them (crash-*).
Run from anywhere: python3 tests/fuzz/make_seeds.py"""
import json
import pathlib
import struct

root = pathlib.Path(__file__).resolve().parents[2]
corpus = root / "tests/fuzz/corpus"


def write(target, name, data):
    d = corpus / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data if isinstance(data, bytes) else data.encode())


# http: a piece-size byte, then what a client sends.
http = {
    "get": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "post": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    "chunked": b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;ext=1\r\nabcd\r\n0\r\nTrailer: v\r\n\r\n",
    "lf": b"GET /metrics?x=%41 HTTP/1.0\nConnection: keep-alive\n\n",
}
for i, (name, data) in enumerate(http.items()):
    write("http", name, bytes([1 + 7 * i]) + data)

# request: a selector byte (context, endpoint, small context, unknown fields), then the body.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
bodies = {
    0: {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "tools": tools, "tool_choice": "auto", "max_tokens": 8, "temperature": 0.7,
        "stop": ["x"], "logprobs": True, "top_logprobs": 2, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}},
    1: {"prompt": ["a", "b c"], "max_tokens": 4, "echo": True, "seed": 3, "logit_bias": {"5": -100}},
    2: {"model": "tiny", "max_tokens": 16, "system": "s",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}},
    3: {"input": [{"role": "user", "content": "hi"}], "instructions": "be brief",
        "tools": [{"type": "function", "name": "t", "parameters": {}}], "max_output_tokens": 9},
    4: {"messages": [{"role": "user", "content": "count"}], "system": [{"type": "text", "text": "s"}]},
}
for context in range(3):
    for endpoint, body in bodies.items():
        write("request", f"{context}-{endpoint}", bytes([endpoint * 3 + context]) + json.dumps(body).encode())

# Structured outputs: a schema with most keywords, on chat, and the Responses API's form.
schema = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", 1, None]}, "maxItems": 3},
    "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
    "required": ["name"], "additionalProperties": False,
    "$defs": {"n": {"type": ["integer", "boolean"], "description": "d"}}}
structured = {
    "schema-chat": (0, {"messages": [{"role": "user", "content": "hi"}], "response_format":
                        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}),
    "schema-responses": (9, {"input": "hi", "text": {"format": {"type": "json_schema",
                             "name": "s", "strict": True, "schema": schema}}}),
}
for name, (selector, body) in structured.items():
    write("request", name, bytes([selector]) + json.dumps(body).encode())

# Edits of the harness's own valid bodies (a NUL, then 3 bytes an edit).
for endpoint in range(5):
    write("request", f"edits-{endpoint}", bytes([endpoint * 3, 0, 0, 6, 0, 5, 7, 3]))

# output: flags (format, reasoning, tools, schema), a piece-size byte, then model text.
texts = {
    "json": (0x10, "<think>\nplan\n</think>\n\nok <tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": 1}}\n</tool_call>"),
    "xml": (0x51, "<tool_call>\n<function=f>\n<parameter=i>\n3\n</parameter>\n<parameter=o>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>"),
    "kimi": (0x12, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"s\": \"x\"}<|tool_call_end|><|tool_calls_section_end|>"),
    "reasoning": (0x0c, "still thinking</think>answer é"),
}
for name, (flags, text) in texts.items():
    write("output", name, bytes([flags, 3]) + text.encode())

# tokenizer: flags (Qwen or Kimi, ids or text), then text or id bytes.
for name, (flags, data) in {
    "qwen-text": (0, "Hello, world! <|im_start|>user\n  ünïcödé 你好 123 \t\n<think>".encode()),
    "kimi-text": (1, "Hello 世界 <|im_end|>".encode()),
    "invalid": (0, b"ok \xff\xc0\x80 \xed\xa0\x80"),
    "qwen-ids": (2, bytes(range(60))),
    "kimi-ids": (3, bytes(range(0, 240, 4))),
}.items():
    write("tokenizer", name, bytes([flags]) + data)

# template: the templates the shipped models use.
cfg = json.loads((root / "models/qwen3next-tiny-realvocab/tokenizer_config.json").read_text())
write("template", "qwen3", cfg["chat_template"])
write("template", "qwen3_5", (root / "tests/data/qwen3_5-chat-tiny/chat_template.jinja").read_text())
write("template", "kimi", (root / "tests/data/kimi-tokenizer-tiny/chat_template.jinja").read_text())
write("template", "small", "{% for m in messages %}{{ m.role ~ ': ' ~ m.content | trim }}\n{% endfor %}"
                           "{% macro f(x) %}{{ x | tojson }}{% endmacro %}{{ f(tools) }}\x00"
                           + json.dumps({"messages": [{"role": "user", "content": " a "}], "tools": []}))

# checkpoint: mode in the selector's low 3 bits, the model in the rest.
models = ["qwen3next-tiny", "qwen3next-fp8-tiny", "qwen3_5-tiny", "qwen3_5-moe-tiny", "kimi-linear-tiny"]
for i, m in enumerate(models):
    d = root / "models" / m
    write("checkpoint", f"config-{m}", bytes([1 | i << 3]) + (d / "config.json").read_bytes())
    write("checkpoint", f"config-edits-{m}", bytes([4 | i << 3]) + bytes([0, 3, 64, 1, 9, 0]))
    if (d / "model.safetensors").exists():
        write("checkpoint", f"header-edits-{m}", bytes([6 | i << 3]) + bytes([0, 3, 0, 5, 0, 1]))
    if i in (0, 4):  # two whole headers suffice to start from; they are tens of kilobytes
        raw = (d / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        write("checkpoint", f"header-{m}", bytes([2 | i << 3]) + raw[8:8 + n])
    if i == 0:
        write("checkpoint", "safetensors", bytes([0]) + raw[:8 + n] + bytes(64))
kimi = root / "tests/data/kimi-tokenizer-tiny"
write("checkpoint", "tiktoken", bytes([3]) + (kimi / "tiktoken.model").read_bytes() + b"\x00"
      + (kimi / "tokenizer_config.json").read_bytes() + b"\x00" + "Hello 世界".encode())

# engine: two set-up bytes (model, batch, step budget, block size, cache size; prefix cache,
# snapshot interval, aging), then operations: 0/1 submit (family, prefix length, suffix
# length, suffix seed, max tokens, priority), 2 cancel (which), 3 steps (how many).
def submit(family, prefix, suffix, seed, max_tokens, priority=0):
    return bytes([0, family, prefix, suffix, seed, max_tokens - 1, priority])


engine = {
    # Qwen3-Next, 4 sequences, 48-token steps, blocks of 16, prefix cache with 3 snapshots
    # every 16 tokens: three requests on one family's prefix, then a later one that hits it.
    "prefix-hits": bytes([0b10010110, 0b0111]) + submit(0, 80, 5, 1, 6) + submit(0, 60, 9, 2, 4)
    + submit(0, 99, 0, 3, 10) + bytes([3, 5]) + submit(0, 96, 7, 4, 3),
    # Kimi-Linear, 2 sequences, 8-token steps, blocks of 4, a small cache, aging: a cancel while
    # prefilling and priorities.
    "cancel-small-cache": bytes([0b00100011, 0b1010]) + submit(1, 90, 20, 5, 10, 2)
    + submit(2, 40, 3, 6, 8) + bytes([3, 2, 2, 0]) + submit(1, 90, 20, 7, 5, 1)
    + submit(0, 10, 10, 8, 9),
}
for name, data in engine.items():
    write("engine", name, data)

# schema: a selector byte (a fixed schema, or past them the schema from the input and a NUL),
# then text.
schema_texts = {
    "object": (0, '{"a": [1, {"b": null}], "c": "d\\u00e9"}'),
    "closed": (1, '{"name": "Ada", "tags": ["a", 1]}'),
    "any-of": (2, '"x"'),
    "tree": (3, '{"kids": [{"kids": []}]}'),
    "own": (9, '{"type": "array", "items": {"type": "boolean"}, "minItems": 1}\0[true, false]'),
}
for name, (selector, text) in schema_texts.items():
    write("schema", name, bytes([selector]) + text.encode())
# With the high bit: the text as Qwen's tokens, then the constraint's mask checked.
for name, (selector, text) in [("mask-closed", (1, '{"name": "Ad')), ("mask-tree", (3, '{"ki'))]:
    write("schema", name, bytes([0x80 | selector]) + text.encode())
