// A client that disconnects mid-stream has its sequence cancelled at once: /metrics shows the
// state slot and cache blocks back within one engine step, and everything returns to the idle
// values once the other streams end. Every /metrics read is parsed strictly. Then SIGTERM:
// in-flight streams end cleanly and the server exits 0.
import assert from 'node:assert/strict';
import http from 'node:http';
import { after, before, test } from 'node:test';

import { metrics, postJson, sseEvents, startServer } from './lib.mjs';

let server;

before(async () => {
  server = await startServer(['--max-batch', '16', '--shutdown-grace', '1']);
});

after(async () => {
  if (!server.exited()) await server.stop();
});

const long = (i) => ({
  prompt: Array.from({ length: 40 }, (_, k) => 100 + i * 50 + k),
  max_tokens: 200000, ignore_eos: true, temperature: 0, stream: true,
});

// A streaming request over a raw http.request, so the test can cut the socket itself.
function openStream(url, body) {
  return new Promise((resolve, reject) => {
    const req = http.request(`${url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
    }, (res) => {
      let chunks = 0;
      let waiters = [];
      res.on('data', () => {
        chunks += 1;
        const ready = waiters;
        waiters = [];
        for (const w of ready) w();
      });
      res.on('error', () => {});
      resolve({
        res,
        req,
        chunks: () => chunks,
        waitChunks: (n) => new Promise((ok) => {
          const check = () => (chunks >= n ? ok() : waiters.push(check));
          check();
        }),
      });
    });
    req.on('error', reject);
    req.end(JSON.stringify(body));
  });
}

const gauge = (m, name) => m.value(name);

test('disconnect frees the slot and blocks within one step', async () => {
  const idle = await metrics(server.url);
  assert.equal(gauge(idle, 'recur_state_slots_used'), 0);
  assert.equal(gauge(idle, 'recur_kv_cache_blocks_used'), 0);
  const idleBuffers = gauge(idle, 'recur_live_buffers');
  const idleBytes = gauge(idle, 'recur_live_bytes');

  // Background streams keep the engine stepping (and each step long enough to observe).
  const others = [];
  for (let i = 1; i <= 6; ++i) others.push(await openStream(server.url, long(i)));
  try {
    const victim = await openStream(server.url, long(0));
    await victim.waitChunks(5);
    await Promise.all(others.map((o) => o.waitChunks(5)));
    const busy = await metrics(server.url);
    assert.equal(gauge(busy, 'recur_state_slots_used'), 7);
    assert.ok(gauge(busy, 'recur_kv_cache_blocks_used') >= 7 * 3);  // 40-token prompts, 16-token blocks

    const before = await metrics(server.url);
    const stepsBefore = gauge(before, 'recur_engine_steps_total');
    victim.req.destroy();  // the client goes away mid-stream
    let after;
    const t0 = Date.now();
    for (;;) {
      after = await metrics(server.url);
      if (gauge(after, 'recur_state_slots_used') === 6) break;
      assert.ok(Date.now() - t0 < 5000, 'slot not released within 5 s');
    }
    // The server measures it: engine steps completed between queueing the disconnected
    // client's cancel and the release of the sequence: 0, or 1 when a step was in flight.
    // Settled /metrics: the slot seen free, the finish is counted too.
    assert.equal(after.value('recur_disconnect_cancel_steps_count'), 1);
    assert.equal(after.value('recur_disconnect_cancel_steps_bucket', { le: '1' }), 1);
    console.log(`disconnect: slot back after ${gauge(after, 'recur_engine_steps_total') - stepsBefore} ` +
      `steps as seen by a /metrics poller, ${Date.now() - t0} ms`);
    assert.equal(gauge(after, 'recur_client_disconnects_total'), 1);
    assert.equal(after.value('recur_sequences_finished_total', { finish_reason: 'abort' }), 1);

  } finally {
    for (const o of others) o.req.destroy();
  }
  const t1 = Date.now();
  let end;
  for (;;) {
    end = await metrics(server.url);
    if (gauge(end, 'recur_state_slots_used') === 0 && gauge(end, 'recur_num_requests_running') === 0) break;
    assert.ok(Date.now() - t1 < 5000, 'slots not released within 5 s');
  }
  assert.equal(gauge(end, 'recur_kv_cache_blocks_used'), 0);
  assert.equal(gauge(end, 'recur_num_requests_waiting'), 0);
  assert.equal(gauge(end, 'recur_live_buffers'), idleBuffers);
  assert.equal(gauge(end, 'recur_live_bytes'), idleBytes);
  assert.equal(gauge(end, 'recur_client_disconnects_total'), 7);
  assert.equal(end.value('recur_sequences_finished_total', { finish_reason: 'abort' }), 7);
  assert.ok(end.value('recur_time_to_first_token_seconds_count') >= 7);
  assert.equal(end.value('recur_disconnect_cancel_steps_count'), 7);
  assert.equal(end.value('recur_disconnect_cancel_steps_bucket', { le: '1' }), 7);
  assert.ok(end.value('recur_generation_tokens_total') > 0);
});

test('a disconnect during a non-streaming request also cancels', async () => {
  const res = await new Promise((resolve) => {
    const req = http.request(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
    });
    req.on('error', () => resolve('closed'));
    req.end(JSON.stringify({ ...long(9), stream: false }));
    setTimeout(() => req.destroy(), 300);
  });
  assert.equal(res, 'closed');
  const t0 = Date.now();
  for (;;) {
    const m = await metrics(server.url);
    if (m.value('recur_state_slots_used') === 0) break;
    assert.ok(Date.now() - t0 < 5000, 'non-streaming request not cancelled');
  }
});

test('SIGTERM: in-flight streams end with [DONE], the server exits 0', async () => {
  const res = await postJson(`${server.url}/v1/completions`, long(3));
  assert.equal(res.status, 200);
  const events = sseEvents(res);
  const first = await events.next();
  assert.ok(!first.done);
  server.proc.kill('SIGTERM');
  let last = null;
  let finish = null;
  for await (const ev of events) {
    last = ev.data;
    if (ev.data !== '[DONE]') {
      const j = JSON.parse(ev.data);
      finish = j.choices[0].finish_reason ?? finish;
    }
  }
  assert.equal(last, '[DONE]');
  assert.equal(finish, 'abort');  // --shutdown-grace 1 cut the 200000-token request short
  const r = await server.exit();
  assert.deepEqual(r, { code: 0, signal: null }, server.output());
  await assert.rejects(fetch(`${server.url}/health`));
});
