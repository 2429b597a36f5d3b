// The official Anthropic TypeScript SDK (@anthropic-ai/sdk) against a real `recur serve`: what a
// Messages API user relies on. messages.create streamed and not, the SDK's messages.stream
// helper, every stop_reason, usage against `recur tokenize`, system prompts, multi-turn, tool_use
// and tool_result turns, thinking blocks, countTokens and the SDK's typed errors.
//
// The tiny model writes noise, so each scenario's output is made certain as in xml_tools.test.mjs:
// a copy of the model directory whose tokenizer gains one added token per scenario (ids after the
// Qwen3 tokenizer's last, inside the model's vocabulary), with the whole answer as its text.
// logit_bias makes the token certain; stop_token_ids makes it the last (stop_reason end_turn).
// Without stop_token_ids the token repeats until max_tokens.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';
import Anthropic from '@anthropic-ai/sdk';

import { MODEL, RECUR, startServer, stopCleanly } from './lib.mjs';

const NAME = 'claude-tiny';
const KEY = 'sk-ant-recur-test';
const EOS = 151645;  // <|im_end|>

// Text of each added token. ARGS follows the forced prefix of a named tool call
// (`<tool_call>\n{"name": "get_weather", "arguments": {`), ANY the prefix of tool_choice any.
const OUTPUTS = {
  REPLY: 'The forecast says sunny, 21 degrees.',
  THINK: '<think>\nThe user asks about the weather.\n</think>\n\nIt is sunny.',
  ARGS: '"city": "Paris", "days": 3}}\n</tool_call>',
  ANY: '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
  TWO_CALLS: 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' +
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
};

const TOOLS = [
  {
    name: 'get_weather',
    description: 'Current weather for a city',
    input_schema: {
      type: 'object',
      properties: { city: { type: 'string' }, days: { type: 'integer' } },
      required: ['city'],
    },
  },
  {
    name: 'get_time',
    description: 'Current time in a zone',
    input_schema: { type: 'object', properties: { zone: { type: 'string' } } },
  },
];
// The same tools as a chat-template request carries them (OpenAI's function shape).
const CHAT_TOOLS = TOOLS.map((t) => ({
  type: 'function',
  function: { name: t.name, description: t.description, parameters: t.input_schema },
}));

const QUESTION = 'What is the weather in Paris?';
const messages = [{ role: 'user', content: QUESTION }];
const SYSTEM = 'You are a weather bot. Answer in one sentence.';
// A conversation as recur's chat template takes it, for the multi-turn and tool_result tests.
const CHAT_TURNS = [
  { role: 'user', content: QUESTION },
  { role: 'assistant', content: 'Sunny, 21 degrees.' },
  { role: 'user', content: 'And tomorrow in Lyon?' },
];
const CALL_ID = 'toolu_01';  // the Qwen3 template renders no call ids
const CHAT_TOOL_TURN = [
  ...messages,
  { role: 'assistant', content: '', tool_calls: [{ id: CALL_ID, type: 'function',
    function: { name: 'get_weather', arguments: { city: 'Paris', days: 3 } } }] },
  { role: 'tool', tool_call_id: CALL_ID, content: 'sunny, 21 C' },
];
const PREFILL = [
  { role: 'user', content: 'Pick one: (A) Sol (B) Helios' },
  { role: 'assistant', content: 'The answer is (' },
];

let server;
let client;
let dir;
const ids = {};

// The one token `key` is the whole output, and the turn ends after it.
const only = (key) => ({
  temperature: 0, logit_bias: { [ids[key]]: 100 }, stop_token_ids: [ids[key]],
});
// The token `key`, again and again until max_tokens.
const repeat = (key) => ({ temperature: 0, logit_bias: { [ids[key]]: 100 } });

// `recur chat-template` on a chat request, and `recur tokenize` on requests (or {text}) for the
// same model directory. Token counts are kept: one tokenizer load serves the whole file.
let files = 0;
function cli(command, lines) {
  const file = path.join(dir, `request-${files++}.json`);
  fs.writeFileSync(file, lines.map((l) => JSON.stringify(l) + '\n').join(''));
  const flag = command === 'tokenize' ? '--jsonl' : '--request';
  return execFileSync(RECUR, [command, '--model', dir, flag, file], { encoding: 'utf8' });
}
const render = (request) => cli('chat-template', [request]);
const counted = new Map();
function tokenizeAll(requests) {
  const out = cli('tokenize', requests).trim().split('\n');
  assert.equal(out.length, requests.length);
  requests.forEach((r, i) => counted.set(JSON.stringify(r), JSON.parse(out[i]).ids.length));
}
function tokens(request) {
  if (!counted.has(JSON.stringify(request))) tokenizeAll([request]);
  return counted.get(JSON.stringify(request));
}
const promptTokens = (request) => tokens({ add_generation_prompt: true, ...request });
// The prompt of PREFILL as a continuation of its assistant turn: the turn rendered without
// its end.
function prefilled() {
  const closed = render({ messages: PREFILL, add_generation_prompt: false });
  assert.ok(closed.endsWith('The answer is (<|im_end|>\n'), closed);
  return closed.slice(0, -'<|im_end|>\n'.length);
}

// All the prompt tokens of a response's usage: Anthropic counts prefix-cache reads apart.
const promptOf = (usage) => usage.input_tokens + (usage.cache_read_input_tokens ?? 0);
// A value as its JSON carries it (the SDK's stream snapshot keeps private, hidden fields).
const plain = (x) => JSON.parse(JSON.stringify(x));
// Tool-use ids are random per response; content compared apart from them.
const withoutIds = (content) => plain(content).map((b) => (b.type === 'tool_use' ? { ...b, id: '' } : b));

// Checks the event grammar of one Messages stream and rebuilds the message from the deltas:
// message_start, then per block content_block_start / _delta* / _stop with consecutive indexes,
// then one message_delta and message_stop.
function replay(events) {
  const types = events.map((e) => e.type);
  assert.equal(types[0], 'message_start', types.join());
  assert.deepEqual(types.slice(-2), ['message_delta', 'message_stop'], types.join());
  const start = events[0].message;
  assert.equal(start.type, 'message');
  assert.equal(start.role, 'assistant');
  assert.deepEqual(start.content, []);
  assert.equal(start.stop_reason, null);
  assert.equal(start.stop_sequence, null);
  assert.equal(typeof start.usage.input_tokens, 'number');
  assert.equal(typeof start.usage.output_tokens, 'number');
  const content = [];
  let open = null;  // the block being streamed
  const deltaType = { text: 'text_delta', thinking: 'thinking_delta', tool_use: 'input_json_delta' };
  for (const e of events.slice(1, -2)) {
    if (e.type === 'content_block_start') {
      assert.equal(open, null, 'a block starts while another is open');
      assert.equal(e.index, content.length);
      open = { block: plain(e.content_block), json: '' };
      if (open.block.type === 'text') assert.equal(open.block.text, '');
      if (open.block.type === 'thinking') assert.equal(open.block.thinking, '');
      if (open.block.type === 'tool_use') assert.deepEqual(open.block.input, {});
      content.push(open.block);
    } else if (e.type === 'content_block_delta') {
      assert.ok(open, 'a delta outside a block');
      assert.equal(e.index, content.length - 1);
      const b = open.block;
      if (b.type === 'thinking' && e.delta.type === 'signature_delta') {
        b.signature = e.delta.signature;
        continue;
      }
      assert.equal(e.delta.type, deltaType[b.type], `${e.delta.type} in a ${b.type} block`);
      if (b.type === 'text') b.text += e.delta.text;
      else if (b.type === 'thinking') b.thinking += e.delta.thinking;
      else open.json += e.delta.partial_json;
    } else if (e.type === 'content_block_stop') {
      assert.ok(open, 'a stop outside a block');
      assert.equal(e.index, content.length - 1);
      if (open.block.type === 'tool_use' && open.json !== '') open.block.input = JSON.parse(open.json);
      open = null;
    } else {
      assert.equal(e.type, 'ping', `unexpected event ${e.type}`);
    }
  }
  assert.equal(open, null, 'a block was never stopped');
  const delta = events.at(-2);
  return {
    start,
    content,
    stop_reason: delta.delta.stop_reason,
    stop_sequence: delta.delta.stop_sequence,
    usage: delta.usage,
  };
}

// A request through messages.stream: its events, replayed, and the SDK's final message.
async function sdkStream(params) {
  const events = [];
  const stream = client.messages.stream(params);
  stream.on('streamEvent', (e) => events.push(plain(e)));
  const final = await stream.finalMessage();
  return { events, replayed: replay(events), final, stream };
}

// A request through create({stream: true}): its events, replayed.
async function rawStream(params) {
  const events = [];
  for await (const e of await client.messages.create({ ...params, stream: true })) events.push(plain(e));
  return { events, replayed: replay(events) };
}

before(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-anthropic-sdk-'));
  for (const f of fs.readdirSync(MODEL)) {
    if (f !== 'tokenizer.json') fs.symlinkSync(path.join(MODEL, f), path.join(dir, f));
  }
  const tok = JSON.parse(fs.readFileSync(path.join(MODEL, 'tokenizer.json'), 'utf8'));
  let next = Math.max(...tok.added_tokens.map((t) => t.id)) + 1;
  for (const [key, content] of Object.entries(OUTPUTS)) {
    ids[key] = next;
    tok.added_tokens.push({
      id: next++, content, single_word: false, lstrip: false, rstrip: false,
      normalized: false, special: false,
    });
  }
  fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(tok));
  // The prompts the tests compare usage with, tokenized in one run of `recur tokenize`.
  tokenizeAll([
    { messages },
    { messages: [{ role: 'system', content: SYSTEM }, ...messages] },
    { messages: CHAT_TURNS },
    { messages: CHAT_TOOL_TURN, tools: CHAT_TOOLS },
    { messages, chat_template_kwargs: { enable_thinking: false } },
    { messages: [{ role: 'system', content: 'Be brief.' }, ...messages], tools: CHAT_TOOLS },
  ].map((r) => ({ add_generation_prompt: true, ...r })).concat([{ text: prefilled() }]));
  server = await startServer(['--served-model-name', NAME, '--api-key', KEY], { model: dir });
  client = new Anthropic({ baseURL: server.url, apiKey: KEY, maxRetries: 0 });
});

after(() => stopCleanly(server, dir));

test('create: one text block, end_turn, usage as recur tokenize counts the prompt', async () => {
  const r = await client.messages.create({ model: NAME, max_tokens: 16, messages, ...only('REPLY') });
  assert.match(r.id, /^msg_/);
  assert.equal(r.type, 'message');
  assert.equal(r.role, 'assistant');
  assert.equal(r.model, NAME);
  assert.deepEqual(plain(r.content), [{ type: 'text', text: OUTPUTS.REPLY }]);
  assert.equal(r.stop_reason, 'end_turn');
  assert.equal(r.stop_sequence, null);
  assert.equal(r.usage.output_tokens, 1);
  assert.equal(promptOf(r.usage), promptTokens({ messages }));
  assert.ok(r.usage.input_tokens > 0);
});

test('create: the end of sequence token ends the turn with no content', async () => {
  const body = { model: NAME, max_tokens: 8, messages, temperature: 0, logit_bias: { [EOS]: 100 } };
  const r = await client.messages.create(body);
  assert.equal(r.stop_reason, 'end_turn');
  assert.equal(r.stop_sequence, null);
  assert.deepEqual(plain(r.content), []);
  const s = await rawStream(body);
  assert.deepEqual(s.replayed.content, []);
  assert.equal(s.replayed.stop_reason, 'end_turn');
});

test('create: max_tokens ends the turn with stop_reason max_tokens', async () => {
  const r = await client.messages.create({ model: NAME, max_tokens: 3, messages, ...repeat('REPLY') });
  assert.equal(r.stop_reason, 'max_tokens');
  assert.equal(r.stop_sequence, null);
  assert.deepEqual(plain(r.content), [{ type: 'text', text: OUTPUTS.REPLY.repeat(3) }]);
  assert.equal(r.usage.output_tokens, 3);

  // The model's own noise, cut by max_tokens the same way.
  const noise = await client.messages.create({
    model: NAME, max_tokens: 5, messages, temperature: 0, ignore_eos: true,
  });
  assert.equal(noise.stop_reason, 'max_tokens');
  assert.equal(noise.usage.output_tokens, 5);
  assert.equal(noise.content.length, 1);
  assert.equal(noise.content[0].type, 'text');
});

test('stop_sequences: the text ends before the first one written, which is named', async () => {
  const body = {
    model: NAME, max_tokens: 3, messages, ...repeat('REPLY'),
    stop_sequences: ['never-written', 'degrees.The'],  // spans the first two tokens
  };
  const r = await client.messages.create(body);
  assert.equal(r.stop_reason, 'stop_sequence');
  assert.equal(r.stop_sequence, 'degrees.The');
  assert.deepEqual(plain(r.content), [{ type: 'text', text: 'The forecast says sunny, 21 ' }]);
  assert.equal(r.usage.output_tokens, 2);

  // Of two, the one that comes first in the text, whichever is first in the list.
  const first = await client.messages.create({ ...body, stop_sequences: ['21', 'forecast'] });
  assert.equal(first.stop_sequence, 'forecast');
  assert.deepEqual(plain(first.content), [{ type: 'text', text: 'The ' }]);

  const { final, replayed } = await sdkStream(body);
  assert.equal(final.stop_reason, 'stop_sequence');
  assert.equal(final.stop_sequence, 'degrees.The');
  assert.equal(replayed.stop_sequence, 'degrees.The');
  assert.deepEqual(plain(final.content), plain(r.content));
});

test('messages.stream: event order, deltas, and finalMessage() equal to create()', async () => {
  const body = { model: NAME, max_tokens: 16, messages, ...only('THINK') };
  const r = await client.messages.create(body);
  const { events, replayed, final, stream } = await sdkStream(body);
  assert.deepEqual(events.map((e) => e.type), [
    'message_start',
    'content_block_start', 'content_block_delta', 'content_block_stop',
    'content_block_start', 'content_block_delta', 'content_block_stop',
    'message_delta', 'message_stop',
  ]);
  assert.deepEqual(replayed.content.map((b) => b.type), ['thinking', 'text']);
  assert.deepEqual(plain(final.content), replayed.content);
  assert.deepEqual(plain(final.content), plain(r.content));
  assert.equal(final.stop_reason, 'end_turn');
  assert.equal(replayed.stop_reason, 'end_turn');
  assert.equal(final.stop_sequence, null);
  assert.equal(final.id, replayed.start.id);
  assert.match(final.id, /^msg_/);
  assert.equal(final.model, NAME);
  // message_delta carries the whole message's usage, which the SDK keeps.
  assert.equal(replayed.usage.output_tokens, 1);
  assert.equal(final.usage.output_tokens, 1);
  assert.equal(promptOf(final.usage), promptOf(r.usage));
  assert.equal(promptOf(replayed.usage), promptTokens({ messages }));
  // The SDK's helpers see the same text.
  assert.equal(await stream.finalText(), 'It is sunny.');
});

test('create({stream: true}): raw events add up to the non-streamed message', async () => {
  const body = { model: NAME, max_tokens: 6, messages, temperature: 0, ignore_eos: true };
  const r = await client.messages.create(body);
  const { events, replayed } = await rawStream(body);
  assert.equal(events.filter((e) => e.type === 'content_block_start').length, 1);
  assert.ok(events.filter((e) => e.type === 'content_block_delta').length >= 1);
  assert.deepEqual(replayed.content, plain(r.content));
  assert.equal(replayed.stop_reason, 'max_tokens');
  assert.equal(replayed.stop_sequence, null);
  assert.equal(replayed.usage.output_tokens, 6);
  assert.equal(promptOf(replayed.usage), promptOf(r.usage));
  assert.equal(replayed.start.model, NAME);
});

test('system prompt: a string and a list of text blocks', async () => {
  const system = SYSTEM;
  const count = (extra) => client.messages.countTokens({ model: NAME, messages, ...extra });
  const plainCount = (await count({})).input_tokens;
  const withString = (await count({ system })).input_tokens;
  assert.equal(withString, promptTokens({ messages: [{ role: 'system', content: system }, ...messages] }));
  assert.ok(withString > plainCount);
  // One block is the same prompt as the string; a second block adds to it.
  assert.equal((await count({ system: [{ type: 'text', text: system }] })).input_tokens, withString);
  const two = (await count({
    system: [{ type: 'text', text: system, cache_control: { type: 'ephemeral' } },
      { type: 'text', text: 'Use Celsius.' }],
  })).input_tokens;
  assert.ok(two > withString, `${two} <= ${withString}`);

  const r = await client.messages.create({
    model: NAME, max_tokens: 4, messages, system: [{ type: 'text', text: system }], ...only('REPLY'),
  });
  assert.equal(promptOf(r.usage), withString);
  assert.deepEqual(plain(r.content), [{ type: 'text', text: OUTPUTS.REPLY }]);
});

test('multi-turn: earlier turns as strings and blocks are all in the prompt', async () => {
  const turns = [
    { role: 'user', content: QUESTION },
    { role: 'assistant', content: [{ type: 'text', text: 'Sunny, 21 degrees.' }] },
    { role: 'user', content: [{ type: 'text', text: 'And tomorrow in Lyon?' }] },
  ];
  const n = promptTokens({ messages: CHAT_TURNS });
  assert.equal((await client.messages.countTokens({ model: NAME, messages: turns })).input_tokens, n);
  const r = await client.messages.create({ model: NAME, max_tokens: 4, messages: turns, ...only('REPLY') });
  assert.equal(promptOf(r.usage), n);
  assert.equal(r.stop_reason, 'end_turn');
});

test('tool_use: a named tool gives one tool_use block with the typed input', async () => {
  const body = {
    model: NAME, max_tokens: 8, messages, tools: TOOLS,
    tool_choice: { type: 'tool', name: 'get_weather' }, ...only('ARGS'),
  };
  const r = await client.messages.create(body);
  assert.equal(r.stop_reason, 'tool_use');
  assert.equal(r.stop_sequence, null);
  assert.equal(r.content.length, 1);
  const use = r.content[0];
  assert.equal(use.type, 'tool_use');
  assert.match(use.id, /^toolu_/);
  assert.equal(use.name, 'get_weather');
  assert.deepEqual(use.input, { city: 'Paris', days: 3 });
  assert.equal(r.usage.output_tokens, 1);

  // Streamed: the SDK builds the input from input_json_delta events.
  const jsonEvents = [];
  const events = [];
  const stream = client.messages.stream(body);
  stream.on('inputJson', (delta, snapshot) => jsonEvents.push([delta, plain(snapshot)]));
  stream.on('streamEvent', (e) => events.push(plain(e)));
  const final = await stream.finalMessage();
  const replayed = replay(events);
  assert.equal(final.stop_reason, 'tool_use');
  assert.deepEqual(withoutIds(final.content), withoutIds(r.content));
  assert.deepEqual(plain(final.content), replayed.content);
  assert.match(final.content[0].id, /^toolu_/);
  assert.ok(jsonEvents.length >= 1);
  assert.deepEqual(jsonEvents.at(-1)[1], { city: 'Paris', days: 3 });
});

test('tool_use: tool_choice auto, text then two calls; disable_parallel_tool_use keeps one', async () => {
  const body = { model: NAME, max_tokens: 8, messages, tools: TOOLS, ...only('TWO_CALLS') };
  const r = await client.messages.create(body);
  assert.equal(r.stop_reason, 'tool_use');
  assert.deepEqual(r.content.map((b) => b.type), ['text', 'tool_use', 'tool_use']);
  assert.equal(r.content[0].text.trim(), 'Let me look that up.');
  assert.deepEqual(r.content.slice(1).map((b) => [b.name, b.input]),
    [['get_weather', { city: 'Oslo' }], ['get_time', { zone: 'CET' }]]);
  assert.notEqual(r.content[1].id, r.content[2].id);

  const { final, replayed } = await sdkStream(body);
  assert.deepEqual(withoutIds(final.content), withoutIds(r.content));
  assert.deepEqual(plain(final.content), replayed.content);
  assert.equal(replayed.stop_reason, 'tool_use');

  const one = await client.messages.create({
    ...body, tool_choice: { type: 'auto', disable_parallel_tool_use: true },
  });
  assert.deepEqual(one.content.filter((b) => b.type === 'tool_use').map((b) => b.name), ['get_weather']);
  assert.equal(one.stop_reason, 'tool_use');
});

test('tool_use: tool_choice any lets the model name the tool', async () => {
  const r = await client.messages.create({
    model: NAME, max_tokens: 8, messages, tools: TOOLS, tool_choice: { type: 'any' }, ...only('ANY'),
  });
  assert.equal(r.stop_reason, 'tool_use');
  assert.deepEqual(plain(r.content).map((b) => [b.type, b.name, b.input]),
    [['tool_use', 'get_time', { zone: 'CET' }]]);
});

test('tool_result: the call and its result go back in the next turn', async () => {
  const call = await client.messages.create({
    model: NAME, max_tokens: 8, messages, tools: TOOLS,
    tool_choice: { type: 'tool', name: 'get_weather' }, ...only('ARGS'),
  });
  const use = call.content[0];
  const turns = [
    ...messages,
    { role: 'assistant', content: call.content },
    { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: 'sunny, 21 C' }] },
  ];
  // The prompt the chat template renders for the same conversation in OpenAI's shape.
  const rendered = render({ messages: CHAT_TOOL_TURN, tools: CHAT_TOOLS, add_generation_prompt: true });
  assert.ok(rendered.includes('"arguments": {"city": "Paris", "days": 3}'), rendered);
  assert.ok(rendered.includes('<tool_response>\nsunny, 21 C\n</tool_response>'), rendered);
  const n = promptTokens({ messages: CHAT_TOOL_TURN, tools: CHAT_TOOLS });
  assert.equal((await client.messages.countTokens({ model: NAME, messages: turns, tools: TOOLS })).input_tokens, n);

  const r = await client.messages.create({
    model: NAME, max_tokens: 8, messages: turns, tools: TOOLS, ...only('REPLY'),
  });
  assert.equal(promptOf(r.usage), n);
  assert.equal(r.stop_reason, 'end_turn');
  assert.deepEqual(plain(r.content), [{ type: 'text', text: OUTPUTS.REPLY }]);

  // The result as a list of text blocks, is_error given, is the same prompt.
  const blocks = structuredClone(turns);
  blocks[2].content[0].content = [{ type: 'text', text: 'sunny, 21 C' }];
  blocks[2].content[0].is_error = false;
  assert.equal((await client.messages.countTokens({ model: NAME, messages: blocks, tools: TOOLS })).input_tokens, n);
});

test('thinking: a thinking block then text, streamed as thinking_delta; thinking.disabled', async () => {
  const body = { model: NAME, max_tokens: 8, messages, ...only('THINK') };
  const r = await client.messages.create(body);
  assert.deepEqual(r.content.map((b) => b.type), ['thinking', 'text']);
  assert.equal(r.content[0].thinking, 'The user asks about the weather.');
  assert.equal(typeof r.content[0].signature, 'string');
  assert.equal(r.content[1].text, 'It is sunny.');

  const thoughts = [];
  const stream = client.messages.stream(body);
  stream.on('thinking', (delta) => thoughts.push(delta));
  const final = await stream.finalMessage();
  assert.equal(thoughts.join(''), 'The user asks about the weather.');
  assert.deepEqual(plain(final.content), plain(r.content));

  // thinking.type reaches the chat template as enable_thinking.
  const count = async (thinking) =>
    (await client.messages.countTokens({ model: NAME, messages, thinking })).input_tokens;
  assert.equal(await count({ type: 'disabled' }),
    promptTokens({ messages, chat_template_kwargs: { enable_thinking: false } }));
  assert.equal(await count({ type: 'enabled', budget_tokens: 1024 }), promptTokens({ messages }));
  assert.ok(await count({ type: 'disabled' }) > await count({ type: 'enabled', budget_tokens: 1024 }));

  // A thinking block sent back in an earlier assistant turn is accepted.
  const next = await client.messages.create({
    model: NAME, max_tokens: 4, ...only('REPLY'),
    messages: [...messages, { role: 'assistant', content: r.content },
      { role: 'user', content: 'Thanks. And in Lyon?' }],
  });
  assert.equal(next.stop_reason, 'end_turn');
});

test('countTokens: the prompt tokens create() then reports', async () => {
  const body = { model: NAME, messages, system: 'Be brief.', tools: TOOLS };
  const { input_tokens: n } = await client.messages.countTokens(body);
  assert.equal(n, promptTokens({ messages: [{ role: 'system', content: 'Be brief.' }, ...messages],
    tools: CHAT_TOOLS }));
  const r = await client.messages.create({ ...body, max_tokens: 2, ...repeat('REPLY') });
  assert.equal(promptOf(r.usage), n);
  assert.equal(r.usage.output_tokens, 2);
});

test('errors arrive as the SDK\'s typed errors naming the bad field', async () => {
  const isBad = (field) => (e) => {
    assert.ok(e instanceof Anthropic.BadRequestError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, 400);
    assert.equal(e.error.type, 'error');
    assert.equal(e.error.error.type, 'invalid_request_error');
    assert.ok(e.message.includes(field), e.message);
    return true;
  };
  await assert.rejects(client.messages.create({ model: NAME, messages }), isBad('max_tokens'));
  await assert.rejects(client.messages.create({ model: NAME, messages, max_tokens: -1 }), isBad('max_tokens'));
  await assert.rejects(client.messages.create({ model: NAME, messages, max_tokens: 0 }), isBad('max_tokens'));
  await assert.rejects(
    client.messages.create({ model: NAME, max_tokens: 4, messages: [{ role: 'system', content: 'hi' }] }),
    isBad('messages[0].role'));
  await assert.rejects(client.messages.create({ model: NAME, max_tokens: 4, messages: [] }), isBad('messages'));
  await assert.rejects(
    client.messages.create({ model: NAME, max_tokens: 4, messages: [{ role: 'user', content: [
      { type: 'image', source: { type: 'base64', media_type: 'image/png', data: 'AAAA' } }] }] }),
    isBad('messages[0].content[0]'));
  await assert.rejects(
    client.messages.create({ model: NAME, max_tokens: 4, messages, tools: TOOLS,
      tool_choice: { type: 'tool', name: 'no_such_tool' } }),
    isBad('no_such_tool'));
  // Beyond the context (the SDK insists on streaming for so many tokens).
  await assert.rejects(client.messages.stream({ model: NAME, max_tokens: 100000000, messages }).finalMessage(),
    (e) => isBad('')(e) && /maximum context length is \d+ tokens/.test(e.message));
  // Through the stream helper too: the request fails before any event.
  await assert.rejects(client.messages.stream({ model: NAME, messages, max_tokens: -1 }).finalMessage(),
    isBad('max_tokens'));

  await assert.rejects(client.messages.create({ model: 'no-such-model', max_tokens: 4, messages }), (e) => {
    assert.ok(e instanceof Anthropic.NotFoundError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, 404);
    assert.equal(e.error.error.type, 'not_found_error');
    assert.ok(e.message.includes('no-such-model'), e.message);
    return true;
  });
  const wrongKey = new Anthropic({ baseURL: server.url, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(wrongKey.messages.create({ model: NAME, max_tokens: 4, messages }), (e) => {
    assert.ok(e instanceof Anthropic.AuthenticationError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, 401);
    assert.equal(e.error.error.type, 'authentication_error');
    return true;
  });
});

// message_start counts input_tokens apart from cache reads, as message_delta does and as the
// Messages API does everywhere: clients that read usage off message_start (proxies, billing)
// would otherwise count cached tokens twice. The engine's token events carry the prefix-cache
// count, so message_start, sent with the first tokens, knows it.
// Request (twice; the second streamed): {"model", "max_tokens": 4, "messages": [user],
// "system": <long string>, "stream": true, "temperature": 0, "ignore_eos": true}
test('message_start usage counts cache reads apart, as message_delta does', async () => {
  const body = {
    model: NAME, max_tokens: 4, messages, temperature: 0, ignore_eos: true,
    system: 'You report the weather for any city, briefly and in metric units. '.repeat(6),
  };
  await client.messages.create(body);  // fills the prefix cache
  const { replayed } = await rawStream(body);
  assert.ok(replayed.usage.cache_read_input_tokens > 0, 'the second request read the prefix cache');
  assert.equal(replayed.start.usage.cache_read_input_tokens, replayed.usage.cache_read_input_tokens);
  assert.equal(replayed.start.usage.input_tokens, replayed.usage.input_tokens);
});

// When the token that ends the output is both one of stop_token_ids and the one that writes a
// stop sequence, the text is cut before the stop sequence, and the API names the stop sequence
// whenever one was generated: stop_reason "stop_sequence", stop_sequence "sunny" (not
// "end_turn" for the stop token).
// Request (REPLY is the added token 151669): {"max_tokens": 9, "messages": [user],
// "temperature": 0, "logit_bias": {REPLY: 100}, "stop_token_ids": [REPLY],
// "stop_sequences": ["sunny"]}
test('a stop sequence in the last token is named even when the token also stops', async () => {
  const r = await client.messages.create({
    model: NAME, max_tokens: 9, messages, ...only('REPLY'), stop_sequences: ['sunny'],
  });
  assert.deepEqual(plain(r.content), [{ type: 'text', text: 'The forecast says ' }]);
  assert.equal(r.stop_reason, 'stop_sequence');
  assert.equal(r.stop_sequence, 'sunny');
});

// In the Messages API a conversation that ends on an assistant message is a prefill: the model
// picks up right where that text stops, and the response holds only what it adds. The prompt
// ends "The answer is (" (28 tokens here), not with that turn closed and a new assistant turn
// opened ("The answer is (<|im_end|>\n<|im_start|>assistant\n", 33 tokens).
// Request: {"max_tokens": 4, "messages": [{"role": "user",
// "content": "Pick one: (A) Sol (B) Helios"}, {"role": "assistant", "content": "The answer is ("}]}
test('a final assistant message is continued, not closed', async () => {
  const want = tokens({ text: prefilled() });
  const { input_tokens: got } = await client.messages.countTokens({ model: NAME, messages: PREFILL });
  assert.equal(got, want, 'the prompt ends inside the prefilled assistant turn');
});

// A forced tool call (tool_choice "tool" or "any") that max_tokens cuts off must not come back as
// a text block holding the server's forced call prefix ("<tool_call>\n{\"name\": \"get_weather\",
// \"arguments\": {" and the model's tokens after it). That markup is recur's scaffolding, not
// model output the client asked for; with a forced tool the API's content is tool_use (cut off
// when max_tokens ends it), never the chat template's tool-call syntax as text.
// Request: {"max_tokens": 2, "messages": [user], "tools": [...], "tool_choice": {"type": "tool",
// "name": "get_weather"}, "temperature": 0, "ignore_eos": true}
test('a forced tool call cut by max_tokens does not leak the call markup as text', async () => {
  for (const tool_choice of [{ type: 'tool', name: 'get_weather' }, { type: 'any' }]) {
    const r = await client.messages.create({
      model: NAME, max_tokens: 2, messages, tools: TOOLS, tool_choice, temperature: 0, ignore_eos: true,
    });
    assert.equal(r.stop_reason, 'max_tokens');
    const text = r.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
    assert.ok(!text.includes('<tool_call>'), `${tool_choice.type}: ${JSON.stringify(r.content)}`);
  }
});

// thinking {"type": "adaptive"} (and "between_tools") are ThinkingConfigParam values of the
// Messages API, and this SDK warns that "enabled" is deprecated in favour of "adaptive" on newer
// models. A server that has no budget to adapt takes it as "enabled".
// Request: {"max_tokens": 8, "messages": [user], "thinking": {"type": "adaptive"}}
test('thinking type adaptive is accepted', async () => {
  const r = await client.messages.create({
    model: NAME, max_tokens: 8, messages, thinking: { type: 'adaptive' }, ...only('THINK'),
  });
  assert.deepEqual(r.content.map((b) => b.type), ['thinking', 'text']);
  assert.equal(r.stop_reason, 'end_turn');
});
