// 32 concurrent streaming greedy requests through the one engine give exactly the tokens each
// gives alone, and exactly what `recur generate --prompts` gives for the same prompts. Streams
// are written by the server's stream writer, a step's tokens coalesced per stream; the same
// requests without streaming give the same tokens and text.
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';
import { promisify } from 'node:util';

import { MODEL, RECUR, postJson, rng, startServer, streamCompletion, stopCleanly } from './lib.mjs';

const N = 32;
const MAX_TOKENS = 24;

// Prompts of different lengths (so prefill chunks and decode steps interleave), ids drawn
// from the ordinary vocabulary.
const rand = rng(20240607);
const prompts = Array.from({ length: N }, () => {
  const len = 3 + Math.floor(rand() * 60);
  return Array.from({ length: len }, () => 1 + Math.floor(rand() * 150000));
});

let server;

before(async () => {
  server = await startServer(['--max-batch', String(N), '--max-batch-tokens', '256', '--device', 'cpu']);
});

after(() => stopCleanly(server));

const request = (ids) => ({ prompt: ids, max_tokens: MAX_TOKENS, temperature: 0, ignore_eos: true });

test('concurrent streams equal lone requests equal recur generate', async () => {
  const alone = [];
  for (const ids of prompts) alone.push(await streamCompletion(server.url, request(ids)));
  for (const a of alone) {
    assert.equal(a.ids.length, MAX_TOKENS);
    assert.equal(a.finish_reason, 'length');
    assert.ok(a.done);
  }

  const together = await Promise.all(prompts.map((ids) => streamCompletion(server.url, request(ids))));
  for (let i = 0; i < N; ++i) {
    assert.deepEqual(together[i].ids, alone[i].ids, `prompt ${i}: concurrent ids differ`);
    assert.equal(together[i].text, alone[i].text, `prompt ${i}: concurrent text differs`);
  }

  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-serve-'));
  const file = path.join(dir, 'prompts.jsonl');
  fs.writeFileSync(file, prompts.map((ids) => JSON.stringify({ ids })).join('\n') + '\n');
  const { stdout } = await promisify(execFile)(RECUR, [
    'generate', '--model', MODEL, '--prompts', file, '--max-tokens', String(MAX_TOKENS),
    '--temperature', '0', '--ignore-eos', '--max-batch', String(N),
  ], { maxBuffer: 64 << 20 });
  fs.rmSync(dir, { recursive: true });
  const generated = stdout.trim().split('\n').map((l) => JSON.parse(l));
  assert.equal(generated.length, N);
  for (let i = 0; i < N; ++i) {
    assert.equal(generated[i].index, i);
    assert.deepEqual(generated[i].ids, alone[i].ids, `prompt ${i}: recur generate ids differ`);
    assert.equal(generated[i].text, alone[i].text, `prompt ${i}: recur generate text differs`);
  }
});

test('non-streaming answers equal the streamed ones, concurrently', async () => {
  const some = prompts.slice(0, 12);
  const [streamed, plain] = await Promise.all([
    Promise.all(some.map((ids) => streamCompletion(server.url, request(ids)))),
    Promise.all(some.map(async (ids) => {
      const res = await postJson(`${server.url}/v1/completions`, { ...request(ids), return_token_ids: true });
      assert.equal(res.status, 200);
      return res.json();
    })),
  ]);
  for (let i = 0; i < some.length; ++i) {
    assert.equal(streamed[i].ids.length, MAX_TOKENS);
    assert.deepEqual(plain[i].choices[0].token_ids, streamed[i].ids, `prompt ${i}: ids differ`);
    assert.equal(plain[i].choices[0].text, streamed[i].text, `prompt ${i}: text differs`);
    assert.equal(plain[i].choices[0].finish_reason, streamed[i].finish_reason);
  }
});
