// What the forced-call end-to-end tests (JSON, XML and Kimi call forms) share: the forced
// tool_choices, the samplings they run under, the checks every forced chat call must pass, and
// a streamed call's deltas joined.
import assert from 'node:assert/strict';

import { postJson, sseEvents } from './lib.mjs';

export const FORCED_CHOICES = [
  { type: 'function', function: { name: 'get_weather' } },
  { type: 'function', function: { name: 'get_time' } },
  'required',
];
export const SAMPLINGS = [
  { temperature: 0 }, { temperature: 1, seed: 3 }, { temperature: 1.5, seed: 11, top_p: 0.9 },
];

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
