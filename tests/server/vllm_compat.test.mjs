// What users of `vllm serve` and of OpenAI's API expect from the wire, end to end: the stop
// token's text left out unless include_stop_str_in_output, tokens on the chunks of their own
// text (never on the role chunk), stop_reason on the final chunk, continuous usage, chat's
// continue_final_message and echo, completions logprobs as OpenAI shapes them, OpenAI's error
// types on OpenAI routes, request ids, /v1/models' created, an incomplete Responses message,
// and vLLM's /tokenize, /detokenize, /version and /ping.
//
// The tiny model writes noise, but greedily always the same noise: "Hi" as a chat gives the
// tokens .MEDIA x3 then 柱 (102277), which stop_token_ids makes the stop token.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { after, before, test } from 'node:test';
import OpenAI from 'openai';

import { MODEL_NAME, RECUR, ROOT, postJson, sseEvents, startServer, stopCleanly } from './lib.mjs';

const KEY = 'sk-recur-compat';
const PILLAR = 102277;  // 柱
const EOS = 151645;  // <|im_end|>
const hi = [{ role: 'user', content: 'Hi' }];
const auth = { authorization: `Bearer ${KEY}` };

let server;
let client;

before(async () => {
  server = await startServer(['--api-key', KEY, '--max-batch', '4', '--kv-cache-mb', '64']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: KEY, maxRetries: 0 });
});

after(() => stopCleanly(server));

const post = (route, body) => postJson(`${server.url}${route}`, body, auth);

// The chunks of a streamed OpenAI request, parsed.
async function chunks(route, body) {
  const res = await post(route, { ...body, stream: true });
  assert.equal(res.status, 200);
  const out = [];
  for await (const ev of sseEvents(res)) if (ev.data !== '[DONE]') out.push(JSON.parse(ev.data));
  return out;
}

test('the stop token\'s text is left out unless include_stop_str_in_output', async () => {
  const body = {
    messages: hi, max_tokens: 5, temperature: 0, stop_token_ids: [PILLAR], return_token_ids: true,
  };
  const r = await client.chat.completions.create(body);
  const c = r.choices[0];
  assert.equal(c.message.content, '.MEDIA.MEDIA.MEDIA');
  assert.equal(c.finish_reason, 'stop');
  assert.equal(c.stop_reason, PILLAR);
  // The token still counts, as in vLLM: in the ids and in usage.
  assert.equal(c.token_ids.at(-1), PILLAR);
  assert.equal(r.usage.completion_tokens, 4);
  const kept = await client.chat.completions.create({ ...body, include_stop_str_in_output: true });
  assert.equal(kept.choices[0].message.content, '.MEDIA.MEDIA.MEDIA柱');
  assert.equal(kept.usage.completion_tokens, 4);
  // Streamed the same.
  const streamed = await chunks('/v1/chat/completions', body);
  assert.equal(streamed.map((k) => k.choices[0]?.delta?.content ?? '').join(''), '.MEDIA.MEDIA.MEDIA');

  // Completions, where the stop token is the whole output.
  const one = { prompt: 'Hi', max_tokens: 4, temperature: 0, logit_bias: { [PILLAR]: 100 },
    stop_token_ids: [PILLAR] };
  assert.equal((await client.completions.create(one)).choices[0].text, '');
  assert.equal((await client.completions.create({ ...one, include_stop_str_in_output: true }))
    .choices[0].text, '柱');
  const text = (await chunks('/v1/completions', one)).map((k) => k.choices[0]?.text ?? '').join('');
  assert.equal(text, '');

  // The end-of-sequence token's text, with skip_special_tokens false.
  const eos = { messages: hi, max_tokens: 4, temperature: 0, logit_bias: { [EOS]: 100 },
    skip_special_tokens: false };
  assert.equal((await client.chat.completions.create(eos)).choices[0].message.content, '');
  assert.equal((await client.chat.completions.create({ ...eos, include_stop_str_in_output: true }))
    .choices[0].message.content, '<|im_end|>');

  // A stop string, kept when asked.
  const stop = { messages: hi, max_tokens: 5, temperature: 0, stop: ['IA.ME'] };
  const cut = await client.chat.completions.create(stop);
  assert.equal(cut.choices[0].message.content, '.MED');
  assert.equal(cut.choices[0].stop_reason, 'IA.ME');
  const withStop = await client.chat.completions.create({ ...stop, include_stop_str_in_output: true });
  assert.equal(withStop.choices[0].message.content, '.MEDIA.ME');
});

test('streamed chat: the role chunk has no tokens; each content chunk carries the tokens of its text', async () => {
  const body = { messages: hi, max_tokens: 5, temperature: 0, stop_token_ids: [PILLAR],
    logprobs: true, top_logprobs: 1, return_token_ids: true };
  const whole = await client.chat.completions.create(body);
  const got = await chunks('/v1/chat/completions', body);
  const role = got[0].choices[0];
  assert.equal(role.delta.role, 'assistant');
  assert.equal(role.token_ids, undefined);
  assert.equal(role.logprobs, null);
  const ids = [];
  for (const k of got.slice(1)) {
    const c = k.choices[0];
    ids.push(...(c.token_ids ?? []));
    // A chunk may carry several tokens when the client reads slower than the engine makes them
    // (vLLM merges unread outputs the same way); its ids, logprobs and text must agree.
    if (c.delta.content) {
      assert.ok(c.token_ids.length >= 1, JSON.stringify(c));
      assert.equal(c.logprobs.content.length, c.token_ids.length, JSON.stringify(c));
      // The stop token is listed with its logprob, but its text is left out.
      const listed = c.logprobs.content.map((t) => t.token).join('');
      const stopped = c.token_ids.at(-1) === PILLAR ? '柱' : '';
      assert.equal(listed, c.delta.content + stopped, JSON.stringify(c));
    }
  }
  assert.deepEqual(ids, whole.choices[0].token_ids);
  // The final chunk names the finish and what stopped it, as the whole response does.
  const last = got.at(-1).choices[0];
  assert.equal(last.finish_reason, 'stop');
  assert.equal(last.stop_reason, PILLAR);
  const byString = await chunks('/v1/completions', { prompt: 'Hi', max_tokens: 8, temperature: 0,
    stop: [' irc'] });
  assert.equal(byString.at(-1).choices[0].stop_reason, ' irc');
});

test('stream_options.continuous_usage_stats: usage on every chunk, counting up', async () => {
  const got = await chunks('/v1/chat/completions', { messages: hi, max_tokens: 5, temperature: 0,
    ignore_eos: true, stream_options: { include_usage: true, continuous_usage_stats: true } });
  const usage = got.map((k) => k.usage);
  assert.ok(usage.every((u) => u && u.prompt_tokens === 9), JSON.stringify(usage));
  assert.equal(usage[0].completion_tokens, 0);  // the role chunk
  const counts = usage.map((u) => u.completion_tokens);
  assert.deepEqual([...counts].sort((a, b) => a - b), counts);
  assert.equal(counts.at(-1), 5);
  assert.equal(usage.at(-2).total_tokens, 14);
});

test('chat: continue_final_message continues the assistant turn; echo returns it', async () => {
  const messages = [...hi, { role: 'assistant', content: 'Hello there' }];
  const closed = await client.chat.completions.create({ messages, max_tokens: 1 });
  const open = await client.chat.completions.create({
    messages, max_tokens: 1, add_generation_prompt: false, continue_final_message: true,
  });
  // Without "<|im_end|>\n<|im_start|>assistant\n" (and the thinking block it brings).
  assert.ok(open.usage.prompt_tokens < closed.usage.prompt_tokens - 3,
    `${open.usage.prompt_tokens} vs ${closed.usage.prompt_tokens}`);
  const noPrompt = await client.chat.completions.create({
    messages, max_tokens: 1, add_generation_prompt: false,
  });
  assert.equal(noPrompt.usage.prompt_tokens, open.usage.prompt_tokens + 2);  // <|im_end|>, \n
  await assert.rejects(client.chat.completions.create({ messages, max_tokens: 1,
    continue_final_message: true }), (e) => e.status === 400 && e.param === 'continue_final_message');

  const echo = { messages, max_tokens: 2, temperature: 0, ignore_eos: true,
    add_generation_prompt: false, continue_final_message: true, echo: true };
  const r = await client.chat.completions.create(echo);
  assert.ok(r.choices[0].message.content.startsWith('Hello there'), r.choices[0].message.content);
  const got = await chunks('/v1/chat/completions', echo);
  assert.equal(got[1].choices[0].delta.content, 'Hello there');
  assert.equal(got.map((k) => k.choices[0]?.delta?.content ?? '').join(''), r.choices[0].message.content);
});

test('a forced call that max_tokens cuts is the call, finish_reason length, no markup', async () => {
  const tools = [{ type: 'function', function: { name: 'get_weather',
    parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
  for (const tool_choice of [{ type: 'function', function: { name: 'get_weather' } }, 'required']) {
    const body = { messages: hi, tools, tool_choice, max_tokens: 2, temperature: 0, ignore_eos: true };
    const r = await client.chat.completions.create(body);
    const c = r.choices[0];
    assert.equal(c.finish_reason, 'length');
    assert.ok(!(c.message.content ?? '').includes('<tool_call>'), JSON.stringify(c.message));
    if (typeof tool_choice === 'object') {
      assert.equal(c.message.tool_calls.length, 1);
      assert.equal(c.message.tool_calls[0].function.name, 'get_weather');
      // The arguments as written, cut (as vLLM returns them): the prefix's '{' and what followed.
      assert.match(c.message.tool_calls[0].function.arguments, /^\{/);
    }
    const got = await chunks('/v1/chat/completions', body);
    const text = got.map((k) => k.choices[0]?.delta?.content ?? '').join('');
    assert.ok(!text.includes('<tool_call>'), text);
  }
});

test('completions logprobs: the sampled token always listed; offsets in characters', async () => {
  const r = await client.completions.create({
    prompt: 'Hi', max_tokens: 8, temperature: 2, seed: 7, logprobs: 1,
  });
  const lp = r.choices[0].logprobs;
  let offset = 0;
  lp.tokens.forEach((t, i) => {
    assert.ok(Object.keys(lp.top_logprobs[i]).length <= 2);
    assert.equal(lp.top_logprobs[i][t], lp.token_logprobs[i], `${t}: ${JSON.stringify(lp.top_logprobs[i])}`);
    assert.equal(lp.text_offset[i], offset);
    offset += [...t].length;
  });
  assert.ok(lp.top_logprobs.some((d) => Object.keys(d).length === 2));
  // A sampled token outside the top one makes two entries (seed 7 samples some).
  assert.ok(lp.tokens.some((t, i) => Object.keys(lp.top_logprobs[i]).length === 2 &&
    Object.values(lp.top_logprobs[i])[0] > lp.token_logprobs[i]));
  const zero = await client.completions.create({ prompt: 'Hi', max_tokens: 3, temperature: 0, logprobs: 0 });
  const z = zero.choices[0].logprobs;
  assert.deepEqual(z.top_logprobs, z.tokens.map((t, i) => ({ [t]: z.token_logprobs[i] })));
  // Characters, not bytes: "萃" is one.
  assert.deepEqual(z.text_offset, [0, 1, 2]);
});

test('OpenAI routes answer with OpenAI\'s error types', async () => {
  await assert.rejects(client.chat.completions.create({ model: 'nope', messages: hi, max_tokens: 1 }),
    (e) => e instanceof OpenAI.NotFoundError && e.type === 'invalid_request_error' &&
      e.code === 'model_not_found');
  const res = await fetch(`${server.url}/v1/models/nope`, { headers: auth });
  assert.equal(res.status, 404);
  assert.equal((await res.json()).error.type, 'invalid_request_error');
  const wrong = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError &&
    e.type === 'invalid_request_error' && e.code === 'invalid_api_key');
  // Anthropic's names stay on /v1/messages.
  const m = await postJson(`${server.url}/v1/messages`, { model: 'nope', max_tokens: 1, messages: hi },
    { 'x-api-key': KEY });
  assert.equal((await m.json()).error.type, 'not_found_error');
});

test('a request id on every response, under the header each API\'s clients read', async () => {
  const a = await post('/v1/chat/completions', { messages: hi, max_tokens: 1 });
  const b = await post('/v1/chat/completions', { messages: hi, max_tokens: 1, stream: true });
  await b.text();
  const ids = [a, b].map((r) => r.headers.get('x-request-id'));
  assert.ok(ids.every((id) => /^req_\w+$/.test(id)), ids.join());
  assert.notEqual(ids[0], ids[1]);
  const m = await postJson(`${server.url}/v1/messages`, { model: MODEL_NAME, max_tokens: 1, messages: hi },
    { 'x-api-key': KEY });
  assert.match(m.headers.get('request-id'), /^req_\w+$/);
});

test('Anthropic: model is required', async () => {
  const missing = await postJson(`${server.url}/v1/messages`, { max_tokens: 1, messages: hi },
    { 'x-api-key': KEY });
  assert.equal(missing.status, 400);
  const err = (await missing.json()).error;
  assert.equal(err.param, 'model');
  assert.match(err.message, /'model'/);
});

test('/v1/models: created is when the server started', async () => {
  const models = await client.models.list();
  const created = models.data[0].created;
  assert.ok(created > 0 && Math.abs(created - Date.now() / 1000) < 600, `created ${created}`);
});

test('responses: a message cut by max_output_tokens is incomplete', async () => {
  const r = await client.responses.create({ input: 'Hi', max_output_tokens: 2, temperature: 0 });
  assert.equal(r.status, 'incomplete');
  const msg = r.output.find((o) => o.type === 'message');
  assert.equal(msg.status, 'incomplete');
  const done = await client.responses.create({ input: 'Hi', max_output_tokens: 2, temperature: 0,
    logit_bias: { [EOS]: 100 } });
  assert.equal(done.status, 'completed');
  assert.equal(done.output.find((o) => o.type === 'message').status, 'completed');
});

test('/tokenize, /detokenize, /version and /ping as vLLM has them', async () => {
  const t = await (await post('/tokenize', { model: MODEL_NAME, prompt: 'Hi there' })).json();
  assert.equal(t.count, t.tokens.length);
  assert.ok(t.max_model_len > 0);
  const d = await (await post('/detokenize', { tokens: t.tokens })).json();
  assert.equal(d.prompt, 'Hi there');
  // A chat counts as /v1/chat/completions renders it.
  const chat = await (await post('/tokenize', { messages: hi, return_token_strs: true })).json();
  const r = await client.chat.completions.create({ messages: hi, max_tokens: 1 });
  assert.equal(chat.count, r.usage.prompt_tokens);
  assert.equal(chat.token_strs[0], '<|im_start|>');
  const bad = await post('/tokenize', { prompt: 'x', messages: hi });
  assert.equal(bad.status, 400);
  assert.equal((await post('/detokenize', { tokens: [-1] })).status, 400);
  // Tokenizing costs work: the key is needed, as on /v1.
  const refused = await postJson(`${server.url}/tokenize`, { prompt: 'x' });
  assert.equal(refused.status, 401);
  assert.equal(refused.headers.get('www-authenticate'), 'Bearer');
  // The scheme's name is case-insensitive (RFC 9110); the key is not.
  for (const scheme of ['bearer', 'BEARER']) {
    const r = await postJson(`${server.url}/tokenize`, { prompt: 'x' }, { authorization: `${scheme} ${KEY}` });
    assert.equal(r.status, 200, scheme);
  }
  assert.equal((await postJson(`${server.url}/tokenize`, { prompt: 'x' },
    { authorization: `Bearer ${KEY.toUpperCase()}` })).status, 401);
  // The version is the project's (CMakeLists.txt), as `recur --version` prints it.
  const v = await (await fetch(`${server.url}/version`)).json();
  const project = fs.readFileSync(path.join(ROOT, 'CMakeLists.txt'), 'utf8').match(/project\(recur VERSION ([0-9.]+)/)[1];
  assert.equal(v.version, project);
  assert.equal(execFileSync(RECUR, ['--version'], { encoding: 'utf8' }).trim(), project);
  assert.equal((await fetch(`${server.url}/ping`)).status, 200);
  assert.equal((await fetch(`${server.url}/ping`, { method: 'POST' })).status, 200);
});
