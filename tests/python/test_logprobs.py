"""GenerationResponse.logprobs and Response.logprobs: as mlx-lm's, log_softmax of the step's
logits over the whole vocabulary, a numpy array indexed by token id."""

import sys

import numpy as np
import pytest

import recur

from conftest import read_golden


def logsumexp(v):
    v = np.asarray(v, dtype=np.float64)
    m = v.max()
    return m + np.log(np.exp(v - m).sum())


def test_stream_generate_vectors_match_the_reference(tiny):
    model, tok = tiny
    golden = read_golden("qwen3next-tiny")
    worst = 0.0
    for p in ("p1", "p2"):
        ids, gen, logits = (golden[p + ".ids"], golden[p + ".gen"], golden[p + ".gen_logits"])
        out = list(recur.stream_generate(model, tok, [int(t) for t in ids],
                                         max_tokens=len(gen)))
        assert [r.token for r in out] == [int(t) for t in gen]
        for r, row in zip(out, logits):
            v = r.logprobs
            assert isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (256,)
            assert abs(logsumexp(v)) < 1e-6
            assert int(np.argmax(v)) == r.token
            ref = row.astype(np.float64) - logsumexp(row)
            worst = max(worst, float(np.abs(ref - v).max()))
            assert v[r.token].item() <= 0  # mlx-lm scripts call .item()
    assert worst <= 2e-4  # the engine's logits against transformers' (test_vocab_logprobs)


def test_vector_holds_the_chosen_tokens_logprob(tiny):
    # The engine's own logprob of the chosen token, asked for beside the vector, is its entry.
    model, _ = tiny
    s = model._session
    uid = s.submit([4, 8, 15, 16, 23, 42], 12, temperature=0.9, seed=5, logprobs=0,
                   vocab_logprobs=True)
    events = []
    while s.step():
        events += [e for e in s.take_events() if e[0] == uid]
    events += [e for e in s.take_events() if e[0] == uid]
    tokens = [e for e in events if not e[1]]
    assert len(tokens) == 12
    for e in tokens:
        v = np.frombuffer(e[9], dtype=np.float32)
        assert v[e[2]] == np.float32(e[3])
        assert abs(logsumexp(v)) < 1e-6


def test_batch_generator_vectors_equal_single_and_are_off_when_not_asked(tiny):
    model, tok = tiny
    prompts = [[1, 2, 3], [9, 9, 9, 9, 9], [200, 100, 50, 25]]
    single = [[r.logprobs for r in recur.stream_generate(model, tok, p, max_tokens=15)]
              for p in prompts]
    gen = recur.BatchGenerator(model, max_tokens=15)
    uids = gen.insert(prompts)
    got = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            assert isinstance(r, recur.BatchGenerator.Response)
            got[r.uid].append(r)
    gen.close()
    for u, ref in zip(uids, single):
        assert len(got[u]) == 15
        for r, v in zip(got[u], ref):
            assert int(np.argmax(r.logprobs)) == r.token
            assert np.abs(r.logprobs - v).max() <= 1e-4  # summation order in a batch
    off = recur.BatchGenerator(model, max_tokens=3, return_logprobs=False)
    off.insert([[1, 2, 3]])
    rs = []
    while r := off.next_generated():
        rs += r
    off.close()
    assert len(rs) == 3 and all(r.logprobs is None for r in rs)
    assert all(r.logprobs is None for r in
               recur.stream_generate(model, tok, [1, 2], max_tokens=2, return_logprobs=False))


def test_batch_generate_return_logprobs(tiny):
    model, tok = tiny
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    res = recur.batch_generate(model, tok, prompts, max_tokens=6, return_token_ids=True,
                               return_logprobs=True)
    assert res.caches is None
    for p, ids, lps in zip(prompts, res.token_ids, res.logprobs):
        out = list(recur.stream_generate(model, tok, p, max_tokens=6))
        assert ids == [r.token for r in out]
        assert lps == pytest.approx([float(r.logprobs[r.token]) for r in out], abs=1e-4)
    plain = recur.batch_generate(model, tok, prompts, max_tokens=6)
    assert plain.token_ids is None and plain.logprobs is None


def test_buffer_counters_flat_with_vectors(tiny):
    model, _ = tiny
    gen = recur.BatchGenerator(model, max_tokens=1500)
    gen.insert([[1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6]])
    n, at = 0, {}
    while r := gen.next_generated():
        assert all(x.logprobs is not None for x in r if x.token is not None)
        n += len(r)
        if n in (400, 3000):
            s = gen.stats()
            at[n] = (s.live_buffers, s.live_bytes, s.allocs_total)
    gen.close()
    assert n == 3000 and at[400] == at[3000]


def test_memoryview_without_numpy(tiny, monkeypatch):
    model, tok = tiny
    ref = list(recur.stream_generate(model, tok, [5, 6, 7], max_tokens=3))
    monkeypatch.setattr(sys.modules["recur.generate"], "_np", None)
    out = list(recur.stream_generate(model, tok, [5, 6, 7], max_tokens=3))
    for r, a in zip(out, ref):
        assert isinstance(r.logprobs, memoryview) and len(r.logprobs) == 256
        assert r.logprobs[r.token] == float(a.logprobs[a.token])
        assert list(r.logprobs) == a.logprobs.tolist()


def test_real_vocabulary_vector(realvocab):
    model, tok = realvocab
    out = list(recur.stream_generate(model, tok, "The weather today", max_tokens=3))
    for r in out:
        assert r.logprobs.shape == (tok.vocab_size,) == (151936,)
        assert int(np.argmax(r.logprobs)) == r.token
        assert abs(logsumexp(r.logprobs)) < 1e-5
