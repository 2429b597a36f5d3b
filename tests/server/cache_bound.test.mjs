// A server whose attention cache is small (1 MiB: 8,192 positions of the tiny model): the
// context it states is what the cache holds for one sequence, a request that could never fit
// is refused up front, and concurrent requests that together outgrow the cache all run to
// their max_tokens, the later ones preempted and resumed (never cut short as "length" early).
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { metrics, postJson, startServer, stopCleanly } from './lib.mjs';

let server;

before(async () => {
  server = await startServer(['--kv-cache-mb', '1', '--prefix-cache-mb', '0', '--max-batch', '4']);
});

after(() => stopCleanly(server));

const ids = (n, seed) => Array.from({ length: n }, (_, i) => 1000 + ((i * 7919 + seed) % 5000));

test('the stated context is what the cache holds, and a request past it is refused', async () => {
  assert.match(server.output(), /context: 8192 tokens, what the attention cache holds/);
  const models = await (await fetch(`${server.url}/v1/models`)).json();
  assert.equal(models.data[0].max_model_len, 8192);
  const res = await postJson(`${server.url}/v1/completions`,
                             { prompt: ids(5000, 1), max_tokens: 5000 });
  assert.equal(res.status, 400);
  const body = await res.json();
  assert.equal(body.error.code, 'context_length_exceeded');
  assert.match(body.error.message, /8192/);
});

test('requests that together outgrow the cache all finish whole', async () => {
  // Three of 2,000 + 2,000 tokens: 12,000 positions against 8,192.
  const runs = [1, 2, 3].map((seed) => postJson(`${server.url}/v1/completions`, {
    prompt: ids(2000, seed), max_tokens: 2000, ignore_eos: true, temperature: 0,
  }).then((r) => r.json()));
  for (const r of await Promise.all(runs)) {
    assert.equal(r.usage.completion_tokens, 2000, JSON.stringify(r).slice(0, 300));
    assert.equal(r.choices[0].finish_reason, 'length');
  }
  const m = await metrics(server.url);
  assert.ok(m.value('recur_preemptions_total') > 0, 'no preemption happened');
  assert.equal(m.value('recur_kv_cache_blocks_used'), 0);
});
