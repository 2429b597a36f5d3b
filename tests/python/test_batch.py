import pytest

import recur


def test_batch_generate_equals_one_at_a_time(realvocab):
    model, tok = realvocab
    prompts = [tok.encode("Hello"), tok.encode("A longer prompt about the weather in Paris"),
               [1, 2, 3, 4, 5], tok.encode("x")]
    batched = recur.batch_generate(model, tok, prompts, max_tokens=10, return_token_ids=True)
    single = [recur.generate(model, tok, p, max_tokens=10) for p in prompts]
    assert batched.texts == single
    assert batched.stats.generation_tokens > 0
    assert [tok.decode(t) for t in batched.token_ids] == single
    assert all(1 <= len(t) <= 10 for t in batched.token_ids)
    assert batched.logprobs is None and batched.caches is None


def test_batch_generator_insert_next_remove(tiny):
    model, _ = tiny
    gen = recur.BatchGenerator(model, max_tokens=12)
    uids = gen.insert([[1, 2, 3], [4, 5, 6, 7], [8]], max_tokens=[12, 40, 5])
    assert len(set(uids)) == 3
    counts = {u: 0 for u in uids}
    finished = {}
    removed = None
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        for r in responses:
            assert r.uid in counts and r.uid != removed
            if r.token is not None:
                counts[r.uid] += 1
            if r.finish_reason:
                finished[r.uid] = r.finish_reason
        if removed is None and counts[uids[1]] >= 3:
            removed = uids[1]
            gen.remove([removed])
    assert counts[uids[0]] == 12 and finished[uids[0]] == "length"
    assert counts[uids[2]] == 5 and finished[uids[2]] == "length"
    assert 3 <= counts[uids[1]] < 12 and uids[1] not in finished
    # Removed in the engine too, not only in the generator: nothing runs on after the others.
    assert model.stats()["running"] == 0
    s = gen.stats()
    assert s.generation_tokens >= 20 and s.live_buffers > 0 and s.allocs_total > 0
    gen.close()
    assert model.stats()["running"] == 0


def test_batch_generator_stop_tokens_and_late_insert(tiny):
    model, _ = tiny
    ref = recur.BatchGenerator(model, max_tokens=4)
    (u,) = ref.insert([[9, 9, 9]])
    toks = []
    while r := ref.next_generated():
        toks += [x.token for x in r]
    ref.close()
    gen = recur.BatchGenerator(model, max_tokens=50, stop_tokens=[toks[1]])
    (a,) = gen.insert([[9, 9, 9]])
    first = gen.next_generated()
    (b,) = gen.insert([[3, 1, 4]], max_tokens=2)  # while a is running
    got = {a: [x.token for x in first], b: []}
    reasons = {}
    while r := gen.next_generated():
        for x in r:
            got[x.uid].append(x.token)
            if x.finish_reason:
                reasons[x.uid] = x.finish_reason
    assert got[a] == toks[:2] and reasons[a] == "stop"
    assert len(got[b]) == 2 and reasons[b] == "length"
    gen.close()
    # Stop tokens as newer mlx-lm gives them, sequences of ids: one id, or several in a row.
    for stops, n in (([[toks[2]]], 3), ([[toks[1], toks[2]]], 3), ([[toks[2], toks[1]]], 4)):
        g = recur.BatchGenerator(model, max_tokens=4, stop_tokens=stops)
        g.insert([[9, 9, 9]])
        out = []
        while r := g.next_generated():
            out += r
        g.close()
        assert [x.token for x in out] == toks[:n], stops
        assert out[-1].finish_reason == ("stop" if n < 4 else "length"), stops


def test_live_buffers_flat(tiny):
    model, _ = tiny
    gen = recur.BatchGenerator(model, max_tokens=400)
    gen.insert([[1, 2, 3, 4, 5, 6, 7, 8]])
    n, at = 0, {}
    while r := gen.next_generated():
        n += len(r)
        if n in (100, 400):
            at[n] = (gen.stats().live_buffers, gen.stats().live_bytes)
    assert at[100] == at[400]
    gen.close()


def test_insert_per_prompt_samplers_and_numpy_prompts(tiny):
    import numpy as np
    from recur.sample_utils import make_sampler
    model, _ = tiny
    hot = make_sampler(temp=1.5, seed=4)

    def run(prompts, **kw):
        g = recur.BatchGenerator(model, max_tokens=8)
        uids = g.insert(prompts, **kw)
        got = {u: [] for u in uids}
        while r := g.next_generated():
            for x in r:
                got[x.uid].append(x.token)
        g.close()
        return [got[u] for u in uids]

    greedy = run([[1, 2, 3], [4, 5]])
    mixed = run([np.array([1, 2, 3]), [4, 5]], samplers=[hot, None])
    assert mixed[1] == greedy[1]
    assert mixed[0] == run([[1, 2, 3]], samplers=[hot])[0] != greedy[0]
    gen = recur.BatchGenerator(model)
    with pytest.raises(ValueError, match="one max_tokens and one sampler"):
        gen.insert([[1], [2]], samplers=[hot])
    with pytest.raises(ValueError, match="stop_matchers"):
        gen.insert([[1]], stop_matchers=[object()])
    with pytest.raises(ValueError, match="prompt caches"):
        gen.insert([[1]], caches=[[]])
    gen.close()


def test_load_return_config_and_mlx_lm_options():
    import os
    from conftest import MODELS
    path = os.path.join(MODELS, "qwen3next-tiny")
    model, tok, config = recur.load(path, kv_cache_mb=8, lazy=True, tokenizer_config={},
                                    return_config=True)
    assert config["vocab_size"] == 256 and tok.vocab_size == 256
    with pytest.raises(ValueError, match="adapter_path"):
        recur.load(path, adapter_path="adapters")
