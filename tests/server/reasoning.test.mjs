// Reasoning split end to end, with a chat template that opens <think> in the prompt (as the
// Qwen3 thinking models' templates do): the output is reasoning until </think>, content after,
// streamed and not, on the chat and Anthropic endpoints.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';

import { MODEL, postJson, sseEvents, startServer, stopCleanly } from './lib.mjs';

const THINK_END = 151668;
let server;
let dir;

before(async () => {
  // The shipped model, with a template whose generation prompt ends in "<think>\n".
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-think-'));
  for (const f of ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json']) {
    fs.symlinkSync(path.join(MODEL, f), path.join(dir, f));
  }
  const config = JSON.parse(fs.readFileSync(path.join(MODEL, 'tokenizer_config.json'), 'utf8'));
  const opened = config.chat_template.replace("'<|im_start|>assistant\\n' }}",
    "'<|im_start|>assistant\\n<think>\\n' }}");
  assert.notEqual(opened, config.chat_template);
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
  fs.writeFileSync(path.join(dir, 'chat_template.jinja'), opened);
  server = await startServer(['--served-model-name', 'thinker'], { model: dir });
});

after(() => stopCleanly(server, dir));

const chat = (extra) => postJson(`${server.url}/v1/chat/completions`, {
  model: 'thinker', messages: [{ role: 'user', content: 'Think, then answer.' }],
  temperature: 0, max_tokens: 10, ignore_eos: true, ...extra,
}).then((r) => r.json());

test('without </think> everything is reasoning', async () => {
  const r = await chat({});
  const m = r.choices[0].message;
  assert.ok(m.reasoning_content.length > 0);
  assert.equal(m.content, '');
});

test('reasoning, then </think>, then content; streamed the same', async () => {
  // A bias on </think> that loses the first steps and wins a later one; presence and
  // frequency penalties keep it from repeating. Found by search, deterministic once found.
  let found = null;
  for (let bias = 30; bias >= 0 && !found; bias -= 0.25) {
    const extra = { logit_bias: { [THINK_END]: bias }, presence_penalty: 2, frequency_penalty: 2 };
    const r = await chat(extra);
    const m = r.choices[0].message;
    if (m.reasoning_content && m.content) found = { extra, m };
  }
  assert.ok(found, 'no bias put </think> mid-output');
  const { extra, m } = found;
  assert.ok(!m.reasoning_content.includes('</think>'));
  // Only the first </think> splits; the model may well write it again later.

  const res = await postJson(`${server.url}/v1/chat/completions`, {
    model: 'thinker', messages: [{ role: 'user', content: 'Think, then answer.' }],
    temperature: 0, max_tokens: 10, ignore_eos: true, stream: true, ...extra,
  });
  let reasoning = '';
  let content = '';
  let sawContentBeforeReasoningEnded = false;
  for await (const ev of sseEvents(res)) {
    if (ev.data === '[DONE]') break;
    const d = JSON.parse(ev.data).choices[0].delta;
    if (d.reasoning_content) {
      reasoning += d.reasoning_content;
      if (content) sawContentBeforeReasoningEnded = true;
    }
    content += d.content ?? '';
  }
  assert.equal(reasoning, m.reasoning_content);
  assert.equal(content, m.content);
  assert.ok(!sawContentBeforeReasoningEnded);

  const msg = await postJson(`${server.url}/v1/messages`, {
    model: 'thinker', max_tokens: 10, messages: [{ role: 'user', content: 'Think, then answer.' }],
    temperature: 0, ignore_eos: true, ...extra,
  }).then((r) => r.json());
  assert.deepEqual(msg.content.map((b) => b.type), ['thinking', 'text']);
  assert.equal(msg.content[0].thinking, m.reasoning_content);
  assert.equal(msg.content[1].text, m.content);
});
