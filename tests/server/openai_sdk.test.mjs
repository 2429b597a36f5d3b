// The official OpenAI Node.js SDK against a real `recur serve`: chat and completions,
// streaming and not, usage, logprobs, stop strings, seeds, n, tool calls (also through the
// SDK's stream helper), typed errors; and the Anthropic Messages API over plain fetch.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { MODEL_NAME, postJson, sseEvents, startServer, stopCleanly } from './lib.mjs';

const KEY = 'sk-recur-test';
// The tiny model writes noise; a forced tool call ends on the one token `}}` (id 3417), which
// logit_bias makes certain and stop_token_ids makes the last.
const CLOSE_BRACES = 3417;
const WEATHER_TOOL = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather for a city',
    parameters: { type: 'object', properties: {} },
  },
};
const FORCED_CALL = {
  tools: [WEATHER_TOOL],
  tool_choice: { type: 'function', function: { name: 'get_weather' } },
  logit_bias: { [CLOSE_BRACES]: 100 },
  stop_token_ids: [CLOSE_BRACES],
  include_stop_str_in_output: true,  // the call ends on the stop token's text
  temperature: 0,
};

let server;
let client;

before(async () => {
  server = await startServer(['--api-key', KEY, '--max-batch', '8']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: KEY, maxRetries: 0 });
});

after(() => stopCleanly(server));

const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];

test('models list names the served model', async () => {
  const list = await client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), [MODEL_NAME]);
  const one = await client.models.retrieve(MODEL_NAME);
  assert.equal(one.id, MODEL_NAME);
});

test('chat completion with usage, and the same text streamed', async () => {
  const r = await client.chat.completions.create({
    model: MODEL_NAME, messages, max_tokens: 12, temperature: 0, ignore_eos: true,
  });
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.model, MODEL_NAME);
  assert.equal(r.choices.length, 1);
  const c = r.choices[0];
  assert.equal(c.message.role, 'assistant');
  assert.equal(typeof c.message.content, 'string');
  assert.equal(c.finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 12);
  assert.ok(r.usage.prompt_tokens > 5);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 12);

  const stream = await client.chat.completions.create({
    model: MODEL_NAME, messages, max_tokens: 12, temperature: 0, ignore_eos: true, stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let reasoning = '';
  let finish = null;
  let usage = null;
  let role = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) {
      usage = chunk.usage;
      assert.equal(chunk.choices.length, 0);
      continue;
    }
    assert.equal(chunk.usage, null);  // include_usage: null on every other chunk
    const d = chunk.choices[0].delta;
    role ??= d.role;
    text += d.content ?? '';
    reasoning += d.reasoning_content ?? '';
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, c.message.content);
  assert.equal(reasoning, c.message.reasoning_content ?? '');
  assert.equal(finish, 'length');
  assert.deepEqual(usage, r.usage);
});

test('completions: text and token-id prompts, streaming, logprobs, echo', async () => {
  const r = await client.completions.create({
    model: MODEL_NAME, prompt: 'Once upon a time', max_tokens: 6, temperature: 0, logprobs: 3,
    ignore_eos: true,
  });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.usage.completion_tokens, 6);
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, 6);
  assert.equal(lp.token_logprobs.length, 6);
  assert.ok(lp.token_logprobs.every((x) => x <= 0));
  assert.ok(lp.top_logprobs.every((t) => Object.keys(t).length >= 1 && Object.keys(t).length <= 3));
  assert.equal(lp.tokens.join(''), r.choices[0].text);

  const ids = await client.completions.create({
    model: MODEL_NAME, prompt: [9707, 11, 1879], max_tokens: 5, temperature: 0, ignore_eos: true,
  });
  assert.equal(ids.usage.prompt_tokens, 3);
  assert.equal(ids.usage.completion_tokens, 5);

  const stream = await client.completions.create({
    model: MODEL_NAME, prompt: [9707, 11, 1879], max_tokens: 5, temperature: 0, ignore_eos: true,
    stream: true, stream_options: { include_usage: true },
  });
  let text = '';
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) text += c.text;
  }
  assert.equal(text, ids.choices[0].text);
  assert.equal(usage.completion_tokens, 5);

  const echo = await client.completions.create({
    model: MODEL_NAME, prompt: 'Hello', max_tokens: 2, temperature: 0, echo: true,
  });
  assert.ok(echo.choices[0].text.startsWith('Hello'));
});

test('chat logprobs with top_logprobs', async () => {
  const r = await client.chat.completions.create({
    model: MODEL_NAME, messages, max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2,
    ignore_eos: true,
  });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 4);
  for (const t of content) {
    assert.equal(typeof t.token, 'string');
    assert.ok(Array.isArray(t.bytes));
    assert.equal(t.top_logprobs.length, 2);
    assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob);
    assert.ok(t.logprob <= t.top_logprobs[0].logprob + 1e-6);  // greedy: the top token
  }
});

test('stop strings end the text before them', async () => {
  const base = { model: MODEL_NAME, prompt: 'The capital of France', temperature: 0, ignore_eos: true };
  const full = (await client.completions.create({ ...base, max_tokens: 20 })).choices[0].text;
  // A stop string taken from the middle of the greedy text.
  const cut = Math.floor(full.length / 2);
  const stop = full.slice(cut, cut + 3);
  const first = full.indexOf(stop);
  const r = await client.completions.create({ ...base, max_tokens: 20, stop: [stop, 'zzzz-never'] });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.choices[0].text, full.slice(0, first));
});

test('seeded sampling repeats; n gives several choices', async () => {
  const req = { model: MODEL_NAME, prompt: 'Tell me', max_tokens: 8, temperature: 1.0, seed: 1234 };
  const a = await client.completions.create(req);
  const b = await client.completions.create(req);
  assert.equal(a.choices[0].text, b.choices[0].text);
  const n = await client.chat.completions.create({
    model: MODEL_NAME, messages, max_tokens: 4, n: 3, temperature: 1.0, ignore_eos: true,
  });
  assert.deepEqual(n.choices.map((c) => c.index), [0, 1, 2]);
  assert.equal(n.usage.completion_tokens, 12);
});

test('tool call: parsed into tool_calls with finish_reason tool_calls', async () => {
  const r = await client.chat.completions.create({ model: MODEL_NAME, messages, ...FORCED_CALL });
  const c = r.choices[0];
  assert.equal(c.finish_reason, 'tool_calls');
  assert.equal(c.message.content, null);
  assert.equal(c.message.tool_calls.length, 1);
  const call = c.message.tool_calls[0];
  assert.match(call.id, /^call_/);
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), {});
});

test('tool call streamed as deltas, accumulated by the SDK', async () => {
  const stream = client.beta.chat.completions.stream({ model: MODEL_NAME, messages, ...FORCED_CALL });
  const deltas = [];
  stream.on('chunk', (chunk) => {
    for (const c of chunk.choices) if (c.delta.tool_calls) deltas.push(...c.delta.tool_calls);
  });
  const final = await stream.finalChatCompletion();
  const c = final.choices[0];
  assert.equal(c.finish_reason, 'tool_calls');
  assert.equal(c.message.tool_calls.length, 1);
  assert.equal(c.message.tool_calls[0].function.name, 'get_weather');
  assert.equal(c.message.tool_calls[0].function.arguments, '{}');
  assert.match(c.message.tool_calls[0].id, /^call_/);
  assert.ok(deltas.length >= 2, 'name and arguments arrive as separate deltas');
  assert.equal(deltas[0].index, 0);
});

test('tools offered but no call made: plain content', async () => {
  const r = await client.chat.completions.create({
    model: MODEL_NAME, messages, tools: [WEATHER_TOOL], max_tokens: 5, temperature: 0,
    logit_bias: { 151657: -100 },  // never <tool_call>
  });
  assert.equal(r.choices[0].message.tool_calls, undefined);
  assert.notEqual(r.choices[0].finish_reason, 'tool_calls');
});

test('structured outputs: a json_schema response parsed by the SDK, and streamed', async () => {
  // The random tiny model writes JSON only because the schema leaves it no other way.
  const schema = {
    type: 'object',
    properties: { ok: { type: 'boolean' }, color: { enum: ['red', 'green'] } },
    required: ['ok', 'color'],
    additionalProperties: false,
  };
  const request = {
    model: MODEL_NAME, messages, max_tokens: 200, temperature: 0,
    response_format: { type: 'json_schema', json_schema: { name: 'answer', strict: true, schema } },
  };
  const r = await client.beta.chat.completions.parse(request);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const parsed = r.choices[0].message.parsed;
  assert.deepEqual(Object.keys(parsed).sort(), ['color', 'ok']);
  assert.equal(typeof parsed.ok, 'boolean');
  assert.ok(['red', 'green'].includes(parsed.color), r.choices[0].message.content);
  let streamed = '';
  for await (const chunk of await client.chat.completions.create({ ...request, stream: true })) {
    streamed += chunk.choices[0]?.delta?.content ?? '';
  }
  assert.equal(streamed, r.choices[0].message.content);
  await assert.rejects(
    client.chat.completions.create({
      ...request,
      response_format: { type: 'json_schema', json_schema: { name: 'a', schema: { type: 'string', pattern: 'x' } } },
    }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === 'response_format.json_schema.schema' &&
      e.message.includes('pattern'));
});

test('errors arrive as the SDK typed errors', async () => {
  await assert.rejects(
    client.chat.completions.create({ model: 'no-such-model', messages }),
    (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === 'model_not_found');
  await assert.rejects(
    client.chat.completions.create({ model: MODEL_NAME, messages, max_tokens: -1 }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === 'max_tokens');
  await assert.rejects(
    client.completions.create({ model: MODEL_NAME, prompt: [1, 2], max_tokens: 10000000 }),
    (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded');
  const bad = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
});

test('Anthropic messages: text, streaming events, tool_use', async () => {
  const headers = { 'x-api-key': KEY, 'anthropic-version': '2023-06-01' };
  const body = { model: MODEL_NAME, max_tokens: 6, messages, temperature: 0, ignore_eos: true };
  let res = await postJson(`${server.url}/v1/messages`, body, headers);
  assert.equal(res.status, 200);
  const msg = await res.json();
  assert.equal(msg.type, 'message');
  assert.match(msg.id, /^msg_/);
  assert.equal(msg.stop_reason, 'max_tokens');
  assert.equal(msg.usage.output_tokens, 6);
  const text = msg.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

  res = await postJson(`${server.url}/v1/messages`, { ...body, stream: true }, headers);
  const events = [];
  let streamed = '';
  for await (const ev of sseEvents(res)) {
    const data = JSON.parse(ev.data);
    assert.equal(data.type, ev.event);
    events.push(ev.event);
    if (ev.event === 'content_block_delta' && data.delta.type === 'text_delta') streamed += data.delta.text;
    if (ev.event === 'message_delta') assert.equal(data.delta.stop_reason, 'max_tokens');
  }
  assert.equal(events[0], 'message_start');
  assert.deepEqual(events.slice(-2), ['message_delta', 'message_stop']);
  assert.ok(events.includes('content_block_start') === events.includes('content_block_stop'));
  assert.equal(streamed, text);

  res = await postJson(`${server.url}/v1/messages`, {
    model: MODEL_NAME, max_tokens: 8, messages,
    tools: [{ name: 'get_weather', input_schema: { type: 'object' } }],
    tool_choice: { type: 'tool', name: 'get_weather' },
    logit_bias: { [CLOSE_BRACES]: 100 }, stop_token_ids: [CLOSE_BRACES], temperature: 0,
  }, headers);
  const tool = await res.json();
  assert.equal(tool.stop_reason, 'tool_use');
  const use = tool.content.find((b) => b.type === 'tool_use');
  assert.equal(use.name, 'get_weather');
  assert.match(use.id, /^toolu_/);
  assert.deepEqual(use.input, {});

  res = await postJson(`${server.url}/v1/messages`, { ...body, max_tokens: 'x' }, headers);
  assert.equal(res.status, 400);
  const err = await res.json();
  assert.equal(err.type, 'error');
  assert.equal(err.error.type, 'invalid_request_error');
});
