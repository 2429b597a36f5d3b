// Qwen3.5's XML tool calls end to end, through the official OpenAI SDK and the Anthropic
// Messages API (plain fetch: @anthropic-ai/sdk is not installed here). The server reads the XML
// form off tests/data/qwen3_5-chat-tiny's chat template; tool_choice forces the call's opening
// (<tool_call>\n<function=NAME>\n) into the prompt, and constrained decoding keeps the rest a
// call of the tool (xml_tool_constraint.test.mjs), which the forced calls here are.
//
// The tiny model writes noise, so the rest of each call must be made certain: its copy of the
// Qwen3 tokenizer gains, at test time, one added token per scenario whose text is the rest of
// the call (ids past the tokenizer's last, inside the model's vocabulary). logit_bias makes that
// token certain and stop_token_ids makes it the last (include_stop_str_in_output keeps its text,
// which is otherwise left out, as vLLM leaves it), as the JSON tool tests do with `}}`. The
// parser sees exactly the text a real model would write; the typed arguments come from the
// request's tool schema.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import {
  ROOT, anthropicMessage, anthropicTools, anthropicToolUseStream, chatStreamParts, onlyToken,
  startServer, stopCleanly,
} from './lib.mjs';

const FIXTURE = path.join(ROOT, 'tests/data/qwen3_5-chat-tiny');
const NAME = 'qwen3_5-chat-tiny';

// The rest of a call, written after the forced prefix `<tool_call>\n<function=get_weather>\n`.
const TYPED_CALL =
  '<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n' +
  '<parameter=hourly>\ntrue\n</parameter>\n<parameter=units>\n{"temp": "C", "wind": [1, 2]}\n' +
  '</parameter>\n<parameter=note>\n2024\n</parameter>\n</function>\n</tool_call>';
const TYPED_ARGS = {
  city: 'São Paulo', days: 3, hourly: true, units: { temp: 'C', wind: [1, 2] },
  note: '2024',    // a string stays a string, digits and all
};
// A call the model writes unforced (no constraint), with values the schema does not expect.
const LOOSE_CALL =
  '<tool_call>\n<function=get_weather>\n<parameter=limit>\nnone\n</parameter>\n' +
  '<parameter=extra>\n4.5\n</parameter>\n</function>\n</tool_call>';
const LOOSE_ARGS = {
  limit: 'none',   // not an integer: kept as the text
  extra: 4.5,      // not in the schema: JSON when it parses
};
// tool_choice "required": the forced prefix ends at `<function=`; the model names the tool.
const TWO_CALLS =
  'get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n' +
  '<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n' +
  '</tool_call>';
const TWO_CALLS_UNFORCED = `<tool_call>\n<function=${TWO_CALLS}`;
// tool_choice "auto" with thinking on (the prompt opened <think>): a call while thinking.
const CALL_IN_THINK =
  'Checking first.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n' +
  '</function>\n</tool_call>\n</think>\n\nOne moment.';

const TOOLS = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'Weather for a city',
      parameters: {
        type: 'object',
        properties: {
          city: { type: 'string' }, days: { type: 'integer' }, hourly: { type: 'boolean' },
          units: { type: 'object' }, note: { type: 'string' }, limit: { type: 'integer' },
        },
        required: ['city'],
      },
    },
  },
  {
    type: 'function',
    function: {
      name: 'get_time',
      parameters: { type: 'object', properties: { zone: { type: 'string' } } },
    },
  },
];
const messages = [{ role: 'user', content: 'What is the weather in São Paulo?' }];

let server;
let client;
let dir;
const ids = {};

before(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-xml-tools-'));
  for (const f of fs.readdirSync(FIXTURE)) {
    if (f !== 'tokenizer.json') fs.symlinkSync(fs.realpathSync(path.join(FIXTURE, f)), path.join(dir, f));
  }
  const tok = JSON.parse(fs.readFileSync(path.join(FIXTURE, 'tokenizer.json'), 'utf8'));
  let next = Math.max(...tok.added_tokens.map((t) => t.id)) + 1;
  for (const [key, content] of Object.entries({
    TYPED_CALL, LOOSE_CALL, TWO_CALLS, TWO_CALLS_UNFORCED, CALL_IN_THINK,
  })) {
    ids[key] = next;
    tok.added_tokens.push({
      id: next++, content, single_word: false, lstrip: false, rstrip: false,
      normalized: false, special: false,
    });
  }
  fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(tok));
  server = await startServer(['--served-model-name', NAME], { model: dir });
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'none', maxRetries: 0 });
});

after(() => stopCleanly(server, dir));

// The one token `key` is the whole output.
const only = (key) => onlyToken(ids[key]);
const named = { type: 'function', function: { name: 'get_weather' } };

test('typed XML arguments, not streamed', async () => {
  const r = await client.chat.completions.create({
    model: NAME, messages, tools: TOOLS, tool_choice: named, ...only('TYPED_CALL'),
  });
  const c = r.choices[0];
  assert.equal(r.usage.completion_tokens, 1);
  assert.equal(c.finish_reason, 'tool_calls');
  assert.equal(c.message.content, null);
  assert.equal(c.message.reasoning_content, null);  // the forced call closed the open <think>
  assert.equal(c.message.tool_calls.length, 1);
  const call = c.message.tool_calls[0];
  assert.match(call.id, /^call_/);
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), TYPED_ARGS);
});

test('typed XML arguments streamed: deltas and the SDK stream helper', async () => {
  const { deltas, finish, content } = await chatStreamParts(await client.chat.completions.create({
    model: NAME, messages, tools: TOOLS, tool_choice: named, stream: true, ...only('TYPED_CALL'),
  }));
  assert.equal(finish, 'tool_calls');
  assert.equal(content, '');
  assert.equal(deltas[0].function.name, 'get_weather');
  assert.match(deltas[0].id, /^call_/);
  const args = deltas.filter((d) => d.index === 0).map((d) => d.function?.arguments ?? '').join('');
  assert.deepEqual(JSON.parse(args), TYPED_ARGS);

  const helper = client.beta.chat.completions.stream({
    model: NAME, messages, tools: TOOLS, tool_choice: named, ...only('TYPED_CALL'),
  });
  const final = await helper.finalChatCompletion();
  const m = final.choices[0].message;
  assert.equal(final.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.tool_calls.length, 1);
  assert.deepEqual(JSON.parse(m.tool_calls[0].function.arguments), TYPED_ARGS);
});

test('unforced, values the schema does not expect are kept as written', async () => {
  const r = await client.chat.completions.create({
    model: NAME, messages, tools: TOOLS, ...only('LOOSE_CALL'),
    chat_template_kwargs: { enable_thinking: false },
  });
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  const calls = r.choices[0].message.tool_calls;
  assert.equal(calls.length, 1);
  assert.deepEqual(JSON.parse(calls[0].function.arguments), LOOSE_ARGS);
});

test('tool_choice required: the model names the tool; two calls, streamed the same', async () => {
  const body = {
    model: NAME, messages, tools: TOOLS, tool_choice: 'required', ...only('TWO_CALLS'),
  };
  const r = await client.chat.completions.create(body);
  const calls = r.choices[0].message.tool_calls;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.deepEqual(calls.map((c) => c.function.name), ['get_weather', 'get_time']);
  assert.deepEqual(calls.map((c) => JSON.parse(c.function.arguments)), [{ city: 'Oslo' }, { zone: 'CET' }]);
  assert.notEqual(calls[0].id, calls[1].id);

  const final = await client.beta.chat.completions.stream(body).finalChatCompletion();
  const streamed = final.choices[0].message.tool_calls;
  assert.deepEqual(streamed.map((c) => [c.function.name, JSON.parse(c.function.arguments)]),
    calls.map((c) => [c.function.name, JSON.parse(c.function.arguments)]));

  // parallel_tool_calls: false keeps the first (of calls written unforced: a forced call's
  // constraint then admits no second one).
  const one = await client.chat.completions.create({
    ...body, tool_choice: 'auto', parallel_tool_calls: false, ...only('TWO_CALLS_UNFORCED'),
  });
  assert.deepEqual(one.choices[0].message.tool_calls.map((c) => c.function.name), ['get_weather']);
});

test('a call written inside <think> is a call, and leaves the reasoning', async () => {
  const body = { model: NAME, messages, tools: TOOLS, ...only('CALL_IN_THINK') };
  const r = await client.chat.completions.create(body);
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.reasoning_content, 'Checking first.\n');
  assert.equal(m.content, 'One moment.');
  assert.equal(m.tool_calls.length, 1);
  assert.deepEqual(JSON.parse(m.tool_calls[0].function.arguments), { days: 2 });

  const { reasoning, content, deltas } =
    await chatStreamParts(await client.chat.completions.create({ ...body, stream: true }));
  assert.equal(reasoning, m.reasoning_content);
  assert.equal(content, m.content);
  assert.equal(deltas[0].function.name, 'get_weather');
});

test('Anthropic messages: tool_use with a typed input object, streamed and not', async () => {
  const body = {
    model: NAME, max_tokens: 8, messages, tools: anthropicTools(TOOLS),
    tool_choice: { type: 'tool', name: 'get_weather' },
    ...only('TYPED_CALL'),
  };
  const msg = await anthropicMessage(server.url, body);
  assert.equal(msg.stop_reason, 'tool_use');
  const uses = msg.content.filter((b) => b.type === 'tool_use');
  assert.equal(uses.length, 1);
  assert.match(uses[0].id, /^toolu_/);
  assert.equal(uses[0].name, 'get_weather');
  assert.deepEqual(uses[0].input, TYPED_ARGS);
  assert.deepEqual(msg.content.filter((b) => b.type === 'text' && b.text !== ''), []);

  const { start, json, stop } = await anthropicToolUseStream(server.url, body);
  assert.equal(start.name, 'get_weather');
  assert.match(start.id, /^toolu_/);
  assert.deepEqual(JSON.parse(json), TYPED_ARGS);
  assert.equal(stop, 'tool_use');
});
