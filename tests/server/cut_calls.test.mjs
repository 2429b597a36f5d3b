// A forced tool call that max_tokens cuts comes back with its arguments as the model wrote them,
// cut (as OpenAI and vLLM return a call cut by length), never as made-up whole arguments such as
// "{}": in chat completions (streamed or not), the Responses API and Anthropic's streamed
// input_json_delta. Anthropic's non-streamed tool_use input must be an object: there it is the
// arguments closed where what was written is whole (what a client parsing the stream gets).
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { MODEL_NAME, postJson, sseEvents, startServer, stopCleanly } from './lib.mjs';
import { streamedCall } from './forced_calls.mjs';

// The fuzzed request: one tool, an integer argument, and too few tokens for the call.
const PARAMS = { type: 'object', properties: { a: { type: 'integer' } }, required: ['a'] };
const TOOLS = [{ type: 'function', function: { name: 'get', parameters: PARAMS } }];
const messages = [{ role: 'user', content: 'hi' }];
const MAX_TOKENS = 20;
const ANTHROPIC = { 'anthropic-version': '2023-06-01' };

let server;

before(async () => {
  server = await startServer(['--max-batch', '4', '--kv-cache-mb', '64']);
});

after(() => stopCleanly(server));

async function post(path, body, headers) {
  const res = await postJson(`${server.url}${path}`, { model: MODEL_NAME, ...body }, headers);
  const j = await res.json();
  assert.equal(res.status, 200, JSON.stringify(j));
  return j;
}

// The cut chat call, and the arguments the model wrote for it: the generated text after the
// forced prefix (which, for a named tool, ends with the arguments' opening brace).
async function cutChatCall(tool_choice) {
  const c = (await post('/v1/chat/completions', {
    messages, tools: TOOLS, tool_choice, max_tokens: MAX_TOKENS, temperature: 0,
    parallel_tool_calls: false, return_token_ids: true,
  })).choices[0];
  assert.equal(c.finish_reason, 'length', JSON.stringify(c));
  assert.equal(c.message.tool_calls?.length, 1, JSON.stringify(c.message));
  const { prompt: raw } = await post('/detokenize', { tokens: c.token_ids });
  let written;
  if (tool_choice === 'required') {
    const at = raw.indexOf('"arguments":');
    assert.ok(at >= 0, `the model did not get to the arguments: ${JSON.stringify(raw)}`);
    written = raw.slice(at + '"arguments":'.length).trimStart();
  } else {
    written = `{${raw}`;
  }
  return { call: c.message.tool_calls[0], written };
}

const CHOICES = ['required', { type: 'function', function: { name: 'get' } }];

test('chat: a cut forced call has the arguments as written, streamed or not', async () => {
  for (const tool_choice of CHOICES) {
    const what = JSON.stringify(tool_choice);
    const { call, written } = await cutChatCall(tool_choice);
    assert.equal(call.function.name, 'get', what);
    assert.equal(call.function.arguments, written, what);
    assert.notEqual(call.function.arguments, '{}', what);
    const s = await streamedCall(server.url, {
      model: MODEL_NAME, messages, tools: TOOLS, tool_choice, max_tokens: MAX_TOKENS,
      temperature: 0, parallel_tool_calls: false,
    });
    assert.equal(s.finish, 'length', what);
    assert.equal(s.name, 'get', what);
    assert.equal(s.args, written, what);
  }
});

test('Responses API: the cut function_call is incomplete, with the arguments as written', async () => {
  const { written } = await cutChatCall('required');
  const r = await post('/v1/responses', {
    input: 'hi', tools: [{ type: 'function', name: 'get', parameters: PARAMS }],
    tool_choice: 'required', max_output_tokens: MAX_TOKENS, temperature: 0,
    parallel_tool_calls: false,
  });
  assert.equal(r.status, 'incomplete', JSON.stringify(r));
  const calls = r.output.filter((o) => o.type === 'function_call');
  assert.equal(calls.length, 1, JSON.stringify(r.output));
  assert.equal(calls[0].status, 'incomplete');
  assert.equal(calls[0].arguments, written);
});

test('Anthropic: input_json_delta streams the arguments as written; input is an object', async () => {
  const { written } = await cutChatCall('required');
  const body = {
    messages, max_tokens: MAX_TOKENS, temperature: 0,
    tools: [{ name: 'get', input_schema: PARAMS }],
    tool_choice: { type: 'any', disable_parallel_tool_use: true },
  };
  const m = await post('/v1/messages', body, ANTHROPIC);
  assert.equal(m.stop_reason, 'max_tokens', JSON.stringify(m));
  const uses = m.content.filter((b) => b.type === 'tool_use');
  assert.equal(uses.length, 1, JSON.stringify(m.content));
  assert.equal(uses[0].name, 'get');
  assert.equal(typeof uses[0].input, 'object');
  assert.ok(!Array.isArray(uses[0].input) && uses[0].input !== null);
  // Only what was written whole: every key of the input is in the cut arguments.
  for (const k of Object.keys(uses[0].input)) assert.ok(written.includes(JSON.stringify(k)), k);

  const res = await postJson(`${server.url}/v1/messages`,
    { model: MODEL_NAME, ...body, stream: true }, ANTHROPIC);
  assert.equal(res.status, 200);
  let partial = '';
  let stop = null;
  for await (const ev of sseEvents(res)) {
    const e = JSON.parse(ev.data);
    if (e.type === 'content_block_delta' && e.delta.type === 'input_json_delta') {
      partial += e.delta.partial_json;
    }
    if (e.type === 'message_delta') stop = e.delta.stop_reason;
  }
  assert.equal(stop, 'max_tokens');
  assert.equal(partial, written);
});
