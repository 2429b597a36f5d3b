// Forced tool calls in Kimi's call-section form by constrained decoding, end to end. The server
// runs a model directory made as kimi_tools.test.mjs makes it: Kimi's tokenizer files
// (tests/data/kimi-tokenizer-tiny, whose call markers are tokens of their own) and Kimi-Linear's
// chat template over the tiny Qwen3.5 checkpoint's weights. tool_choice "required" or a named
// function (chat, streamed or not), Anthropic's "any" and "tool", and the Responses API's
// "required" each come back as a call of one of the tools, with the model's id
// (functions.NAME:INDEX), whose arguments the tool's parameters schema accepts. The model writes
// noise, so only the constraint can make these calls whole.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { ROOT, postJson, startServer } from './lib.mjs';
import { FORCED_CHOICES, eachForcedChatCall, streamedCall } from './forced_calls.mjs';

const WEIGHTS = path.join(ROOT, 'tests/data/qwen3_5-chat-tiny');
const KIMI = path.join(ROOT, 'tests/data/kimi-tokenizer-tiny');
const NAME = 'kimi-chat-tiny';

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
// Enough for any call these schemas allow (whitespace runs, numbers and the index are bounded).
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
    for (const k of Object.keys(a)) assert.ok(k in WEATHER.function.parameters.properties, k);
  } else {
    assert.equal(name, 'get_time');
    assert.ok(typeof a.zone === 'string' && [...a.zone].length <= 6, what);
    assert.deepEqual(Object.keys(a), ['zone']);
  }
}

// The model's own id, as the parser reads it and the template writes it back.
function checkId(id, name) {
  assert.match(id, /^functions\.[a-z_]+:(0|[1-9][0-9]{0,5})$/);
  assert.ok(id.startsWith(`functions.${name}:`), id);
}

// The id of <|tool_calls_section_end|> in Kimi's tiny tokenizer.
const SECTION_END = Number(Object.entries(JSON.parse(
  fs.readFileSync(path.join(KIMI, 'tokenizer_config.json'), 'utf8')).added_tokens_decoder)
  .find(([, t]) => t.content === '<|tool_calls_section_end|>')[0]);

let server;
let client;
let dir;

before(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-kimi-constraint-'));
  for (const f of ['config.json', 'generation_config.json', 'model.safetensors']) {
    fs.symlinkSync(fs.realpathSync(path.join(WEIGHTS, f)), path.join(dir, f));
  }
  for (const f of ['tiktoken.model', 'chat_template.jinja', 'tokenizer_config.json']) {
    fs.symlinkSync(fs.realpathSync(path.join(KIMI, f)), path.join(dir, f));
  }
  server = await startServer(['--served-model-name', NAME, '--max-batch', '4', '--kv-cache-mb', '64'],
    { model: dir });
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(async () => {
  const r = await server.stop();
  fs.rmSync(dir, { recursive: true });
  assert.deepEqual(r, { code: 0, signal: null }, server.output());
});

test('chat: a forced Kimi call is whole, its arguments of its tool\'s schema, greedy or sampled', async () => {
  const base = { model: NAME, messages, tools: TOOLS, max_tokens: MAX_TOKENS, return_token_ids: true };
  await eachForcedChatCall(client, base, (c, call, what) => {
    // The section's close is a token of its own, the last before the end of the turn.
    assert.equal(c.token_ids.at(-2), SECTION_END, `${what}: ${c.token_ids}`);
    assert.equal(c.token_ids.filter((t) => t === SECTION_END).length, 1, what);
    checkId(call.id, call.function.name);
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
    const { id, name, args, finish } = await streamedCall(server.url, body);
    assert.equal(finish, 'tool_calls');
    assert.equal(id, whole.id);
    assert.equal(name, whole.function.name);
    assert.deepEqual(JSON.parse(args), JSON.parse(whole.function.arguments));
    checkCall(name, args);
  }
});

test('required with parallel calls: every call the model finishes is of its tool\'s schema', async () => {
  for (const seed of [1, 2, 5]) {
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
    for (const call of whole) {
      checkId(call.id, call.function.name);
      checkCall(call.function.name, call.function.arguments);
    }
    // Each call's index is the one before's plus one (Kimi counts its calls): ids are distinct.
    const index = (call) => Number(call.id.slice(call.id.lastIndexOf(':') + 1));
    for (let i = 1; i < whole.length; ++i) assert.equal(index(whole[i]), index(whole[i - 1]) + 1);
  }
});

test('Anthropic tool_choice any and tool: a tool_use block with input of the schema', async () => {
  const tools = TOOLS.map((t) => ({ name: t.function.name, input_schema: t.function.parameters }));
  for (const tool_choice of [{ type: 'any', disable_parallel_tool_use: true },
    { type: 'tool', name: 'get_weather' }]) {
    for (const temperature of [0, 1]) {
      const res = await postJson(`${server.url}/v1/messages`, {
        model: NAME, max_tokens: MAX_TOKENS, messages, tools, tool_choice, temperature,
      }, { 'anthropic-version': '2023-06-01' });
      assert.equal(res.status, 200);
      const m = await res.json();
      assert.equal(m.stop_reason, 'tool_use', JSON.stringify(m));
      const uses = m.content.filter((b) => b.type === 'tool_use');
      assert.equal(uses.length, 1, JSON.stringify(m.content));
      const text = m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
      assert.equal(text.trim(), '', JSON.stringify(m.content));
      if (tool_choice.name) assert.equal(uses[0].name, tool_choice.name);
      checkId(uses[0].id, uses[0].name);
      checkCall(uses[0].name, uses[0].input);
    }
  }
});

test('Responses API tool_choice required: a function_call of the schema', async () => {
  const tools = TOOLS.map((t) => ({
    type: 'function', name: t.function.name, parameters: t.function.parameters,
  }));
  for (const temperature of [0, 1]) {
    const r = await client.responses.create({
      model: NAME, input: messages[0].content, tools, tool_choice: 'required',
      parallel_tool_calls: false, max_output_tokens: MAX_TOKENS, temperature,
    });
    assert.equal(r.status, 'completed', JSON.stringify(r.output));
    const calls = r.output.filter((o) => o.type === 'function_call');
    assert.equal(calls.length, 1, JSON.stringify(r.output));
    checkId(calls[0].call_id, calls[0].name);
    checkCall(calls[0].name, calls[0].arguments);
  }
});
