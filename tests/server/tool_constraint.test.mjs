// Forced tool calls by constrained decoding, end to end: tool_choice "required" or a named
// function (OpenAI chat, streamed or not), Anthropic's "any" and "tool", and the Responses API's
// "required" each come back as a call whose name is one of the tools' and whose arguments parse
// and match the tool's parameters schema. The tiny model writes noise (left alone, the forced
// prefix is followed by no JSON at all), so only the constraint can make these calls whole.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { MODEL_NAME, postJson, startServer } from './lib.mjs';
import { FORCED_CHOICES, eachForcedChatCall, streamedCall } from './forced_calls.mjs';

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
        unit: { enum: ['c', 'f'] },
        alerts: { type: 'boolean' },
      },
      required: ['city', 'days', 'unit'],
      additionalProperties: false,
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
      additionalProperties: false,
    },
  },
};
const TOOLS = [WEATHER, TIME];
const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
// Enough for any call these schemas allow (whitespace runs and numbers are bounded).
const MAX_TOKENS = 1000;

// Whether `args` (a JSON text) is what the named tool's schema accepts.
function checkCall(name, args) {
  const a = typeof args === 'string' ? JSON.parse(args) : args;
  assert.equal(typeof a, 'object');
  if (name === 'get_weather') {
    assert.ok(['Paris', 'Tokyo', 'Lima'].includes(a.city), JSON.stringify(a));
    assert.ok(Number.isInteger(a.days), JSON.stringify(a));
    assert.ok(['c', 'f'].includes(a.unit), JSON.stringify(a));
    if ('alerts' in a) assert.equal(typeof a.alerts, 'boolean');
    for (const k of Object.keys(a)) assert.ok(['city', 'days', 'unit', 'alerts'].includes(k), k);
  } else {
    assert.equal(name, 'get_time');
    assert.equal(typeof a.zone, 'string');
    assert.ok([...a.zone].length <= 6, a.zone);
    assert.deepEqual(Object.keys(a), ['zone']);
  }
}

let server;
let client;

before(async () => {
  server = await startServer(['--max-batch', '4', '--kv-cache-mb', '64']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(async () => {
  const r = await server.stop();
  assert.deepEqual(r, { code: 0, signal: null }, server.output());
});

test('chat: a forced call is whole, its arguments of its tool\'s schema, greedy or sampled', async () => {
  const base = { model: MODEL_NAME, messages, tools: TOOLS, max_tokens: MAX_TOKENS };
  await eachForcedChatCall(client, base, (c, call) => {
    checkCall(call.function.name, call.function.arguments);
  });
});

test('chat, streamed: the arguments\' deltas make the same call', async () => {
  for (const tool_choice of FORCED_CHOICES) {
    const body = {
      model: MODEL_NAME, messages, tools: TOOLS, tool_choice, max_tokens: MAX_TOKENS,
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

test('Anthropic tool_choice any and tool: a tool_use block with input of the schema', async () => {
  const tools = TOOLS.map((t) => ({ name: t.function.name, input_schema: t.function.parameters }));
  for (const tool_choice of [{ type: 'any', disable_parallel_tool_use: true },
    { type: 'tool', name: 'get_time' }]) {
    const res = await postJson(`${server.url}/v1/messages`, {
      model: MODEL_NAME, max_tokens: MAX_TOKENS, messages, tools, tool_choice, temperature: 0,
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
    model: MODEL_NAME, input: messages[0].content, tools, tool_choice: 'required',
    parallel_tool_calls: false, max_output_tokens: MAX_TOKENS, temperature: 0,
  });
  assert.equal(r.status, 'completed', JSON.stringify(r.output));
  const calls = r.output.filter((o) => o.type === 'function_call');
  assert.equal(calls.length, 1, JSON.stringify(r.output));
  checkCall(calls[0].name, calls[0].arguments);
});

test('a schema the compiler does not take is no refusal: the arguments are still a JSON object', async () => {
  const tools = [{ type: 'function', function: { name: 'roll', parameters: { type: 'object',
    properties: { sides: { type: 'integer', minimum: 2 } }, required: ['sides'] } } }];
  // Any object goes, and the tiny model may run on in it: a call max_tokens cuts has the object
  // as written so far (seed 2 finishes one).
  for (const sampling of [{ temperature: 0 }, { temperature: 1, seed: 2 }]) {
    const c = (await client.chat.completions.create({
      model: MODEL_NAME, messages, tools, tool_choice: 'required', parallel_tool_calls: false,
      max_tokens: 64, ...sampling,
    })).choices[0];
    assert.equal(c.message.tool_calls.length, 1, JSON.stringify(c.message));
    assert.equal(c.message.tool_calls[0].function.name, 'roll');
    const text = c.message.tool_calls[0].function.arguments;
    if (c.finish_reason === 'length') {
      assert.match(text, /^\{/);
      continue;
    }
    const args = JSON.parse(text);
    assert.equal(typeof args, 'object');
    assert.ok(!Array.isArray(args) && args !== null);
  }
});
