// Strict, clear input and the API surface clients now use: unknown fields are a 400 naming the
// field (unless --allow-unknown-fields), out-of-range numbers say so, a broken chat template
// is a 5xx blaming the model directory, CORS (--allowed-origins), Anthropic's count_tokens and
// model list, and the OpenAI Responses API through the official SDK's responses.create and
// responses.stream (text and function tools, streaming and not), and the prefix cache's reused
// tokens in usage and /metrics, within one server's life and across a restart.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import OpenAI from 'openai';

import { MODEL, MODEL_NAME, postJson, startServer, stopCleanly } from './lib.mjs';

const ORIGIN = 'http://app.example';
const SMALL = ['--max-batch', '4', '--kv-cache-mb', '64'];
// As in openai_sdk.test.mjs: the tiny model writes noise, so a forced call is made to end on
// the one token `}}` (id 3417).
const CLOSE_BRACES = 3417;
const WEATHER = {
  type: 'function', name: 'get_weather', description: 'Current weather for a city',
  parameters: { type: 'object', properties: {} },
};

let server;
let client;

before(async () => {
  server = await startServer(['--allowed-origins', `${ORIGIN},http://other.example`, ...SMALL]);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(() => stopCleanly(server));

const chat = { messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 };
const BODIES = {
  '/v1/chat/completions': chat,
  '/v1/completions': { prompt: 'hi', max_tokens: 2 },
  '/v1/messages': { ...chat, model: MODEL_NAME },
  '/v1/responses': { input: 'hi', max_output_tokens: 2 },
  '/v1/messages/count_tokens': { model: MODEL_NAME, messages: chat.messages },
};

describe('strict input', () => {
  test('an unknown field is a 400 naming it, on every endpoint', async () => {
    for (const [route, body] of Object.entries(BODIES)) {
      const r = await postJson(`${server.url}${route}`, { ...body, max_token: 2 });
      const j = await r.json();
      assert.equal(r.status, 400, `${route}: ${JSON.stringify(j)}`);
      assert.equal(j.error.param, 'max_token', route);
      assert.equal(j.error.code, 'unknown_parameter', route);
      assert.match(j.error.message, /unknown field 'max_token'/, route);
      if (route !== '/v1/messages/count_tokens' && route !== '/v1/responses') {
        assert.match(j.error.message, /did you mean 'max_tokens'/, route);
      }
    }
  });

  test('--allow-unknown-fields ignores them', async () => {
    const lax = await startServer(['--allow-unknown-fields', ...SMALL]);
    try {
      for (const [route, body] of Object.entries(BODIES)) {
        const r = await postJson(`${lax.url}${route}`, { ...body, max_token: 2, something_else: {} });
        assert.equal(r.status, 200, `${route}: ${await r.text()}`);
      }
    } finally {
      await lax.stop();
    }
  });

  test('numbers out of range are named as such', async () => {
    for (const [field, value] of [['max_tokens', 1e20], ['max_tokens', 0], ['temperature', 101],
      ['n', 1000], ['top_p', 1.5], ['max_tokens', 18446744073709551616]]) {
      const r = await postJson(`${server.url}/v1/chat/completions`, { ...chat, [field]: value });
      const j = await r.json();
      assert.equal(r.status, 400);
      assert.equal(j.error.param, field);
      assert.match(j.error.message, new RegExp(`'${field}' is out of range`), j.error.message);
    }
    const r = await postJson(`${server.url}/v1/chat/completions`, { ...chat, max_tokens: 1.5 });
    assert.match((await r.json()).error.message, /must be an integer/);
  });

  test('a broken chat template is a 500 blaming the model directory', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-broken-template-'));
    // One template fails as it renders (a type error), one already as it loads.
    const templates = {
      renders: '{% for m in messages %}{{ m.content + 1 }}{% endfor %}',
      loads: '{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}',
    };
    try {
      for (const [name, template] of Object.entries(templates)) {
        const model = path.join(dir, name);
        fs.mkdirSync(model);
        for (const f of fs.readdirSync(MODEL)) {
          if (f !== 'tokenizer_config.json') fs.symlinkSync(path.join(MODEL, f), path.join(model, f));
        }
        const config = JSON.parse(fs.readFileSync(path.join(MODEL, 'tokenizer_config.json'), 'utf8'));
        config.chat_template = template;
        fs.writeFileSync(path.join(model, 'tokenizer_config.json'), JSON.stringify(config));
        const broken = await startServer(SMALL, { model });
        try {
          for (const route of ['/v1/chat/completions', '/v1/messages', '/v1/responses']) {
            const body = { ...BODIES[route], model: name };
            const r = await postJson(`${broken.url}${route}`, body);
            const j = await r.json();
            assert.equal(r.status, 500, `${name} ${route}: ${JSON.stringify(j)}`);
            assert.match(j.error.message, /fault of the model directory/);
            assert.match(j.error.message, name === 'loads' ? /no_such_filter/ : /unsupported operand/);
          }
          const r = await postJson(`${broken.url}/v1/completions`, BODIES['/v1/completions']);
          assert.equal(r.status, 200);
        } finally {
          await broken.stop();
        }
      }
    } finally {
      fs.rmSync(dir, { recursive: true });
    }
  });
});

describe('CORS', () => {
  test('a preflight from an allowed origin is answered; other origins are refused', async () => {
    const pre = await fetch(`${server.url}/v1/chat/completions`, {
      method: 'OPTIONS',
      headers: { origin: ORIGIN, 'access-control-request-method': 'POST',
        'access-control-request-headers': 'authorization, content-type' },
    });
    assert.equal(pre.status, 204);
    assert.equal(pre.headers.get('access-control-allow-origin'), ORIGIN);
    assert.match(pre.headers.get('access-control-allow-methods'), /POST/);
    assert.equal(pre.headers.get('access-control-allow-headers'), 'authorization, content-type');
    const r = await postJson(`${server.url}/v1/chat/completions`, chat, { origin: ORIGIN });
    assert.equal(r.status, 200);
    assert.equal(r.headers.get('access-control-allow-origin'), ORIGIN);
    assert.equal(r.headers.get('vary'), 'Origin');
    for (const method of ['OPTIONS', 'POST']) {
      const evil = await fetch(`${server.url}/v1/chat/completions`, {
        method, headers: { origin: 'http://evil.example', 'content-type': 'text/plain' },
        body: method === 'POST' ? JSON.stringify(chat) : undefined,
      });
      assert.equal(evil.status, 403, method);
      assert.match((await evil.json()).error.message, /--allowed-origins/);
    }
  });
});

describe('Anthropic', () => {
  test('count_tokens gives the prompt tokens the messages request uses', async () => {
    const body = {
      model: MODEL_NAME, system: 'Be brief.',
      messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
      tools: [{ name: 'get_weather', input_schema: { type: 'object' } }],
    };
    const c = await postJson(`${server.url}/v1/messages/count_tokens`, body, { 'anthropic-version': '2023-06-01' });
    assert.equal(c.status, 200);
    const { input_tokens: n } = await c.json();
    const m = await postJson(`${server.url}/v1/messages`, { ...body, max_tokens: 1 });
    assert.equal(m.status, 200);
    // Anthropic counts the tokens the prefix cache gave apart from input_tokens.
    const { usage } = await m.json();
    assert.equal(usage.input_tokens + usage.cache_read_input_tokens, n);
    assert.ok(n > 20);
  });

  test('the model list comes in Anthropic shape for Anthropic clients', async () => {
    const h = { 'anthropic-version': '2023-06-01' };
    const list = await (await fetch(`${server.url}/v1/models`, { headers: h })).json();
    assert.equal(list.has_more, false);
    assert.equal(list.first_id, MODEL_NAME);
    assert.equal(list.data[0].type, 'model');
    assert.equal(list.data[0].id, MODEL_NAME);
    assert.match(list.data[0].created_at, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$/);
    const one = await (await fetch(`${server.url}/v1/models/${MODEL_NAME}`, { headers: h })).json();
    assert.equal(one.type, 'model');
    const missing = await fetch(`${server.url}/v1/models/nope`, { headers: h });
    assert.equal(missing.status, 404);
    assert.equal((await missing.json()).type, 'error');
    const openai = await (await fetch(`${server.url}/v1/models`)).json();
    assert.equal(openai.object, 'list');
  });
});

describe('prefix cache', () => {
  const metric = (text, name) => Number(text.match(new RegExp(`^${name} (\\S+)$`, 'm'))[1]);

  test('the next turn of a chat reports the prompt tokens it reused, in usage and /metrics', async () => {
    const first = [
      { role: 'system', content: 'You answer in one short sentence. '.repeat(6) },
      { role: 'user', content: 'Name three rivers.' },
    ];
    const r1 = await (await postJson(`${server.url}/v1/chat/completions`,
                                     { messages: first, max_tokens: 4 })).json();
    const p1 = r1.usage.prompt_tokens;
    assert.equal(r1.usage.prompt_tokens_details.cached_tokens, 0);
    const second = [...first, { role: 'assistant', content: 'The Nile, the Rhine, the Po.' },
                    { role: 'user', content: 'And three lakes?' }];
    const r2 = await (await postJson(`${server.url}/v1/chat/completions`,
                                     { messages: second, max_tokens: 4 })).json();
    // The first prompt's snapshot at its last 16-token block boundary.
    assert.equal(r2.usage.prompt_tokens_details.cached_tokens, Math.floor(p1 / 16) * 16);
    // Anthropic's usage counts them apart from input_tokens.
    const m = await (await postJson(`${server.url}/v1/messages`,
                                    { model: MODEL_NAME, messages: second.slice(1), system: first[0].content,
                                      max_tokens: 2 })).json();
    assert.ok(m.usage.cache_read_input_tokens >= r2.usage.prompt_tokens_details.cached_tokens);
    assert.equal(m.usage.input_tokens + m.usage.cache_read_input_tokens, r2.usage.prompt_tokens);
    const text = await (await fetch(`${server.url}/metrics`)).text();
    assert.ok(metric(text, 'recur_prefix_cache_hit_tokens_total') >=
              r2.usage.prompt_tokens_details.cached_tokens + m.usage.cache_read_input_tokens);
    assert.ok(metric(text, 'recur_prefix_cache_snapshots') > 0);
    assert.ok(metric(text, 'recur_prefix_cache_queries_total') >= 3);
  });
});

describe('prefix cache across restarts', () => {
  test('--prefix-cache-dir: the next turn after a restart reuses the previous server\'s prompt', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-prefix-'));
    try {
      const first = [{ role: 'user', content: 'Tell me about the rivers of Europe. '.repeat(4) }];
      let s = await startServer(['--prefix-cache-dir', dir, ...SMALL]);
      const r1 = await (await postJson(`${s.url}/v1/chat/completions`,
                                       { messages: first, max_tokens: 2 })).json();
      assert.deepEqual(await s.stop(), { code: 0, signal: null }, s.output());
      assert.match(s.output(), /prefix cache written to/);
      s = await startServer(['--prefix-cache-dir', dir, ...SMALL]);
      try {
        assert.match(s.output(), /prefix cache: read .* \(blocks: [1-9]\d*, snapshots: [1-9]\d*\)/);
        const second = [...first, { role: 'assistant', content: 'The Danube.' },
                        { role: 'user', content: 'And lakes?' }];
        const r2 = await (await postJson(`${s.url}/v1/chat/completions`,
                                         { messages: second, max_tokens: 2 })).json();
        assert.equal(r2.usage.prompt_tokens_details.cached_tokens,
                     Math.floor(r1.usage.prompt_tokens / 16) * 16);
      } finally {
        assert.deepEqual(await s.stop(), { code: 0, signal: null }, s.output());
      }
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('Responses API (official SDK)', () => {
  const input = 'What is the weather in Paris?';

  test('responses.create: text, usage, status', async () => {
    const r = await client.responses.create({ model: MODEL_NAME, input, max_output_tokens: 8, temperature: 0 });
    assert.equal(r.object, 'response');
    assert.match(r.id, /^resp_/);
    assert.equal(r.status, 'incomplete');
    assert.deepEqual(r.incomplete_details, { reason: 'max_output_tokens' });
    assert.equal(r.usage.output_tokens, 8);
    assert.ok(r.usage.input_tokens > 5);
    assert.equal(r.usage.total_tokens, r.usage.input_tokens + 8);
    assert.equal(typeof r.output_text, 'string');
    assert.ok(r.output_text.length > 0);
    assert.equal(r.output.at(-1).type, 'message');
    // The same request, streamed: the deltas add up to the same text.
    const stream = await client.responses.create({ model: MODEL_NAME, input, max_output_tokens: 8, temperature: 0, stream: true });
    const types = [];
    let text = '';
    let last = null;
    let seq = -1;
    for await (const ev of stream) {
      types.push(ev.type);
      assert.ok(ev.sequence_number > seq);
      seq = ev.sequence_number;
      if (ev.type === 'response.output_text.delta') text += ev.delta;
      last = ev;
    }
    assert.equal(types[0], 'response.created');
    assert.ok(types.includes('response.output_item.added'));
    assert.ok(types.includes('response.output_text.done'));
    assert.equal(last.type, 'response.incomplete');
    assert.equal(text, r.output_text);
    assert.equal(last.response.usage.output_tokens, 8);
  });

  test('instructions and multi-turn input items', async () => {
    const r = await client.responses.create({
      model: MODEL_NAME, instructions: 'Answer in French.', max_output_tokens: 3,
      input: [{ role: 'user', content: 'Hello' }, { role: 'assistant', content: [{ type: 'output_text', text: 'Bonjour' }] },
        { type: 'message', role: 'user', content: [{ type: 'input_text', text: 'And now?' }] }],
    });
    assert.equal(r.instructions, 'Answer in French.');
    assert.equal(r.usage.output_tokens, 3);
    await assert.rejects(
      client.responses.create({ model: MODEL_NAME, input: 'x', previous_response_id: 'resp_1' }),
      (e) => e.status === 400 && /stores no responses/.test(e.message));
    await assert.rejects(
      client.responses.create({ model: MODEL_NAME, input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'x' }] }] }),
      (e) => e.status === 400 && /text only/.test(e.message));
  });

  test('function tools: a forced call, streamed and not, then its output sent back', async () => {
    const forced = {
      model: MODEL_NAME, input, tools: [WEATHER], tool_choice: { type: 'function', name: 'get_weather' },
      logit_bias: { [CLOSE_BRACES]: 100 }, stop_token_ids: [CLOSE_BRACES], temperature: 0,
      include_stop_str_in_output: true,
    };
    const r = await client.responses.create(forced);
    assert.equal(r.status, 'completed');
    const call = r.output.find((o) => o.type === 'function_call');
    assert.ok(call, JSON.stringify(r.output));
    assert.equal(call.name, 'get_weather');
    assert.equal(call.arguments, '{}');
    assert.match(call.call_id, /^call_/);
    assert.match(call.id, /^fc_/);
    assert.equal(r.tools[0].name, 'get_weather');

    // The SDK's stream helper accumulates the same call from the events.
    const stream = client.responses.stream(forced);
    let args = '';
    stream.on('response.function_call_arguments.delta', (ev) => (args += ev.delta));
    const final = await stream.finalResponse();
    const streamed = final.output.find((o) => o.type === 'function_call');
    assert.equal(streamed.name, 'get_weather');
    assert.equal(streamed.arguments, '{}');
    assert.equal(args, '{}');

    const next = await client.responses.create({
      model: MODEL_NAME, tools: [WEATHER], max_output_tokens: 3,
      input: [{ role: 'user', content: input },
        { type: 'function_call', call_id: call.call_id, name: call.name, arguments: call.arguments },
        { type: 'function_call_output', call_id: call.call_id, output: '{"temperature_c": 21}' }],
    });
    assert.equal(next.usage.output_tokens, 3);
    assert.ok(next.usage.input_tokens > r.usage.input_tokens);
  });
});
