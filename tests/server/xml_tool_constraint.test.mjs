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

import { ROOT, anthropicTools, responsesTools, startServer, stopCleanly } from './lib.mjs';
import {
  MAX_TOKENS, checkCall as checkWeatherOrTime, eachForcedChatCall, eachStreamedForcedCall,
  finishedRequiredCalls, forcedToolUse, messages, requiredFunctionCall,
} from './forced_calls.mjs';

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
const BASE = { model: NAME, messages, tools: TOOLS, max_tokens: MAX_TOKENS };

// Whether `args` (a JSON text or an object) is what the named tool's schema accepts: the checks
// of forced_calls.mjs against this get_weather, and those of the two parameters only it has.
function checkCall(name, args) {
  const a = checkWeatherOrTime(name, args, WEATHER);
  const what = JSON.stringify(a);
  if (name === 'get_weather') {
    if ('note' in a) assert.ok(typeof a.note === 'string' && [...a.note].length <= 6, what);
    if ('range' in a) {
      assert.deepEqual(Object.keys(a.range).sort(), ['hi', 'lo'], what);
      assert.ok(Number.isInteger(a.range.lo) && Number.isInteger(a.range.hi), what);
    }
  }
}

let server;
let client;

before(async () => {
  server = await startServer(['--served-model-name', NAME, '--max-batch', '4', '--kv-cache-mb', '64'],
    { model: FIXTURE });
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(() => stopCleanly(server));

test('chat: a forced XML call is whole, its parameters of its tool\'s schema, greedy or sampled', async () => {
  await eachForcedChatCall(client, BASE, (c, call) => {
    checkCall(call.function.name, call.function.arguments);
  });
});

test('chat, streamed: the arguments\' deltas make the same call', async () => {
  await eachStreamedForcedCall(client, server.url, BASE, ({ name, args }) => checkCall(name, args));
});

test('required with parallel calls: every call the model finishes is of its tool\'s schema', async () => {
  for (const seed of [1, 2]) {
    for (const call of await finishedRequiredCalls(client, BASE, seed)) {
      checkCall(call.function.name, call.function.arguments);
    }
  }
});

test('Anthropic tool_choice any and tool: a tool_use block with input of the schema', async () => {
  for (const tool_choice of [{ type: 'any', disable_parallel_tool_use: true },
    { type: 'tool', name: 'get_weather' }]) {
    const use = await forcedToolUse(server.url, {
      model: NAME, max_tokens: MAX_TOKENS, messages, tools: anthropicTools(TOOLS), tool_choice,
      temperature: 0,
    });
    checkCall(use.name, use.input);
  }
});

test('Responses API tool_choice required: a function_call of the schema', async () => {
  const call = await requiredFunctionCall(client, {
    model: NAME, input: messages[0].content, tools: responsesTools(TOOLS),
    max_output_tokens: MAX_TOKENS, temperature: 0,
  });
  checkCall(call.name, call.arguments);
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
