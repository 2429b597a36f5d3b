// Forced tool calls by constrained decoding, end to end: tool_choice "required" or a named
// function (OpenAI chat, streamed or not), Anthropic's "any" and "tool", and the Responses API's
// "required" each come back as a call whose name is one of the tools' and whose arguments parse
// and match the tool's parameters schema. The tiny model writes noise (left alone, the forced
// prefix is followed by no JSON at all), so only the constraint can make these calls whole.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { MODEL_NAME, anthropicTools, responsesTools, startServer, stopCleanly } from './lib.mjs';
import {
  MAX_TOKENS, TOOLS, checkCall, eachForcedChatCall, eachStreamedForcedCall, forcedToolUse, messages,
  requiredFunctionCall,
} from './forced_calls.mjs';

const BASE = { model: MODEL_NAME, messages, tools: TOOLS, max_tokens: MAX_TOKENS };

let server;
let client;

before(async () => {
  server = await startServer(['--max-batch', '4', '--kv-cache-mb', '64']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(() => stopCleanly(server));

test('chat: a forced call is whole, its arguments of its tool\'s schema, greedy or sampled', async () => {
  await eachForcedChatCall(client, BASE, (c, call) => {
    checkCall(call.function.name, call.function.arguments);
  });
});

test('chat, streamed: the arguments\' deltas make the same call', async () => {
  await eachStreamedForcedCall(client, server.url, BASE, ({ name, args }) => checkCall(name, args));
});

test('Anthropic tool_choice any and tool: a tool_use block with input of the schema', async () => {
  for (const tool_choice of [{ type: 'any', disable_parallel_tool_use: true },
    { type: 'tool', name: 'get_time' }]) {
    const use = await forcedToolUse(server.url, {
      model: MODEL_NAME, max_tokens: MAX_TOKENS, messages, tools: anthropicTools(TOOLS),
      tool_choice, temperature: 0,
    });
    checkCall(use.name, use.input);
  }
});

test('Responses API tool_choice required: a function_call of the schema', async () => {
  const call = await requiredFunctionCall(client, {
    model: MODEL_NAME, input: messages[0].content, tools: responsesTools(TOOLS),
    max_output_tokens: MAX_TOKENS, temperature: 0,
  });
  checkCall(call.name, call.arguments);
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
