// Forced tool calls in Qwen3.5's XML form by constrained decoding, end to end. The server runs
// tests/data/qwen3_5-chat-tiny (the tiny model and Qwen's vocabulary under a Qwen3.5-style chat
// template that asks for <function=…><parameter=…> calls; models/qwen3_5-tiny has no tokenizer).
// tool_choice "required" or a named function (chat, streamed or not), Anthropic's "any" and
// "tool", and the Responses API's "required" each come back as a call of one of the tools whose
// parameters are the tool's, every required one given and each typed as its schema says. The
// tiny model writes noise (left alone, the forced prefix is followed by no call at all), so only
// the constraint can make these calls whole.
import assert from 'node:assert/strict';
import path from 'node:path';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { ROOT, postJson, startServer } from './lib.mjs';
import { FORCED_CHOICES, eachForcedChatCall, streamedCall } from './forced_calls.mjs';

const FIXTURE = path.join(ROOT, 'tests/data/qwen3_5-chat-tiny');
const NAME = 'qwen3_5-chat-tiny';

const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Weather for a city',
    parameters: {
      type: 'object',
      properties: {
        city: { enum: ['Paris', 'Tokyo', 'Lima'] },
        days: { type: 'integer' },
        unit: { type: 'string', enum: ['c', 'f'] },
        alerts: { type: 'boolean' },
        note: { type: 'string', maxLength: 6 },
        range: {
          type: 'object',
          properties: { lo: { type: 'integer' }, hi: { type: 'integer' } },
          required: ['lo', 'hi'],
          additionalProperties: false,
        },
      },
      required: ['city', 'days', 'unit'],
    },
  },
};
const TIME = {
  type: 'function',
  function: {
    name: 'get_time',
    parameters: {
      type: 'object',
      properties: { zone: { type: 'string', maxLength: 6 } },
      required: ['zone'],
    },
  },
};
const TOOLS = [WEATHER, TIME];
const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
// Enough for any call these schemas allow (text values, whitespace runs and numbers are bounded).
const MAX_TOKENS = 1000;

// Whether `args` (a JSON text or an object) is what the named tool's schema accepts.
function checkCall(name, args) {
  const a = typeof args === 'string' ? JSON.parse(args) : args;
  const what = JSON.stringify(a);
  assert.equal(typeof a, 'object', what);
  if (name === 'get_weather') {
    assert.ok(['Paris', 'Tokyo', 'Lima'].includes(a.city), what);
    assert.ok(Number.isInteger(a.days), what);
    assert.ok(['c', 'f'].includes(a.unit), what);
    if ('alerts' in a) assert.equal(typeof a.alerts, 'boolean', what);
    if ('note' in a) assert.ok(typeof a.note === 'string' && [...a.note].length <= 6, what);
    if ('range' in a) {
      assert.deepEqual(Object.keys(a.range).sort(), ['hi', 'lo'], what);
      assert.ok(Number.isInteger(a.range.lo) && Number.isInteger(a.range.hi), what);
    }
    for (const k of Object.keys(a)) assert.ok(k in WEATHER.function.parameters.properties, k);
  } else {
    assert.equal(name, 'get_time');
    assert.ok(typeof a.zone === 'string' && [...a.zone].length <= 6, what);
    assert.deepEqual(Object.keys(a), ['zone']);
  }
}

let server;
let client;

before(async () => {
  server = await startServer(['--served-model-name', NAME, '--max-batch', '4', '--kv-cache-mb', '64'],
    { model: FIXTURE });
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(async () => {
  const r = await server.stop();
  assert.deepEqual(r, { code: 0, signal: null }, server.output());
});

test('chat: a forced XML call is whole, its parameters of its tool\'s schema, greedy or sampled', async () => {
  const base = { model: NAME, messages, tools: TOOLS, max_tokens: MAX_TOKENS };
  await eachForcedChatCall(client, base, (c, call) => {
    checkCall(call.function.name, call.function.arguments);
  });
});

test('chat, streamed: the arguments\' deltas make the same call', async () => {
  for (const tool_choice of FORCED_CHOICES) {
    const body = {
      model: NAME, messages, tools: TOOLS, tool_choice, max_tokens: MAX_TOKENS,
      parallel_tool_calls: false, temperature: 0,
    };
    const whole = (await client.chat.completions.create(body)).choices[0].message.tool_calls[0];
    const { name, args, finish } = await streamedCall(server.url, body);
    assert.equal(finish, 'tool_calls');
    assert.equal(name, whole.function.name);
    assert.deepEqual(JSON.parse(args), JSON.parse(whole.function.arguments));
    checkCall(name, args);
  }
});

test('required with parallel calls: every call the model finishes is of its tool\'s schema', async () => {
  for (const seed of [1, 2]) {
    const c = (await client.chat.completions.create({
      model: NAME, messages, tools: TOOLS, tool_choice: 'required', max_tokens: MAX_TOKENS,
      temperature: 1, seed,
    })).choices[0];
    assert.ok(['tool_calls', 'length'].includes(c.finish_reason), JSON.stringify(c));
    assert.ok(!c.message.content, JSON.stringify(c.message));
    const calls = c.message.tool_calls;
    assert.ok(calls.length >= 1);
    // max_tokens may cut the last call; the ones before it are whole.
    const whole = c.finish_reason === 'length' ? calls.slice(0, -1) : calls;
    for (const call of whole) checkCall(call.function.name, call.function.arguments);
  }
});

test('Anthropic tool_choice any and tool: a tool_use block with input of the schema', async () => {
  const tools = TOOLS.map((t) => ({ name: t.function.name, input_schema: t.function.parameters }));
  for (const tool_choice of [{ type: 'any', disable_parallel_tool_use: true },
    { type: 'tool', name: 'get_weather' }]) {
    const res = await postJson(`${server.url}/v1/messages`, {
      model: NAME, max_tokens: MAX_TOKENS, messages, tools, tool_choice, temperature: 0,
    }, { 'anthropic-version': '2023-06-01' });
    assert.equal(res.status, 200);
    const m = await res.json();
    assert.equal(m.stop_reason, 'tool_use', JSON.stringify(m));
    const uses = m.content.filter((b) => b.type === 'tool_use');
    assert.equal(uses.length, 1, JSON.stringify(m.content));
    const text = m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
    assert.equal(text.trim(), '', JSON.stringify(m.content));
    if (tool_choice.name) assert.equal(uses[0].name, tool_choice.name);
    checkCall(uses[0].name, uses[0].input);
  }
});

test('Responses API tool_choice required: a function_call of the schema', async () => {
  const tools = TOOLS.map((t) => ({
    type: 'function', name: t.function.name, parameters: t.function.parameters,
  }));
  const r = await client.responses.create({
    model: NAME, input: messages[0].content, tools, tool_choice: 'required',
    parallel_tool_calls: false, max_output_tokens: MAX_TOKENS, temperature: 0,
  });
  assert.equal(r.status, 'completed', JSON.stringify(r.output));
  const calls = r.output.filter((o) => o.type === 'function_call');
  assert.equal(calls.length, 1, JSON.stringify(r.output));
  checkCall(calls[0].name, calls[0].arguments);
});

test('a keyword the schema compiler does not take leaves the type: still an integer', async () => {
  const tools = [{ type: 'function', function: { name: 'roll', parameters: { type: 'object',
    properties: { sides: { type: 'integer', minimum: 2 } }, required: ['sides'] } } }];
  const c = (await client.chat.completions.create({
    model: NAME, messages, tools, tool_choice: 'required', parallel_tool_calls: false,
    max_tokens: 200, temperature: 0,
  })).choices[0];
  assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c.message));
  assert.equal(c.message.tool_calls.length, 1, JSON.stringify(c.message));
  assert.equal(c.message.tool_calls[0].function.name, 'roll');
  const args = JSON.parse(c.message.tool_calls[0].function.arguments);
  assert.deepEqual(Object.keys(args), ['sides']);
  assert.ok(Number.isInteger(args.sides), JSON.stringify(args));
});
