// Over a thousand malformed requests, over raw sockets so any byte can be sent: bad fields and
// types for every endpoint, broken JSON, invalid UTF-8, deep nesting, oversized bodies, wrong
// or missing API keys, malformed request lines and headers. The server must answer every one
// with a 4xx and an OpenAI-style error JSON, stay up, and then serve a valid request.
import assert from 'node:assert/strict';
import net from 'node:net';
import { after, before, test } from 'node:test';

import { MODEL_NAME, metrics, rng, startServer, stopCleanly } from './lib.mjs';

const KEY = 'fuzz-key';
let server;
let port;

before(async () => {
  server = await startServer(['--api-key', KEY, '--max-body-mb', '1', '--max-batch', '4']);
  port = Number(new URL(server.url).port);
});

after(() => stopCleanly(server));

// Sends raw bytes on a fresh connection; resolves {status, headers, body} of the response.
function raw(bytes, timeoutMs = 15000) {
  return new Promise((resolve, reject) => {
    const sock = net.connect(port, '127.0.0.1');
    let buf = Buffer.alloc(0);
    const timer = setTimeout(() => {
      sock.destroy();
      reject(new Error(`no response within ${timeoutMs} ms`));
    }, timeoutMs);
    const tryParse = () => {
      const end = buf.indexOf('\r\n\r\n');
      if (end < 0) return false;
      const head = buf.subarray(0, end).toString('latin1').split('\r\n');
      const status = Number(head[0].split(' ')[1]);
      const headers = {};
      for (const h of head.slice(1)) {
        const i = h.indexOf(':');
        headers[h.slice(0, i).toLowerCase()] = h.slice(i + 1).trim();
      }
      const len = Number(headers['content-length'] ?? -1);
      if (len < 0 || buf.length < end + 4 + len) return false;
      clearTimeout(timer);
      sock.destroy();
      resolve({ status, headers, body: buf.subarray(end + 4, end + 4 + len).toString('utf8') });
      return true;
    };
    sock.on('data', (d) => {
      buf = Buffer.concat([buf, d]);
      tryParse();
    });
    sock.on('error', () => {});
    sock.on('close', () => {
      if (!tryParse()) {
        clearTimeout(timer);
        reject(new Error(`connection closed without a response (${buf.length} bytes)`));
      }
    });
    sock.write(bytes);
  });
}

function post(path, body, headers = {}) {
  const payload = Buffer.isBuffer(body) ? body : Buffer.from(body, 'utf8');
  const lines = [`POST ${path} HTTP/1.1`, 'Host: 127.0.0.1', 'Connection: close',
    `Content-Length: ${payload.length}`];
  if (!('authorization' in headers) && !('x-api-key' in headers)) lines.push(`Authorization: Bearer ${KEY}`);
  for (const [k, v] of Object.entries(headers)) if (v !== null) lines.push(`${k}: ${v}`);
  return Buffer.concat([Buffer.from(lines.join('\r\n') + '\r\n\r\n', 'latin1'), payload]);
}

const BASE = {
  '/v1/chat/completions': { model: MODEL_NAME, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 },
  '/v1/completions': { model: MODEL_NAME, prompt: 'hi', max_tokens: 2 },
  '/v1/messages': { model: MODEL_NAME, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 },
};

// Values that are wrong for the field on every endpoint that has it.
const BAD = {
  model: ['no-such-model', 5, [], {}, true],
  max_tokens: [0, -1, -1e9, 1.5, '5', 1e20, 1e300, true, [], {}, 100000000],
  temperature: [-0.5, 'hot', 101, [], {}, true, -1e-9],
  top_p: [0, -1, 1.01, 'x', [], true],
  top_k: [-5, 0.5, 'x', [], {}],
  min_p: [-0.1, 1.5, 'x', []],
  presence_penalty: [2.5, -3, 'x', {}],
  frequency_penalty: [9, -9, 'x', []],
  repetition_penalty: [0, -1, 'x', 1000],
  logit_bias: [[], 'x', 5, { a: 1 }, { '-1': 1 }, { 999999: 1 }, { 5: 101 }, { 5: -101 }, { 5: 'x' }, { '1.5': 1 }],
  seed: ['x', 1.5, [], {}, true],
  stream: ['yes', 1, [], {}],
  stop_token_ids: [5, [-1], ['x'], [1e9]],
  ignore_eos: [1, 'true', []],
  min_tokens: [5],
  response_format: ['json', { type: 'xml' }, { type: 'json_schema' },
    { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'integer', minimum: 0 } } }],
};
const BAD_BY_ENDPOINT = {
  '/v1/chat/completions': {
    messages: [[], 5, 'hi', {}, [5], ['hi'], [{}], [{ role: 5, content: 'x' }],
      [{ role: 'robot', content: 'x' }], [{ role: 'user' }], [{ role: 'user', content: 5 }],
      [{ role: 'user', content: [{ type: 'image_url', image_url: {} }] }],
      [{ role: 'user', content: [{ type: 'text' }] }], [{ role: 'user', content: [5] }],
      [{ role: 'assistant', content: 'x', tool_calls: 5 }],
      [{ role: 'assistant', content: 'x', tool_calls: [{ function: { name: '' } }] }]],
    n: [0, -1, 129, 'two', 1.5],
    stop: [5, [5], {}, true, Array(65).fill('x')],
    logprobs: [5, 'yes'],
    top_logprobs: [21, -1, 'x'],
    max_completion_tokens: [0, -5, 'x'],
    tools: ['x', 5, {}, [5], [{}], [{ type: 'function' }], [{ type: 'function', function: { name: '' } }],
      [{ type: 'function', function: { name: 'f', parameters: 5 } }],
      // Names that are no identifiers: they would be written into the call markup.
      ...['a</tool_call>', 'get weather', 'a\nb', 'a"b', 'a\u0000b', 'a'.repeat(129)].map(
        (name) => [{ type: 'function', function: { name } }])],
    tool_choice: ['sometimes', 5, { type: 'function' }, 'required'],
    chat_template_kwargs: [5, 'x', [], { messages: [] }],
    stream_options: [{ include_usage: true }],
    parallel_tool_calls: ['no'],
  },
  '/v1/completions': {
    prompt: [5, [], {}, '', [-1], [151936], [1.5], [[1], 'a'], [[]], true, [['a']]],
    n: [0, 129, 'x'],
    stop: [5, [5], {}],
    logprobs: [21, -1, true, 'x'],
    best_of: [5, 0],
    echo: ['yes'],
    suffix: ['tail'],
    stream_options: [{ include_usage: true }],
  },
  '/v1/messages': {
    messages: [[], 5, [{ role: 'system', content: 'x' }], [{ role: 'user' }],
      [{ role: 'user', content: [{ type: 'image' }] }], [{ role: 'user', content: [5] }]],
    system: [5, [5], [{ type: 'image' }]],
    stop_sequences: ['x', [5]],
    tools: [5, [{}], [{ name: '' }], [{ name: 'f', input_schema: 5 }], [{ name: 'a</tool_call>' }],
      [{ name: 'a'.repeat(1000) }]],
    tool_choice: ['auto', 5, { type: 'maybe' }, { type: 'any' }],
    thinking: [5, { type: 'maybe' }],
  },
};

function cases() {
  const out = [];
  const rand = rng(99);
  for (const [path, base] of Object.entries(BASE)) {
    const fields = { ...BAD, ...BAD_BY_ENDPOINT[path] };
    if (path === '/v1/messages') delete fields.max_tokens;  // required there: covered below
    for (const [field, values] of Object.entries(fields)) {
      for (const v of values) {
        let body = { ...base, [field]: v };
        if (field === 'stream_options') body = { ...body, stream: false };
        if (field === 'top_logprobs') body = { ...body, logprobs: true };
        out.push({ name: `${path} ${field}=${JSON.stringify(v)?.slice(0, 40)}`, bytes: post(path, JSON.stringify(body)) });
      }
    }
    const text = JSON.stringify(base);
    // Every truncation of a valid body is invalid JSON.
    for (let i = 0; i < text.length; ++i) {
      out.push({ name: `${path} truncated at ${i}`, bytes: post(path, text.slice(0, i)) });
    }
    // A control character or an invalid UTF-8 sequence anywhere makes the body invalid.
    const poison = [[0x01], [0xff], [0xc0, 0x80], [0xed, 0xa0, 0x80], [0xe2, 0x82], [0xf8, 0x88, 0x80, 0x80, 0x80]];
    for (let k = 0; k < 120; ++k) {
      const at = 1 + Math.floor(rand() * (text.length - 2));
      const p = poison[k % poison.length];
      const bytes = Buffer.concat([Buffer.from(text.slice(0, at)), Buffer.from(p), Buffer.from(text.slice(at))]);
      out.push({ name: `${path} byte(s) ${p} at ${at}`, bytes: post(path, bytes) });
    }
    for (const junk of ['', ' ', 'null', '[]', '"x"', '42', 'true', '{"a":1', '{}{}', '{"a":1}x',
      '\u00ef\u00bb\u00bf{}', '{"a":NaN}', '{"a":Infinity}', "{'a':1}", '{"a":01}', '{"a":1,}']) {
      out.push({ name: `${path} body ${junk}`, bytes: post(path, junk) });
    }
    // A NUL byte does not end the body: what follows it is still part of it.
    out.push({ name: `${path} NUL then garbage`,
      bytes: post(path, Buffer.concat([Buffer.from(text), Buffer.from([0]), Buffer.from('garbage{{{')])) });
    out.push({ name: `${path} deep nesting`, bytes: post(path, JSON.stringify({ ...base, x: 0 }).replace('"x":0', `"x":${'['.repeat(5000)}${']'.repeat(5000)}`)) });
    out.push({ name: `${path} too large`, bytes: post(path, JSON.stringify({ ...base, pad: 'a'.repeat(1.5 * (1 << 20)) })), status: 413 });
    // API keys.
    for (const auth of [{ authorization: null, 'x-api-key': null }, { authorization: 'Bearer wrong' },
      { authorization: `Basic ${KEY}` }, { authorization: 'Bearer' }, { authorization: `Bearer ${KEY}x` },
      { 'x-api-key': 'nope' }, { authorization: `bearer${KEY}` }]) {
      out.push({ name: `${path} auth ${JSON.stringify(auth)}`, bytes: post(path, text, auth), status: 401 });
    }
    // Weird but well-framed headers do not rescue a bad body.
    for (let k = 0; k < 20; ++k) {
      const name = `X-F${Math.floor(rand() * 1e6)}`;
      const value = Array.from({ length: 1 + Math.floor(rand() * 60) }, () =>
        String.fromCharCode(0x20 + Math.floor(rand() * 95))).join('');
      out.push({ name: `${path} header ${name}`, bytes: post(path, '{"n": [}', { [name]: value, 'content-type': value }) });
    }
  }
  // Ids past the tokenizer's last token (the model's vocabulary has rows beyond it) have no text.
  out.push({ name: '/detokenize unknown id', bytes: post('/detokenize', JSON.stringify({ tokens: [9707, 151935] })) });
  // Request lines and headers the HTTP layer rejects.
  const pre = [
    'GARBAGE\r\n\r\n', 'GET /health\r\n\r\n', 'GET /health HTTP/9.9\r\n\r\n', 'FOO /health HTTP/1.1\r\nHost: x\r\n\r\n',
    `GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ${'a'.repeat(9000)}\r\n\r\n`,
    `GET /${'a'.repeat(9000)} HTTP/1.1\r\nHost: x\r\n\r\n`,
    'POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n',
    'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nabcde',
    'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=zz\r\nContent-Length: 10\r\n\r\n--zz\r\ngarb',
    'POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}',
    `GET /health HTTP/1.1\r\nHost: x\r\nRange: bytes=999-1000\r\n\r\n`.replace('/health', '/nope'),
    'GET /nope HTTP/1.1\r\nHost: x\r\n\r\n', 'POST /v1/nope HTTP/1.1\r\nContent-Length: 0\r\n\r\n',
    'GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n', 'PUT /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n',
    'DELETE /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n', 'POST /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n',
    'POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n', 'GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n',
    `GET /v1/models/nope HTTP/1.1\r\nAuthorization: Bearer ${KEY}\r\n\r\n`,
    'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}',
  ];
  // An HTTP version the server does not speak is 505 (RFC 9110 15.6.6), the one 5xx here.
  for (const p of pre) {
    out.push({ name: `raw ${JSON.stringify(p.slice(0, 50))}`, bytes: Buffer.from(p, 'latin1'),
      status: p.includes('HTTP/9.9') ? 505 : undefined });
  }
  return out;
}

test('every malformed request gets a 4xx JSON error; the server keeps serving', async () => {
  const all = cases();
  assert.ok(all.length >= 1000, `only ${all.length} cases`);
  const failures = [];
  const statuses = {};
  let next = 0;
  const worker = async () => {
    while (next < all.length) {
      const c = all[next++];
      try {
        const r = await raw(c.bytes);
        statuses[r.status] = (statuses[r.status] ?? 0) + 1;
        let err = null;
        try {
          err = JSON.parse(r.body).error;
        } catch {}
        const okStatus = c.status ? r.status === c.status : r.status >= 400 && r.status < 500;
        if (!okStatus || !err || typeof err.message !== 'string' || !('type' in err) ||
            !('param' in err) || !('code' in err)) {
          failures.push(`${c.name}: ${r.status} ${r.body.slice(0, 200)}`);
        }
      } catch (e) {
        failures.push(`${c.name}: ${e.message}`);
      }
    }
  };
  await Promise.all(Array.from({ length: 8 }, worker));
  assert.deepEqual(failures, [], `${failures.length} of ${all.length} failed`);
  console.log(`fuzz: ${all.length} malformed requests, statuses ${JSON.stringify(statuses)}`);

  assert.equal(server.exited(), null, 'the server died');
  const ok = await fetch(`${server.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${KEY}` },
    body: JSON.stringify({ prompt: [9707, 11], max_tokens: 3, temperature: 0, ignore_eos: true }),
  });
  assert.equal(ok.status, 200);
  const j = await ok.json();
  assert.equal(j.usage.completion_tokens, 3);
  const m = await metrics(server.url);
  assert.equal(m.value('recur_state_slots_used'), 0);
  assert.equal(m.value('recur_kv_cache_blocks_used'), 0);
});
