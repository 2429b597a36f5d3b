// Forced tool calls in Kimi's call-section form by constrained decoding, end to end. The server
// runs the model directory kimi_model.mjs makes, as kimi_tools.test.mjs does: Kimi's tokenizer
// files (tests/data/kimi-tokenizer-tiny, whose call markers are tokens of their own) and
// Kimi-Linear's chat template over the tiny Qwen3.5 checkpoint's weights. tool_choice
// "required" or a named function (chat, streamed or not), Anthropic's "any" and "tool", and the
// Responses API's "required" each come back as a call of one of the tools, with the model's id
// (functions.NAME:INDEX), whose arguments the tool's parameters schema accepts. The model writes
// noise, so only the constraint can make these calls whole.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { anthropicTools, responsesTools, startServer, stopCleanly } from './lib.mjs';
import {
  MAX_TOKENS, TOOLS, checkCall, eachForcedChatCall, eachStreamedForcedCall, finishedRequiredCalls,
  forcedToolUse, messages, requiredFunctionCall,
} from './forced_calls.mjs';
import { KIMI, KIMI_NAME as NAME, kimiModelDir } from './kimi_model.mjs';

const BASE = { model: NAME, messages, tools: TOOLS, max_tokens: MAX_TOKENS };

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
  ({ dir } = kimiModelDir('recur-kimi-constraint-'));
  server = await startServer(['--served-model-name', NAME, '--max-batch', '4', '--kv-cache-mb', '64'],
    { model: dir });
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});

after(() => stopCleanly(server, dir));

test('chat: a forced Kimi call is whole, its arguments of its tool\'s schema, greedy or sampled', async () => {
  await eachForcedChatCall(client, { ...BASE, return_token_ids: true }, (c, call, what) => {
    // The section's close is a token of its own, the last before the end of the turn.
    assert.equal(c.token_ids.at(-2), SECTION_END, `${what}: ${c.token_ids}`);
    assert.equal(c.token_ids.filter((t) => t === SECTION_END).length, 1, what);
    checkId(call.id, call.function.name);
    checkCall(call.function.name, call.function.arguments);
  });
});

test('chat, streamed: the arguments\' deltas make the same call', async () => {
  await eachStreamedForcedCall(client, server.url, BASE, ({ id, name, args }, whole) => {
    assert.equal(id, whole.id);
    checkCall(name, args);
  });
});

test('required with parallel calls: every call the model finishes is of its tool\'s schema', async () => {
  for (const seed of [1, 2, 5]) {
    const whole = await finishedRequiredCalls(client, BASE, seed);
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
  for (const tool_choice of [{ type: 'any', disable_parallel_tool_use: true },
    { type: 'tool', name: 'get_weather' }]) {
    for (const temperature of [0, 1]) {
      const use = await forcedToolUse(server.url, {
        model: NAME, max_tokens: MAX_TOKENS, messages, tools: anthropicTools(TOOLS), tool_choice,
        temperature,
      });
      checkId(use.id, use.name);
      checkCall(use.name, use.input);
    }
  }
});

test('Responses API tool_choice required: a function_call of the schema', async () => {
  for (const temperature of [0, 1]) {
    const call = await requiredFunctionCall(client, {
      model: NAME, input: messages[0].content, tools: responsesTools(TOOLS),
      max_output_tokens: MAX_TOKENS, temperature,
    });
    checkId(call.call_id, call.name);
    checkCall(call.name, call.arguments);
  }
});
