// Kimi's chat format end to end, through the official OpenAI SDK and the Anthropic Messages API:
// a model directory with Kimi's tokenizer files (tests/data/kimi-tokenizer-tiny: tiktoken.model,
// tokenizer_config.json naming Kimi's tokenizer class, Kimi-Linear's chat template) over the tiny
// Qwen3.5 checkpoint's weights. The server reads the call-section form off the template, with no
// flag. As in xml_tools.test.mjs, the model writes noise, so each scenario's output is one added
// token (ids past Kimi's special tokens, inside the model's vocabulary) whose text is what a
// Kimi model would write; logit_bias makes it certain and stop_token_ids makes it the last
// (include_stop_str_in_output keeps its text in the output). A forced call's constraint
// (kimi_tool_constraint.test.mjs) takes such a token: it reads the markers the text spells whole
// as the marker tokens.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import {
  ANTHROPIC_HEADERS, RECUR, anthropicMessage, anthropicTools, anthropicToolUseStream,
  chatStreamParts, onlyToken, postJson, startServer, stopCleanly,
} from './lib.mjs';
import { KIMI_NAME as NAME, kimiModelDir } from './kimi_model.mjs';

const call = (id, args) =>
  `<|tool_call_begin|>${id}<|tool_call_argument_begin|>${args}<|tool_call_end|>`;
const OUTPUTS = {
  // After the forced prefix `<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:`.
  NAMED_REST: '0<|tool_call_argument_begin|>{"city": "São Paulo", "days": 3}<|tool_call_end|>' +
    '<|tool_calls_section_end|>',
  TWO_CALLS: 'Let me check.<|tool_calls_section_begin|>' +
    call('functions.get_weather:0', '{"city": "Oslo"}') +
    call('functions.get_time:1', '{"zone": "CET"}') + '<|tool_calls_section_end|>',
  THINK_THEN_CALL: '<think>Need the weather first.</think><|tool_calls_section_begin|>' +
    call('functions.get_weather:0', '{"city": "Rome"}') + '<|tool_calls_section_end|>',
  MALFORMED: 'Trying.<|tool_calls_section_begin|>' +
    call('functions.get_weather:0', '{"city": oops}') + '<|tool_calls_section_end|>',
};

const TOOLS = [
  { type: 'function', function: { name: 'get_weather', description: 'Weather for a city',
    parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } },
      required: ['city'] } } },
  { type: 'function', function: { name: 'get_time',
    parameters: { type: 'object', properties: { zone: { type: 'string' } } } } },
];
const messages = [{ role: 'user', content: 'What is the weather in São Paulo?' }];

let server;
let client;
let dir;
let ids;  // OUTPUTS' keys -> their added tokens' ids

before(async () => {
  ({ dir, ids } = kimiModelDir('recur-kimi-tools-', OUTPUTS));
  server = await startServer(['--served-model-name', NAME], { model: dir });
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'none', maxRetries: 0 });
});

after(() => stopCleanly(server, dir));

const only = (key) => onlyToken(ids[key]);
const named = { type: 'function', function: { name: 'get_weather' } };

test('a forced call: the section is parsed into tool_calls with the model\'s id', async () => {
  const r = await client.chat.completions.create({
    model: NAME, messages, tools: TOOLS, tool_choice: named, ...only('NAMED_REST'),
  });
  const c = r.choices[0];
  assert.equal(r.usage.completion_tokens, 1);
  assert.equal(c.finish_reason, 'tool_calls');
  assert.equal(c.message.content, null);
  assert.equal(c.message.tool_calls.length, 1);
  const t = c.message.tool_calls[0];
  assert.equal(t.id, 'functions.get_weather:0');
  assert.equal(t.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(t.function.arguments), { city: 'São Paulo', days: 3 });

  const { deltas, finish, content } = await chatStreamParts(await client.chat.completions.create({
    model: NAME, messages, tools: TOOLS, tool_choice: named, stream: true, ...only('NAMED_REST'),
  }));
  assert.equal(finish, 'tool_calls');
  assert.equal(content, '');
  assert.equal(deltas[0].id, 'functions.get_weather:0');
  assert.equal(deltas[0].function.name, 'get_weather');
  const args = deltas.map((d) => d.function?.arguments ?? '').join('');
  assert.deepEqual(JSON.parse(args), { city: 'São Paulo', days: 3 });
});

test('tool_choice auto: text, then two calls in one section; streamed the same', async () => {
  const body = { model: NAME, messages, tools: TOOLS, ...only('TWO_CALLS') };
  const r = await client.chat.completions.create(body);
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.content, 'Let me check.');
  assert.deepEqual(m.tool_calls.map((c) => [c.id, c.function.name, JSON.parse(c.function.arguments)]),
    [['functions.get_weather:0', 'get_weather', { city: 'Oslo' }],
      ['functions.get_time:1', 'get_time', { zone: 'CET' }]]);

  const final = await client.beta.chat.completions.stream(body).finalChatCompletion();
  const s = final.choices[0].message;
  assert.equal(s.content, m.content);
  assert.deepEqual(s.tool_calls.map((c) => [c.id, c.function.name, JSON.parse(c.function.arguments)]),
    m.tool_calls.map((c) => [c.id, c.function.name, JSON.parse(c.function.arguments)]));

  const one = await client.chat.completions.create({ ...body, parallel_tool_calls: false });
  assert.deepEqual(one.choices[0].message.tool_calls.map((c) => c.function.name), ['get_weather']);
});

test('<think> becomes reasoning_content, and the call after it a call', async () => {
  const body = { model: NAME, messages, tools: TOOLS, ...only('THINK_THEN_CALL') };
  const r = await client.chat.completions.create(body);
  const m = r.choices[0].message;
  assert.equal(m.reasoning_content, 'Need the weather first.');
  assert.equal(m.content, null);
  assert.equal(m.tool_calls[0].function.name, 'get_weather');

  const { reasoning, deltas } =
    await chatStreamParts(await client.chat.completions.create({ ...body, stream: true }));
  assert.equal(reasoning, m.reasoning_content);
  assert.equal(deltas[0].id, 'functions.get_weather:0');
});

test('a malformed section comes back as the text the model wrote', async () => {
  const body = { model: NAME, messages, tools: TOOLS, ...only('MALFORMED') };
  const r = await client.chat.completions.create(body);
  const c = r.choices[0];
  assert.equal(c.message.tool_calls, undefined);
  assert.equal(c.finish_reason, 'stop');
  assert.equal(c.message.content, OUTPUTS.MALFORMED);
  let content = '';
  for await (const chunk of await client.chat.completions.create({ ...body, stream: true })) {
    content += chunk.choices[0]?.delta?.content ?? '';
    assert.equal(chunk.choices[0]?.delta?.tool_calls, undefined);
  }
  assert.equal(content, OUTPUTS.MALFORMED);
});

test('the next turn sends the call and its result back: the prompt is what recur renders', async () => {
  const turn = [
    ...messages,
    { role: 'assistant', content: null, tool_calls: [{ id: 'functions.get_weather:0',
      type: 'function', function: { name: 'get_weather', arguments: '{"city": "Oslo"}' } }] },
    { role: 'tool', tool_call_id: 'functions.get_weather:0', content: 'sunny, 21 C' },
  ];
  const r = await client.chat.completions.create({
    model: NAME, messages: turn, tools: TOOLS, max_tokens: 1, temperature: 0,
    return_token_ids: true,
  });
  const request = path.join(dir, 'turn.json');
  fs.writeFileSync(request, JSON.stringify({ messages: turn, tools: TOOLS,
                                             add_generation_prompt: true }) + '\n');
  const run = (...args) => execFileSync(RECUR, args, { encoding: 'utf8' });
  const text = run('chat-template', '--model', dir, '--request', request);
  assert.ok(text.includes('<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>' +
    call('functions.get_weather:0', '{"city": "Oslo"}') + '<|tool_calls_section_end|><|im_end|>' +
    '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>' +
    '<|im_assistant|>assistant<|im_middle|>'), text);
  const tokenized = JSON.parse(run('tokenize', '--model', dir, '--jsonl', request));
  assert.deepEqual(r.choices[0].prompt_token_ids, tokenized.ids);
});

test('Anthropic messages: tool_use blocks, streamed and not', async () => {
  const body = {
    model: NAME, max_tokens: 8, messages, tools: anthropicTools(TOOLS),
    tool_choice: { type: 'tool', name: 'get_weather' },
    ...only('NAMED_REST'),
  };
  const msg = await anthropicMessage(server.url, body);
  assert.equal(msg.stop_reason, 'tool_use');
  const uses = msg.content.filter((b) => b.type === 'tool_use');
  assert.equal(uses.length, 1);
  assert.equal(uses[0].id, 'functions.get_weather:0');
  assert.equal(uses[0].name, 'get_weather');
  assert.deepEqual(uses[0].input, { city: 'São Paulo', days: 3 });

  const { start, json, stop } = await anthropicToolUseStream(server.url, body);
  assert.equal(start.name, 'get_weather');
  assert.equal(start.id, 'functions.get_weather:0');
  assert.deepEqual(JSON.parse(json), { city: 'São Paulo', days: 3 });
  assert.equal(stop, 'tool_use');

  // A malformed section from the model: text, and the turn ends normally.
  const bad = await (await postJson(`${server.url}/v1/messages`,
    { ...body, tool_choice: { type: 'auto' }, ...only('MALFORMED') }, ANTHROPIC_HEADERS)).json();
  assert.equal(bad.stop_reason, 'end_turn');
  assert.deepEqual(bad.content, [{ type: 'text', text: OUTPUTS.MALFORMED }]);
});
