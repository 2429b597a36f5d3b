// What the forced-call end-to-end tests (JSON, XML and Kimi call forms) share: the forced
// tool_choices, the samplings they run under, the tools and question they ask with (the XML test
// has a get_weather of its own), the check of a call's arguments against those tools, the checks
// every forced call must pass in each API, and a streamed call's deltas joined.
import assert from 'node:assert/strict';

import { anthropicMessage, postJson, sseEvents } from './lib.mjs';

export const FORCED_CHOICES = [
  { type: 'function', function: { name: 'get_weather' } },
  { type: 'function', function: { name: 'get_time' } },
  'required',
];
export const SAMPLINGS = [
  { temperature: 0 }, { temperature: 1, seed: 3 }, { temperature: 1.5, seed: 11, top_p: 0.9 },
];

export const WEATHER = {
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
export const TIME = {
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
export const TOOLS = [WEATHER, TIME];
export const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
// Enough for any call these schemas allow (text values, whitespace runs, numbers and Kimi's call
// index are bounded).
export const MAX_TOKENS = 1000;

// Whether `args` (a JSON text or an object) is what the named tool's schema accepts, for the
// get_weather tool `weather` (its properties are the keys allowed) and TIME; returns the object.
export function checkCall(name, args, weather = WEATHER) {
  const a = typeof args === 'string' ? JSON.parse(args) : args;
  const what = JSON.stringify(a);
  assert.equal(typeof a, 'object', what);
  if (name === 'get_weather') {
    assert.ok(['Paris', 'Tokyo', 'Lima'].includes(a.city), what);
    assert.ok(Number.isInteger(a.days), what);
    assert.ok(['c', 'f'].includes(a.unit), what);
    if ('alerts' in a) assert.equal(typeof a.alerts, 'boolean', what);
    for (const k of Object.keys(a)) assert.ok(k in weather.function.parameters.properties, k);
  } else {
    assert.equal(name, 'get_time');
    assert.ok(typeof a.zone === 'string' && [...a.zone].length <= 6, what);
    assert.deepEqual(Object.keys(a), ['zone']);
  }
  return a;
}

// Every forced tool_choice under every sampling (one call each): the answer is one whole call of
// the named tool (any, for required) and no text; `check(choice, call, what)` checks the rest.
export async function eachForcedChatCall(client, base, check) {
  for (const tool_choice of FORCED_CHOICES) {
    for (const sampling of SAMPLINGS) {
      const what = `${JSON.stringify(tool_choice)} ${JSON.stringify(sampling)}`;
      const c = (await client.chat.completions.create({
        ...base, tool_choice, parallel_tool_calls: false, ...sampling,
      })).choices[0];
      assert.equal(c.finish_reason, 'tool_calls', `${what}: ${JSON.stringify(c.message)}`);
      assert.ok(!c.message.content, `${what}: ${JSON.stringify(c.message)}`);
      assert.equal(c.message.tool_calls.length, 1, what);
      const call = c.message.tool_calls[0];
      if (typeof tool_choice === 'object') assert.equal(call.function.name, tool_choice.function.name);
      await check(c, call, what);
    }
  }
}

// Every forced tool_choice, greedy: the streamed call's deltas make the call the same request
// answers unstreamed (name and arguments); `check(streamed, whole)` checks the rest.
export async function eachStreamedForcedCall(client, url, base, check) {
  for (const tool_choice of FORCED_CHOICES) {
    const body = { ...base, tool_choice, parallel_tool_calls: false, temperature: 0 };
    const whole = (await client.chat.completions.create(body)).choices[0].message.tool_calls[0];
    const streamed = await streamedCall(url, body);
    assert.equal(streamed.finish, 'tool_calls');
    assert.equal(streamed.name, whole.function.name);
    assert.deepEqual(JSON.parse(streamed.args), JSON.parse(whole.function.arguments));
    await check(streamed, whole);
  }
}

// tool_choice "required" with parallel calls, sampled with `seed`: the answer is calls and no
// text; returns the calls the model finished (max_tokens may cut the last; the ones before it
// are whole).
export async function finishedRequiredCalls(client, base, seed) {
  const c = (await client.chat.completions.create({
    ...base, tool_choice: 'required', temperature: 1, seed,
  })).choices[0];
  assert.ok(['tool_calls', 'length'].includes(c.finish_reason), JSON.stringify(c));
  assert.ok(!c.message.content, JSON.stringify(c.message));
  const calls = c.message.tool_calls;
  assert.ok(calls.length >= 1);
  return c.finish_reason === 'length' ? calls.slice(0, -1) : calls;
}

// An Anthropic Messages request under tool_choice "any" or "tool": the answer is one tool_use
// block (of the named tool, for "tool") and no text; returns the block.
export async function forcedToolUse(url, body) {
  const m = await anthropicMessage(url, body);
  assert.equal(m.stop_reason, 'tool_use', JSON.stringify(m));
  const uses = m.content.filter((b) => b.type === 'tool_use');
  assert.equal(uses.length, 1, JSON.stringify(m.content));
  const text = m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
  assert.equal(text.trim(), '', JSON.stringify(m.content));
  if (body.tool_choice.name) assert.equal(uses[0].name, body.tool_choice.name);
  return uses[0];
}

// A Responses API request under tool_choice "required", no parallel calls: completed, with one
// function_call, which it returns.
export async function requiredFunctionCall(client, body) {
  const r = await client.responses.create({
    ...body, tool_choice: 'required', parallel_tool_calls: false,
  });
  assert.equal(r.status, 'completed', JSON.stringify(r.output));
  const calls = r.output.filter((o) => o.type === 'function_call');
  assert.equal(calls.length, 1, JSON.stringify(r.output));
  return calls[0];
}

// A streamed chat completion's one tool call: its id, name and arguments' deltas joined, and the
// finish reason.
export async function streamedCall(url, body) {
  const res = await postJson(`${url}/v1/chat/completions`, { ...body, stream: true });
  assert.equal(res.status, 200);
  const out = { id: '', name: '', args: '', finish: null };
  for await (const ev of sseEvents(res)) {
    if (ev.data === '[DONE]') continue;
    const ch = JSON.parse(ev.data).choices[0];
    for (const t of ch?.delta?.tool_calls ?? []) {
      out.id += t.id ?? '';
      out.name += t.function?.name ?? '';
      out.args += t.function?.arguments ?? '';
    }
    out.finish = ch?.finish_reason ?? out.finish;
  }
  return out;
}
