// Shared helpers for the end-to-end tests: start a real `recur serve` on a free loopback port,
// read SSE streams, drive the chat and Anthropic APIs, and parse Prometheus text strictly.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
export const ROOT = process.env.RECUR_SOURCE_DIR ?? path.resolve(here, '../..');
export const RECUR = process.env.RECUR_BIN ?? path.join(ROOT, 'build/recur');
export const MODEL = path.join(ROOT, 'models/qwen3next-tiny-realvocab');
export const MODEL_NAME = 'qwen3next-tiny-realvocab';

// Starts `recur serve --port 0` and resolves once it prints its URL.
export async function startServer(args = [], { model = MODEL } = {}) {
  const proc = spawn(RECUR, ['serve', '--model', model, '--port', '0', ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  // Never leave a server behind when the test process ends, however it ends.
  const reap = () => proc.kill('SIGKILL');
  process.on('exit', reap);
  let output = '';
  let exited = null;
  const exit = new Promise((resolve) => {
    proc.on('exit', (code, signal) => {
      process.off('exit', reap);
      exited = { code, signal };
      resolve(exited);
    });
  });
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start:\n${output}`)), 60000);
    const onData = (d) => {
      output += d;
      const m = output.match(/at (http:\/\/\S+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    };
    proc.stdout.on('data', onData);
    proc.stderr.on('data', (d) => (output += d));
    exit.then(({ code, signal }) => {
      clearTimeout(timer);
      reject(new Error(`server exited (${code ?? signal}) before serving:\n${output}`));
    });
  });
  return {
    url,
    proc,
    output: () => output,
    exited: () => exited,
    // SIGTERM, then the exit status (SIGKILL after a timeout, which then fails the caller).
    async stop(timeoutMs = 20000) {
      if (!exited) proc.kill('SIGTERM');
      return this.exit(timeoutMs);
    },
    // The exit status of a server already told to stop (a second SIGTERM would end its drain).
    async exit(timeoutMs = 20000) {
      const timer = setTimeout(() => proc.kill('SIGKILL'), timeoutMs);
      const r = await exit;
      clearTimeout(timer);
      return r;
    },
  };
}

// A test file's after(): stops the server, removes `dir` (a model directory the file made) if
// given, and checks that the server exited cleanly (status 0, no signal).
export async function stopCleanly(server, dir = null) {
  const r = await server.stop();
  if (dir) fs.rmSync(dir, { recursive: true });
  assert.deepEqual(r, { code: 0, signal: null }, server.output());
}

// Server-sent events of a fetch Response: {event, data} per blank-line-separated block.
export async function* sseEvents(res) {
  const decoder = new TextDecoder();
  let buf = '';
  for await (const chunk of res.body) {
    buf += decoder.decode(chunk, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const ev = { event: null, data: '' };
      for (const line of block.split('\n')) {
        if (line.startsWith('data: ')) ev.data += line.slice(6);
        else if (line.startsWith('event: ')) ev.event = line.slice(7);
        else if (line !== '' && !line.startsWith(':')) throw new Error(`bad SSE line: ${line}`);
      }
      yield ev;
    }
  }
  if (buf.trim() !== '') throw new Error(`SSE stream ended mid-event: ${buf}`);
}

export async function postJson(url, body, headers = {}) {
  return fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' || body instanceof Uint8Array ? body : JSON.stringify(body),
  });
}

// A streaming /v1/completions request: token ids, text and finish reason of each choice.
export async function streamCompletion(url, body, headers = {}) {
  const res = await postJson(`${url}/v1/completions`,
    { ...body, stream: true, return_token_ids: true }, headers);
  if (res.status !== 200) throw new Error(`status ${res.status}: ${await res.text()}`);
  const out = { ids: [], text: '', finish_reason: null, done: false };
  for await (const ev of sseEvents(res)) {
    if (ev.data === '[DONE]') {
      out.done = true;
      continue;
    }
    const j = JSON.parse(ev.data);
    if (j.error) throw new Error(JSON.stringify(j.error));
    for (const c of j.choices) {
      out.text += c.text;
      out.ids.push(...(c.token_ids ?? []));
      if (c.finish_reason) out.finish_reason = c.finish_reason;
    }
  }
  return out;
}

// Sampling under which the one token `id` (an added token whose text is a scripted output) is
// the whole output: logit_bias makes it certain and stop_token_ids the last.
export const onlyToken = (id) => ({
  logit_bias: { [id]: 100 }, stop_token_ids: [id], temperature: 0,
  include_stop_str_in_output: true,  // the stop token's text is the output
});

// A chat completion streamed through the OpenAI SDK, its deltas joined: content,
// reasoning_content, the tool_calls deltas in order, and the finish reason.
export async function chatStreamParts(stream) {
  const out = { content: '', reasoning: '', deltas: [], finish: null };
  for await (const chunk of stream) {
    for (const ch of chunk.choices) {
      out.content += ch.delta.content ?? '';
      out.reasoning += ch.delta.reasoning_content ?? '';
      if (ch.delta.tool_calls) out.deltas.push(...ch.delta.tool_calls);
      if (ch.finish_reason) out.finish = ch.finish_reason;
    }
  }
  return out;
}

// ---- the Anthropic Messages API, by plain fetch ----

export const ANTHROPIC_HEADERS = { 'anthropic-version': '2023-06-01' };

// Chat-completions tools ({type, function: {name, parameters}}) as Anthropic's and as the
// Responses API's.
export const anthropicTools = (tools) =>
  tools.map((t) => ({ name: t.function.name, input_schema: t.function.parameters }));
export const responsesTools = (tools) => tools.map((t) => ({
  type: 'function', name: t.function.name, parameters: t.function.parameters,
}));

// A /v1/messages request answered with status 200: the message.
export async function anthropicMessage(url, body) {
  const res = await postJson(`${url}/v1/messages`, body, ANTHROPIC_HEADERS);
  assert.equal(res.status, 200);
  return res.json();
}

// A /v1/messages request streamed (status 200): its tool_use block's content_block_start, the
// input_json_delta texts joined, and the message_delta's stop reason.
export async function anthropicToolUseStream(url, body) {
  const res = await postJson(`${url}/v1/messages`, { ...body, stream: true }, ANTHROPIC_HEADERS);
  assert.equal(res.status, 200);
  let start = null;
  let json = '';
  let stop = null;
  for await (const ev of sseEvents(res)) {
    const d = JSON.parse(ev.data);
    if (d.type === 'content_block_start' && d.content_block.type === 'tool_use') start = d.content_block;
    if (d.type === 'content_block_delta' && d.delta.type === 'input_json_delta') json += d.delta.partial_json;
    if (d.type === 'message_delta') stop = d.delta.stop_reason;
  }
  return { start, json, stop };
}

// Deterministic pseudo-random numbers (tests must not depend on Math.random).
export function rng(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// ---- Prometheus text exposition format, parsed strictly ----

const NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL = /^[a-zA-Z_][a-zA-Z0-9_]*$/;
const FLOAT = /^(?:[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?Inf|NaN)$/;
const TYPES = new Set(['counter', 'gauge', 'histogram', 'summary', 'untyped']);

function parseValue(s, where) {
  if (!FLOAT.test(s)) throw new Error(`${where}: bad value '${s}'`);
  if (s.endsWith('Inf')) return s.startsWith('-') ? -Infinity : Infinity;
  return Number(s);
}

function parseLabels(s, where) {
  const labels = {};
  let i = 0;
  while (i < s.length) {
    const eq = s.indexOf('=', i);
    if (eq < 0) throw new Error(`${where}: label without '='`);
    const name = s.slice(i, eq);
    if (!LABEL.test(name)) throw new Error(`${where}: bad label name '${name}'`);
    if (s[eq + 1] !== '"') throw new Error(`${where}: label value must be quoted`);
    let j = eq + 2;
    let value = '';
    for (;;) {
      if (j >= s.length) throw new Error(`${where}: unterminated label value`);
      const c = s[j];
      if (c === '\\') {
        const n = s[j + 1];
        if (n === 'n') value += '\n';
        else if (n === '\\' || n === '"') value += n;
        else throw new Error(`${where}: bad escape \\${n}`);
        j += 2;
      } else if (c === '"') {
        j += 1;
        break;
      } else if (c === '\n') {
        throw new Error(`${where}: newline in label value`);
      } else {
        value += c;
        j += 1;
      }
    }
    if (name in labels) throw new Error(`${where}: duplicate label ${name}`);
    labels[name] = value;
    if (j === s.length) break;
    if (s[j] !== ',') throw new Error(`${where}: expected ',' after label ${name}`);
    i = j + 1;
    if (i === s.length) throw new Error(`${where}: trailing comma`);
  }
  return labels;
}

// Returns {families: Map(name -> {type, help, samples[]}), value(name, labels)}; throws on any
// deviation from the format: unknown lines, samples before their TYPE, duplicate series,
// histogram buckets that are not cumulative or disagree with _count.
export function parsePrometheus(text) {
  if (!text.endsWith('\n')) throw new Error('exposition must end with a newline');
  const families = new Map();
  const seen = new Set();
  const familyOf = (sample) => {
    if (families.has(sample)) return sample;
    for (const suffix of ['_bucket', '_sum', '_count']) {
      if (sample.endsWith(suffix)) {
        const base = sample.slice(0, -suffix.length);
        const f = families.get(base);
        if (f && (f.type === 'histogram' || (f.type === 'summary' && suffix !== '_bucket'))) return base;
      }
    }
    return null;
  };
  const lines = text.slice(0, -1).split('\n');
  lines.forEach((line, n) => {
    const where = `line ${n + 1}`;
    if (line === '') throw new Error(`${where}: empty line`);
    if (line.startsWith('#')) {
      const m = line.match(/^# (HELP|TYPE) (\S+) ?(.*)$/);
      if (!m) return;  // other comments are allowed
      const [, kind, name, rest] = m;
      if (!NAME.test(name)) throw new Error(`${where}: bad metric name ${name}`);
      const f = families.get(name) ?? { type: 'untyped', help: null, samples: [], typed: false };
      if (kind === 'TYPE') {
        if (f.typed) throw new Error(`${where}: second TYPE for ${name}`);
        if (f.samples.length) throw new Error(`${where}: TYPE after samples of ${name}`);
        if (!TYPES.has(rest)) throw new Error(`${where}: unknown type ${rest}`);
        f.type = rest;
        f.typed = true;
      } else {
        if (f.help !== null) throw new Error(`${where}: second HELP for ${name}`);
        f.help = rest;
      }
      families.set(name, f);
      return;
    }
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: (-?\d+))?$/);
    if (!m) throw new Error(`${where}: not a sample: ${line}`);
    const [, name, labelText, valueText] = m;
    const labels = labelText === undefined ? {} : parseLabels(labelText, where);
    const value = parseValue(valueText, where);
    const fname = familyOf(name);
    if (!fname) throw new Error(`${where}: sample ${name} has no TYPE before it`);
    const key = name + JSON.stringify(Object.entries(labels).sort());
    if (seen.has(key)) throw new Error(`${where}: duplicate series ${key}`);
    seen.add(key);
    const f = families.get(fname);
    if (f.type === 'counter' && !(value >= 0)) throw new Error(`${where}: negative counter`);
    if (name.endsWith('_bucket') && f.type === 'histogram' && !('le' in labels)) {
      throw new Error(`${where}: bucket without le`);
    }
    f.samples.push({ name, labels, value });
  });
  for (const [name, f] of families) {
    if (f.type !== 'histogram') continue;
    const groups = new Map();
    for (const s of f.samples) {
      const { le, ...rest } = s.labels;
      const k = JSON.stringify(Object.entries(rest).sort());
      const g = groups.get(k) ?? { buckets: [], sum: null, count: null };
      if (s.name === `${name}_bucket`) g.buckets.push([parseValue(le, name), s.value]);
      else if (s.name === `${name}_sum`) g.sum = s.value;
      else if (s.name === `${name}_count`) g.count = s.value;
      groups.set(k, g);
    }
    for (const g of groups.values()) {
      if (g.sum === null || g.count === null) throw new Error(`${name}: _sum or _count missing`);
      let prevLe = -Infinity;
      let prev = 0;
      for (const [le, v] of g.buckets) {
        if (!(le > prevLe)) throw new Error(`${name}: buckets not in increasing le order`);
        if (v < prev) throw new Error(`${name}: buckets not cumulative`);
        prevLe = le;
        prev = v;
      }
      if (prevLe !== Infinity) throw new Error(`${name}: no +Inf bucket`);
      if (prev !== g.count) throw new Error(`${name}: +Inf bucket ${prev} != _count ${g.count}`);
    }
  }
  const value = (name, labels = {}) => {
    const fname = familyOf(name);
    const f = fname && families.get(fname);
    if (!f) return undefined;
    const want = JSON.stringify(Object.entries(labels).sort());
    const s = f.samples.find((x) => x.name === name && JSON.stringify(Object.entries(x.labels).sort()) === want);
    return s?.value;
  };
  return { families, value };
}

export async function metrics(url) {
  const res = await fetch(`${url}/metrics`);
  if (res.status !== 200) throw new Error(`/metrics: ${res.status}`);
  const type = res.headers.get('content-type') ?? '';
  if (!type.startsWith('text/plain')) throw new Error(`/metrics content-type ${type}`);
  return parsePrometheus(await res.text());
}
