import os

import pytest

import recur
from recur.sample_utils import make_sampler

from conftest import MODELS


def test_tokenizer_round_trip(realvocab):
    _, tok = realvocab
    ids = tok.encode("Hello, world!")
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "Hello, world!"
    assert 151645 in tok.eos_token_ids
    assert tok.eos_token_id in tok.eos_token_ids


def test_chat_template(realvocab):
    _, tok = realvocab
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert tok.decode(ids) == text
    assert ids[0] == tok.encode("<|im_start|>")[0]
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert "get_weather" in tok.apply_chat_template(messages, tools=tools, tokenize=False)


def test_generate_text_and_ids_agree(realvocab):
    model, tok = realvocab
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    a = recur.generate(model, tok, prompt, max_tokens=8)
    b = recur.generate(model, tok, tok.encode(prompt), max_tokens=8)
    assert isinstance(a, str) and a
    assert a == b  # greedy by default, as mlx-lm


def test_stream_generate_responses(realvocab):
    model, tok = realvocab
    prompt = tok.encode("The quick brown fox")
    out = list(recur.stream_generate(model, tok, prompt, max_tokens=6))
    assert len(out) == 6
    assert [r.generation_tokens for r in out] == [1, 2, 3, 4, 5, 6]
    assert all(r.prompt_tokens == len(prompt) for r in out)
    assert all(r.finish_reason is None for r in out[:-1])
    assert out[-1].finish_reason == "length"
    assert out[0].prompt_tps > 0 and out[-1].generation_tps > 0
    assert out[-1].peak_memory > 0
    assert all(isinstance(r.token, int) and r.logprobs[r.token] <= 0 for r in out)
    assert all(r.from_draft is False for r in out)
    text = recur.generate(model, tok, prompt, max_tokens=6)
    assert "".join(r.text for r in out) == text
    assert tok.decode([r.token for r in out]) == text


def test_stream_generate_stops_at_eos(realvocab):
    model, tok = realvocab
    prompt = tok.encode("Hi")
    first = next(iter(recur.stream_generate(model, tok, prompt, max_tokens=1))).token
    # The first greedy token made an end-of-sequence token for this request: it stops there.
    out = list(recur.stream_generate(model, tok, prompt, max_tokens=5, stop_tokens=[first]))
    assert len(out) == 1 and out[0].finish_reason == "stop" and out[0].text == ""


def test_sampler_seeded_is_reproducible(realvocab):
    model, tok = realvocab
    s = make_sampler(temp=1.0, top_p=0.9, min_p=0.01, top_k=50, seed=3)
    a = recur.generate(model, tok, [1, 2, 3], max_tokens=8, sampler=s)
    b = recur.generate(model, tok, [1, 2, 3], max_tokens=8, sampler=s)
    assert a == b
    greedy = recur.generate(model, tok, [1, 2, 3], max_tokens=8,
                            sampler=make_sampler(temp=0.0))
    assert greedy == recur.generate(model, tok, [1, 2, 3], max_tokens=8)
    with pytest.raises(ValueError):
        make_sampler(temp=-1.0).engine_args()


def test_stream_closed_early_frees_the_request(realvocab):
    model, tok = realvocab
    gen = recur.stream_generate(model, tok, [5, 6, 7], max_tokens=100)
    next(gen)
    gen.close()
    while model._step():
        pass
    assert model.stats()["running"] == 0


def test_bad_input(realvocab, tiny):
    model, tok = realvocab
    with pytest.raises(TypeError):
        recur.generate(model, tok, 42, max_tokens=2)
    with pytest.raises(TypeError):
        recur.generate(model, tok, [1, "a"], max_tokens=2)
    with pytest.raises(ValueError, match="vocab|token"):
        recur.generate(model, tok, [10**9], max_tokens=2)
    with pytest.raises(ValueError):
        recur.generate(model, tok, [], max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens"):
        recur.generate(model, tok, [1, 2], max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        recur.BatchGenerator(model).insert([[1, 2]], max_tokens=0)
    with pytest.raises(TypeError):
        recur.BatchGenerator(model).insert("not a list of prompts")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        recur.load(os.path.join(MODELS, "no-such-model"))
    with pytest.raises(TypeError, match="unknown engine option"):
        recur.load(os.path.join(MODELS, "qwen3next-tiny"), bogus=1)
    with pytest.raises(Exception, match="device|cuda"):
        recur.load(os.path.join(MODELS, "qwen3next-tiny"), device="tpu")
    tiny_model, tiny_tok = tiny
    with pytest.raises(ValueError, match="tokenizer"):
        recur.generate(tiny_model, tiny_tok, "text needs a tokenizer", max_tokens=2)
    # The engine is still usable after every refusal.
    assert len(list(recur.stream_generate(tiny_model, tiny_tok, [1, 2], max_tokens=2))) == 2


def test_generate_verbose_and_counters(realvocab, capsys):
    model, tok = realvocab
    before = model.stats()
    text = recur.generate(model, tok, [1, 2, 3, 4], True, max_tokens=5)  # verbose, as mlx-lm
    printed = capsys.readouterr().out
    assert printed.startswith("=" * 10 + "\n" + text + "\n" + "=" * 10)
    assert "Prompt: 4 tokens, " in printed and "Generation: 5 tokens, " in printed
    assert "Peak memory: " in printed
    after = model.stats()
    assert after["generated_tokens"] == before["generated_tokens"] + 5
    assert after["prompt_tokens"] == before["prompt_tokens"] + 4
    assert after["live_buffers"] > 0 and after["allocs_total"] >= after["live_buffers"]
    assert after["live_bytes"] > 0


def test_generate_from_threads(realvocab):
    # The engine steps on whichever thread asks, one at a time, GIL released: concurrent calls
    # share its batch and each gets its own completion.
    import threading
    model, tok = realvocab
    ref = recur.generate(model, tok, [1, 2, 3], max_tokens=30)
    results = [None] * 4

    def run(i):
        results[i] = recur.generate(model, tok, [1, 2, 3], max_tokens=30)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [ref] * 4


def test_mlx_lm_call_shapes(realvocab, tiny):
    # Calls as mlx-lm scripts make them: its main()'s make_sampler, options of its own machinery
    # accepted, options that would change the result refused with their name.
    model, tok = realvocab
    s = make_sampler(0.0, 0.0, 0.0, 1, top_k=0, xtc_probability=0.0, xtc_threshold=0.0,
                     xtc_special_tokens=tok.encode("\n") + list(tok.eos_token_ids))
    text = recur.generate(model, tok, [1, 2, 3], max_tokens=4, sampler=s, prefill_step_size=512,
                          kv_group_size=64, quantized_kv_start=0)
    assert text == recur.generate(model, tok, [1, 2, 3], max_tokens=4)
    with pytest.raises(ValueError, match="XTC"):
        make_sampler(temp=0.7, xtc_probability=0.5, xtc_threshold=0.1)
    with pytest.raises(ValueError, match="min_tokens_to_keep"):
        make_sampler(temp=0.7, min_p=0.1, min_tokens_to_keep=3)
    for name in ("draft_model", "logits_processors", "prompt_cache", "max_kv_size", "kv_bits"):
        with pytest.raises(ValueError, match=name):
            recur.generate(model, tok, [1, 2], max_tokens=2, **{name: [object()]})
        with pytest.raises(ValueError, match=name):
            recur.BatchGenerator(model, **{name: 1})
    with pytest.raises(ValueError, match="prompt caches"):
        recur.batch_generate(model, tok, [[1, 2]], prompt_caches=[[]])
    calls = []
    recur.generate(model, tok, [1, 2, 3], max_tokens=2,
                   prompt_progress_callback=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 3), (3, 3)]
    assert tok.has_chat_template and not tiny[1].has_chat_template
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(messages, continue_final_message=True)
    assert tok.apply_chat_template(messages, continue_final_message=False, tokenize=False) == \
        tok.apply_chat_template(messages, tokenize=False)


def test_kv_cache_dtype_option():
    # An engine with its attention cache in bf16, f16 or fp8 generates; a type the binding does
    # not know is refused by name.
    path = os.path.join(MODELS, "qwen3next-tiny")
    for t in ("bf16", "f16", "fp8"):
        model, tok = recur.load(path, kv_cache_mb=8, kv_cache_dtype=t)
        assert len(list(recur.stream_generate(model, tok, [1, 2], max_tokens=2))) == 2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        recur.load(path, kv_cache_dtype="int4")


@pytest.mark.parametrize("option,names,bad,model", [
    ("fp8_activations", ("e4m3", "f16"), "int8", "qwen3next-fp8-tiny"),
    ("prompt_activations", ("f16x2", "f16"), "bf16", "qwen3next-tiny"),
])
def test_activation_options(option, names, bad, model):
    # Each way of feeding the GPU's prompt products (block-FP8 or 16-bit weights) loads and
    # generates (the CPU multiplies f32 activations under all); a name the binding does not know
    # is refused, naming the option and its choices.
    path = os.path.join(MODELS, model)
    for name in names:
        m, tok = recur.load(path, kv_cache_mb=8, **{option: name})
        assert len(list(recur.stream_generate(m, tok, [1, 2], max_tokens=2))) == 2
    with pytest.raises(ValueError, match=f"{option}: {names[0]} or {names[1]}, not '{bad}'"):
        recur.load(path, **{option: bad})


def test_quantize_and_tensor_parallel_options(tiny):
    """load()'s quantize and tensor_parallel reach the engine: two ranks generate the whole
    model's greedy tokens, int8 weights load and generate, and bad values are refused."""
    path = os.path.join(MODELS, "qwen3next-tiny")
    prompt = [3, 17, 42, 5, 99, 7]

    def greedy(model, tok):
        return [r.token for r in recur.stream_generate(model, tok, prompt, max_tokens=12)]

    whole = greedy(*tiny)
    split = recur.load(path, kv_cache_mb=32, tensor_parallel=2)
    assert greedy(*split) == whole
    int8 = recur.load(path, kv_cache_mb=32, quantize="int8")
    assert len(greedy(*int8)) == 12
    with pytest.raises(ValueError, match="quantize"):
        recur.load(path, quantize="int3")
    with pytest.raises(Exception, match="tensor parallel|ranks"):
        recur.load(path, kv_cache_mb=32, tensor_parallel=3)
