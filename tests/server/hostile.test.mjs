// Hostile clients over loopback, bounded in count and time (well under a minute): bodies larger
// than --max-body-mb, chunked or not, with and without the API key; heads that trickle in; a
// crowd of idle and slow connections; malformed framing. Every case asserts the answer and how
// soon it came, that the server's resident memory (VmRSS from /proc, sampled every 20 ms, and
// its high-water mark VmHWM) stays within RSS_BOUND of what it was before, and that /health and
// a real generation still answer afterwards.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import net from 'node:net';
import { after, before, describe, test } from 'node:test';

import { metrics, startServer, stopCleanly } from './lib.mjs';

const MiB = 1 << 20;
const KEY = 'hostile-key';
// Resident memory any one hostile case may add to the server (its bodies are capped at 1 MiB).
const RSS_BOUND = 48 * MiB;
// The server options every case runs under: 1 MiB bodies, short deadlines so the suite is fast.
const LIMITS = ['--max-body-mb', '1', '--header-timeout', '2', '--body-timeout', '3',
  '--idle-timeout', '2', '--max-batch', '4', '--kv-cache-mb', '64'];

function procStatus(pid, field) {
  const m = fs.readFileSync(`/proc/${pid}/status`, 'utf8').match(new RegExp(`^${field}:\\s+(\\d+) kB`, 'm'));
  return Number(m[1]) * 1024;
}

// Runs fn while sampling the server's VmRSS; asserts the peak (and VmHWM) within RSS_BOUND.
async function withinMemory(server, fn) {
  const pid = server.proc.pid;
  const base = procStatus(pid, 'VmRSS');
  const hwmBefore = procStatus(pid, 'VmHWM');
  let peak = base;
  const timer = setInterval(() => {
    try {
      peak = Math.max(peak, procStatus(pid, 'VmRSS'));
    } catch {}
  }, 20);
  try {
    return await fn();
  } finally {
    clearInterval(timer);
    peak = Math.max(peak, procStatus(pid, 'VmRSS'));
    const hwm = procStatus(pid, 'VmHWM');
    console.log(`  RSS ${(base / MiB).toFixed(1)} MiB before, peak +${((peak - base) / MiB).toFixed(1)} MiB`);
    assert.ok(peak - base <= RSS_BOUND,
      `RSS grew by ${((peak - base) / MiB).toFixed(1)} MiB (bound ${RSS_BOUND / MiB} MiB)`);
    assert.ok(hwm <= Math.max(hwmBefore, base + RSS_BOUND),
      `VmHWM ${(hwm / MiB).toFixed(1)} MiB passed ${((base + RSS_BOUND) / MiB).toFixed(1)} MiB`);
  }
}

// A raw connection: write any bytes, await the first response (status line, headers, a
// Content-Length body) or the close.
function open(port) {
  const sock = net.connect(port, '127.0.0.1');
  sock.setNoDelay(true);
  const c = { sock, buf: Buffer.alloc(0), closed: false, error: null, waiters: [] };
  const wake = () => {
    const w = c.waiters;
    c.waiters = [];
    for (const f of w) f();
  };
  sock.on('data', (d) => {
    c.buf = Buffer.concat([c.buf, d]);
    wake();
  });
  sock.on('error', (e) => {
    c.error = e;
  });
  sock.on('close', () => {
    c.closed = true;
    wake();
  });
  c.connected = new Promise((resolve, reject) => {
    sock.once('connect', resolve);
    sock.once('error', reject);
  });
  c.write = (bytes) => new Promise((resolve) => {
    if (c.closed || sock.destroyed) return resolve(false);
    const ok = sock.write(bytes, () => resolve(true));
    if (!ok) sock.once('drain', () => {});
  });
  c.parse = () => {
    const end = c.buf.indexOf('\r\n\r\n');
    if (end < 0) return null;
    const head = c.buf.subarray(0, end).toString('latin1').split('\r\n');
    const status = Number(head[0].split(' ')[1]);
    const headers = {};
    for (const h of head.slice(1)) {
      const i = h.indexOf(':');
      headers[h.slice(0, i).toLowerCase()] = h.slice(i + 1).trim();
    }
    const len = Number(headers['content-length'] ?? 0);
    if (c.buf.length < end + 4 + len) return null;
    return { status, headers, body: c.buf.subarray(end + 4, end + 4 + len).toString('utf8') };
  };
  // The response, or null if the connection closed without one; rejects after timeoutMs.
  c.response = (timeoutMs) => new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no response within ${timeoutMs} ms`)), timeoutMs);
    const check = () => {
      const r = c.parse();
      if (r || c.closed) {
        clearTimeout(timer);
        resolve(r);
      } else {
        c.waiters.push(check);
      }
    };
    check();
  });
  c.closedWithin = (timeoutMs) => new Promise((resolve) => {
    const timer = setTimeout(() => resolve(false), timeoutMs);
    const check = () => {
      if (c.closed) {
        clearTimeout(timer);
        resolve(true);
      } else {
        c.waiters.push(check);
      }
    };
    check();
  });
  c.destroy = () => sock.destroy();
  return c;
}

// Sends a whole request on a fresh connection; the response and how long it took.
async function exchange(port, bytes, timeoutMs = 3000) {
  const c = open(port);
  await c.connected;
  const t0 = Date.now();
  await c.write(Buffer.from(bytes, 'latin1'));
  try {
    const r = await c.response(timeoutMs);
    return { ...r, ms: Date.now() - t0 };
  } finally {
    c.destroy();
  }
}

async function stillServing(server, headers = {}) {
  const t0 = Date.now();
  const h = await fetch(`${server.url}/health`);
  assert.equal(h.status, 200);
  const r = await fetch(`${server.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify({ prompt: [9707, 11], max_tokens: 2, temperature: 0, ignore_eos: true }),
  });
  const text = await r.text();
  assert.equal(r.status, 200, text);
  assert.equal(JSON.parse(text).usage.completion_tokens, 2);
  return Date.now() - t0;
}

// Polls /health until it answers `status` (bounded): a state the server reaches on its own
// threads (connections it has seen close, a signal it has taken) rather than after a fixed sleep.
async function untilHealth(server, status, timeoutMs = 5000) {
  const t0 = Date.now();
  for (;;) {
    const h = await fetch(`${server.url}/health`).catch(() => null);
    await h?.arrayBuffer();
    if (h?.status === status) return;
    assert.ok(Date.now() - t0 < timeoutMs, `/health still ${h?.status} after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

const post = (path, extra) => `POST ${path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n${extra}\r\n`;

// Streams `total` bytes of chunked body (64 KiB chunks) until the server answers or closes.
async function sendChunked(c, total) {
  const chunk = Buffer.concat([Buffer.from('10000\r\n'), Buffer.alloc(0x10000, 0x61), Buffer.from('\r\n')]);
  let sent = 0;
  while (sent < total && !c.closed && !c.parse()) {
    if (!(await c.write(chunk))) break;
    sent += 0x10000;
    await new Promise((r) => setImmediate(r));  // let a response be read
  }
  return sent;
}

describe('without an API key', () => {
  let server;
  let port;
  before(async () => {
    server = await startServer(LIMITS);
    port = Number(new URL(server.url).port);
  });
  after(() => stopCleanly(server));

  test('a chunked body past --max-body-mb is refused (413) while it is read', async () => {
    await withinMemory(server, async () => {
      const c = open(port);
      await c.connected;
      await c.write(post('/v1/completions', 'Transfer-Encoding: chunked\r\n'));
      const sent = await sendChunked(c, 64 * MiB);
      const r = await c.response(5000);
      c.destroy();
      assert.equal(r?.status, 413, `got ${JSON.stringify(r)} after ${sent} bytes`);
      assert.match(JSON.parse(r.body).error.message, /larger than/);
      console.log(`  413 after ${(sent / MiB).toFixed(2)} MiB of a 64 MiB chunked body`);
      // Answered at the chunk that crossed 1 MiB; what was sent beyond sat in socket buffers.
      assert.ok(sent < 16 * MiB, `${sent / MiB} MiB sent before the answer`);
    });
    await stillServing(server);
  });

  test('a declared Content-Length past the limit is refused at once, before any body byte', async () => {
    await withinMemory(server, async () => {
      const r = await exchange(port, post('/v1/completions', `Content-Length: ${100 * MiB}\r\n`), 1000);
      assert.equal(r.status, 413);
      assert.ok(r.ms < 1000, `${r.ms} ms`);
    });
    await stillServing(server);
  });

  test('malformed framing is a 400 at once', async () => {
    const health = (headers) => `GET /health HTTP/1.1\r\nHost: x\r\n${headers}\r\n`;
    const cases = [
      ['two Content-Length headers', post('/v1/completions', 'Content-Length: 2\r\nContent-Length: 5\r\n') + '{}'],
      ['two equal Content-Length headers', post('/v1/completions', 'Content-Length: 2\r\nContent-Length: 2\r\n') + '{}'],
      ['Content-Length: -1', post('/v1/completions', 'Content-Length: -1\r\n')],
      ['Content-Length: 1e3', post('/v1/completions', 'Content-Length: 1e3\r\n')],
      ['Content-Length: 2, 2', post('/v1/completions', 'Content-Length: 2, 2\r\n') + '{}'],
      ['Content-Length and chunked', post('/v1/completions', 'Content-Length: 2\r\nTransfer-Encoding: chunked\r\n') + '{}'],
      ['a header line without a colon', health('NoColonHere\r\n')],
      ['a NUL in a header value', health('X-A: a\0b\r\n')],
      ['a control character in a header value', health('X-A: a\x01b\r\n')],
      ['whitespace before the colon', health('X-A : b\r\n')],
      ['obsolete line folding', health('X-A: b\r\n  folded\r\n')],
      ['a bare CR in a line', health('X-A: a\rb\r\n')],
      ['no Host header', 'GET /health HTTP/1.1\r\n\r\n'],
      ['two Host headers', 'GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n'],
      ['a bad chunk size', post('/v1/completions', 'Transfer-Encoding: chunked\r\n') + 'ZZ\r\nabc\r\n0\r\n\r\n'],
      ['chunk data longer than its size', post('/v1/completions', 'Transfer-Encoding: chunked\r\n') + '2\r\n{}}\r\n0\r\n\r\n'],
      ['a request line with two spaces', 'GET  /health HTTP/1.1\r\nHost: x\r\n\r\n'],
    ];
    const failures = [];
    await withinMemory(server, async () => {
      for (const [name, bytes] of cases) {
        try {
          const r = await exchange(port, bytes, 1000);
          if (r?.status !== 400) failures.push(`${name}: ${r?.status} ${r?.body}`);
          else if (r.ms > 500) failures.push(`${name}: answered after ${r.ms} ms`);
          else if (typeof JSON.parse(r.body).error?.message !== 'string') failures.push(`${name}: ${r.body}`);
        } catch (e) {
          failures.push(`${name}: ${e.message}`);
        }
      }
    });
    assert.deepEqual(failures, []);
    const te = await exchange(port, post('/v1/completions', 'Transfer-Encoding: gzip\r\n'), 1000);
    assert.equal(te.status, 501);
    await stillServing(server);
  });

  test('a head that trickles in is cut off at --header-timeout (408)', async () => {
    await withinMemory(server, async () => {
      const c = open(port);
      await c.connected;
      const t0 = Date.now();
      await c.write('GET /health HTTP/1.1\r\nHost: x\r\n');
      // One header line every 400 ms: each read is quick, the head never ends.
      const drip = setInterval(() => c.write(`X-Drip-${Date.now()}: 1\r\n`), 400);
      try {
        const r = await c.response(6000);
        const ms = Date.now() - t0;
        assert.equal(r?.status, 408, JSON.stringify(r));
        assert.ok(ms >= 1800 && ms < 3500, `closed after ${ms} ms (header timeout 2 s)`);
        assert.ok(await c.closedWithin(3000), 'the connection stayed open');
      } finally {
        clearInterval(drip);
        c.destroy();
      }
    });
    await stillServing(server);
  });

  test('a body that trickles in is cut off at --body-timeout (408)', async () => {
    const c = open(port);
    await c.connected;
    const t0 = Date.now();
    await c.write(post('/v1/completions', 'Content-Length: 1000\r\n') + '{"prompt": "');
    const drip = setInterval(() => c.write('a'), 300);
    try {
      const r = await c.response(7000);
      const ms = Date.now() - t0;
      assert.equal(r?.status, 408, JSON.stringify(r));
      assert.ok(ms >= 2800 && ms < 4500, `answered after ${ms} ms (body timeout 3 s)`);
    } finally {
      clearInterval(drip);
      c.destroy();
    }
    await stillServing(server);
  });

  test('300 idle and 300 slow connections: /health and a generation still answer at once', async () => {
    const crowd = [];
    await withinMemory(server, async () => {
      for (let i = 0; i < 600; ++i) crowd.push(open(port));
      await Promise.all(crowd.map((c) => c.connected));
      // Half send a partial head and then a byte now and then; half send nothing.
      await Promise.all(crowd.slice(300).map((c) => c.write('POST /v1/completions HTTP/1.1\r\nHost: x\r\n')));
      const drip = setInterval(() => {
        for (const c of crowd.slice(300)) c.write('X');
      }, 300);
      try {
        await new Promise((r) => setTimeout(r, 200));
        const t0 = Date.now();
        const h = await fetch(`${server.url}/health`);
        const healthMs = Date.now() - t0;
        assert.equal(h.status, 200);
        assert.ok(healthMs < 500, `/health took ${healthMs} ms`);
        const genMs = await stillServing(server);
        console.log(`  with 600 idle/slow connections: /health ${healthMs} ms, a generation ${genMs} ms`);
        assert.ok(genMs < 5000, `a generation took ${genMs} ms`);
      } finally {
        clearInterval(drip);
      }
      // The deadlines clear the crowd: idle ones at --idle-timeout, slow heads at --header-timeout.
      const closed = await Promise.all(crowd.map((c) => c.closedWithin(4000)));
      assert.equal(closed.filter((x) => !x).length, 0, 'connections outlived their deadlines');
    });
    for (const c of crowd) c.destroy();
  });

  test('wrong methods are 405 with Allow; OPTIONS answers 204', async () => {
    for (const [method, path, allow] of [['PATCH', '/v1/completions', 'POST'], ['PUT', '/health', 'GET'],
      ['DELETE', '/v1/models', 'GET'], ['GET', '/v1/responses', 'POST'], ['POST', '/metrics', 'GET']]) {
      const r = await exchange(port, `${method} ${path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n`);
      assert.equal(r.status, 405, `${method} ${path}: ${r.status}`);
      assert.match(r.headers.allow, new RegExp(allow));
    }
    const o = await exchange(port, 'OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n');
    assert.equal(o.status, 204);
    assert.match(o.headers.allow, /POST/);
  });

  test('an HTTP/1.0 stream is the SSE bytes themselves, ended by the close (no chunking)', async () => {
    const body = JSON.stringify({ prompt: [9707, 11], max_tokens: 3, temperature: 0, ignore_eos: true, stream: true });
    const c = open(port);
    await c.connected;
    await c.write(`POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n` +
      `Content-Length: ${body.length}\r\n\r\n${body}`);
    assert.ok(await c.closedWithin(10000), 'the stream did not end with the close');
    const text = c.buf.toString('latin1');
    const end = text.indexOf('\r\n\r\n');
    const head = text.slice(0, end);
    assert.match(head, /^HTTP\/1\.1 200/);
    assert.doesNotMatch(head, /transfer-encoding/i);
    assert.match(head, /\r\nConnection: close(\r|$)/);
    const events = text.slice(end + 4);
    assert.match(events, /^data: \{/, events.slice(0, 80));
    assert.ok(events.endsWith('data: [DONE]\n\n'), events.slice(-80));
    // Every line an SSE data line (chunk framing would put size lines between them); how many
    // events the three tokens took depends on how fast the writer drained the engine's steps.
    const lines = events.split('\n').filter((l) => l.length > 0);
    assert.ok(lines.every((l) => l.startsWith('data: ')), events);
    assert.ok(lines.length >= 2, events);
  });
});

describe('with an API key', () => {
  let server;
  let port;
  before(async () => {
    server = await startServer(['--api-key', KEY, ...LIMITS]);
    port = Number(new URL(server.url).port);
  });
  after(() => stopCleanly(server));

  test('no key: 401 from the head alone, chunked or not, before any body byte', async () => {
    await withinMemory(server, async () => {
      for (const framing of ['Transfer-Encoding: chunked\r\n', `Content-Length: ${300 * MiB}\r\n`]) {
        const c = open(port);
        await c.connected;
        const t0 = Date.now();
        await c.write(post('/v1/completions', framing));
        const r = await c.response(1000);
        const ms = Date.now() - t0;
        assert.equal(r?.status, 401, `${framing.trim()}: ${JSON.stringify(r)}`);
        assert.ok(ms < 500, `${framing.trim()}: 401 after ${ms} ms`);
        c.destroy();
      }
      // A client that keeps sending after its 401 is read and dropped, never buffered.
      const c = open(port);
      await c.connected;
      await c.write(post('/v1/completions', 'Transfer-Encoding: chunked\r\n'));
      await sendChunked(c, 32 * MiB);
      const r = await c.response(3000);
      assert.equal(r?.status, 401);
      c.destroy();
    });
    await stillServing(server, { authorization: `Bearer ${KEY}` });
  });

  test('with the key: a chunked body past the limit is 413', async () => {
    await withinMemory(server, async () => {
      const c = open(port);
      await c.connected;
      await c.write(post('/v1/completions', `Authorization: Bearer ${KEY}\r\nTransfer-Encoding: chunked\r\n`));
      const sent = await sendChunked(c, 32 * MiB);
      const r = await c.response(5000);
      c.destroy();
      assert.equal(r?.status, 413, `got ${JSON.stringify(r)} after ${sent} bytes`);
    });
    await stillServing(server, { 'x-api-key': KEY });
  });

  test('Expect: 100-continue is answered only once the head is accepted', async () => {
    const c = open(port);
    await c.connected;
    const body = JSON.stringify({ prompt: [9707], max_tokens: 1 });
    await c.write(post('/v1/completions', `Authorization: Bearer ${KEY}\r\nExpect: 100-continue\r\nContent-Length: ${body.length}\r\n`));
    // The interim response whenever it comes (c.response() takes it whole), and nothing else.
    assert.equal((await c.response(5000))?.status, 100);
    assert.match(c.buf.toString('latin1'), /^HTTP\/1\.1 100 Continue\r\n\r\n$/);
    c.buf = Buffer.alloc(0);
    await c.write(body);
    const r = await c.response(5000);
    assert.equal(r.status, 200, r.body);
    c.destroy();
    const refused = await exchange(port, post('/v1/completions', `Expect: 100-continue\r\nContent-Length: ${body.length}\r\n`));
    assert.equal(refused.status, 401);
  });
});

describe('at the connection limit', () => {
  test('idle connections are displaced; when all are busy, a new one gets 503', async () => {
    const server = await startServer(['--max-connections', '16', '--max-batch', '4', '--kv-cache-mb', '64']);
    const port = Number(new URL(server.url).port);
    const crowd = [];
    const streams = [];
    try {
      await withinMemory(server, async () => {
        for (let i = 0; i < 40; ++i) crowd.push(open(port));
        await Promise.all(crowd.map((c) => c.connected));
        const t0 = Date.now();
        const h = await exchange(port, 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n', 1000);
        assert.equal(h.status, 200);
        console.log(`  /health past 40 idle connections (limit 16): ${Date.now() - t0} ms`);
        assert.ok(await crowd[0].closedWithin(1000), 'the oldest idle connection was not displaced');
        for (const c of crowd) c.destroy();
        // 16 connections each streaming a generation: nothing left to displace.
        const body = JSON.stringify({ prompt: [9707], max_tokens: 100000, ignore_eos: true, stream: true });
        for (let i = 0; i < 16; ++i) {
          const c = open(port);
          await c.connected;
          await c.write(post('/v1/completions', `Content-Length: ${body.length}\r\n`) + body);
          streams.push(c);
        }
        // Each taken in (its response begun): busy, nothing the server may displace.
        for (const r of await Promise.all(streams.map((c) => c.response(10000)))) {
          assert.equal(r?.status, 200);
        }
        const refused = await exchange(port, 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n', 1000);
        assert.equal(refused.status, 503);
        assert.equal(refused.headers['retry-after'], '1');
        for (const c of streams) c.destroy();
        await untilHealth(server, 200);  // the server has seen them close
      });
      await stillServing(server);
    } finally {
      for (const c of [...crowd, ...streams]) c.destroy();
      const r = await server.stop();
      assert.deepEqual(r, { code: 0, signal: null }, server.output());
    }
  });
});

describe('draining after SIGTERM', () => {
  // A server with --shutdown-grace `grace`, told SIGTERM while an endless stream runs; `body`
  // gets it, draining, and the stream's reader.
  async function whileDraining(grace, body) {
    const server = await startServer(['--max-batch', '2', '--shutdown-grace', String(grace), '--kv-cache-mb', '64']);
    try {
      const res = await fetch(`${server.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: [9707], max_tokens: 100000, ignore_eos: true, stream: true }),
      });
      assert.equal(res.status, 200);
      const reader = res.body.getReader();
      await reader.read();  // the stream is running
      server.proc.kill('SIGTERM');
      // Taken: a second SIGTERM sent before would merge with this one.
      await untilHealth(server, 503);
      await body(server, reader);
    } finally {
      await server.stop();
    }
  }

  test('/health answers 503 to new connections while requests finish', async () => {
    await whileDraining(3, async (server, reader) => {
      const h = await fetch(`${server.url}/health`);
      assert.equal(h.status, 503);
      assert.deepEqual(await h.json(), { status: 'shutting down' });
      const g = await fetch(`${server.url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"prompt": [1]}',
      });
      assert.equal(g.status, 503);
      // The stream is cancelled after the grace period and ends; the server exits 0.
      for (;;) if ((await reader.read()).done) break;
      const r = await server.exit();
      assert.deepEqual(r, { code: 0, signal: null }, server.output());
    });
  });

  // The Messages API has no stop reason for a cut answer: one the shutdown ends is an error
  // (streamed: the last event; whole: a 503), never an end_turn a client would take as complete.
  test('an Anthropic message the shutdown cuts short ends in an error, not end_turn', async () => {
    const server = await startServer(['--max-batch', '2', '--shutdown-grace', '1', '--kv-cache-mb', '64']);
    try {
      const message = (stream) => fetch(`${server.url}/v1/messages`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'anthropic-version': '2023-06-01' },
        body: JSON.stringify({ model: 'qwen3next-tiny-realvocab', max_tokens: 100000, ignore_eos: true,
          stream, messages: [{ role: 'user', content: 'hi' }] }),
      });
      const streamed = await message(true);
      assert.equal(streamed.status, 200);
      const whole = message(false);
      const reader = streamed.body.getReader();
      await reader.read();  // the stream is running
      // Both run before the SIGTERM: a request that arrives after it is refused (503) unrun.
      const t0 = Date.now();
      while ((await metrics(server.url)).value('recur_num_requests_running') < 2) {
        assert.ok(Date.now() - t0 < 10000, 'the whole message never started');
        await new Promise((r) => setTimeout(r, 20));
      }
      server.proc.kill('SIGTERM');
      let text = '';
      const decoder = new TextDecoder();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        text += decoder.decode(value, { stream: true });
      }
      const events = text.split('\n').filter((l) => l.startsWith('event: ')).map((l) => l.slice(7));
      assert.equal(events.at(-1), 'error', events.slice(-3).join(', '));
      assert.ok(!events.includes('message_stop'));
      assert.match(text, /"type":"overloaded_error","message":"the answer was cut short \(cancelled at shutdown\)/);
      const res = await whole;
      assert.equal(res.status, 503);
      const body = await res.json();
      assert.equal(body.type, 'error');
      assert.equal(body.error.type, 'overloaded_error');
      assert.match(body.error.message, /cut short/);
      const r = await server.exit();
      assert.deepEqual(r, { code: 0, signal: null }, server.output());
    } finally {
      await server.stop();
    }
  });

  test('a second SIGTERM exits at once, without waiting for the grace period', async () => {
    await whileDraining(120, async (server) => {
      assert.equal(server.exited(), null, 'the first SIGTERM drains: the stream keeps running');
      const t0 = Date.now();
      server.proc.kill('SIGTERM');
      while (!server.exited() && Date.now() - t0 < 10000) await new Promise((r) => setTimeout(r, 50));
      assert.deepEqual(server.exited(), { code: 1, signal: null }, server.output());
      assert.match(server.output(), /received SIGTERM again: exiting/);
    });
  });
});
