"""The engine behind mlx-lm's generation calls. A Model owns one engine; every request on it
(stream_generate's, a BatchGenerator's) is one engine request, and each engine step's events are
handed to the queue of the request they belong to, so generators sharing a model do not mix."""

import json
import operator
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

try:  # from the build folder (build/python on PYTHONPATH), which is never stale
    import _recur
except ImportError:  # installed: the copy inside the package (`make python`)
    from . import _recur
from .sample_utils import GREEDY, Sampler

try:  # the log-probability vectors are numpy arrays when numpy is there (as mlx-lm's mx.array)
    import numpy as _np
except ImportError:  # else memoryviews of float32: indexable, len() is the vocabulary
    _np = None

_ENGINE_OPTIONS = ("threads", "max_batch", "max_batch_tokens", "max_context", "kv_cache_mb",
                   "prefix_cache_mb", "snapshot_interval", "seed", "pipeline_decode",
                   "kv_cache_dtype", "quantize", "tensor_parallel", "fp8_activations",
                   "prompt_activations")


class Model:
    """A loaded model and its engine. Not used directly: pass it to the generation calls."""

    def __init__(self, session, path: str):
        self._session = session
        self.path = path
        self._queues: Dict[int, deque] = {}

    @property
    def eos_token_ids(self) -> List[int]:
        return list(self._session.eos_token_ids)

    def stats(self) -> Dict[str, Any]:
        """The engine's counters since load: tokens, times, and its allocator's live_buffers,
        live_bytes, peak_bytes and allocs_total (flat in steady state)."""
        return self._session.stats()

    def _submit(self, ids: List[int], max_tokens: int, sampler: Optional[Sampler],
                stop_tokens: Iterable[int] = (), ignore_eos: bool = False,
                stop_sequences: Iterable[Sequence[int]] = (), logprobs: bool = True) -> int:
        if sampler is None:
            sampler = GREEDY  # mlx-lm's default sampler is argmax
        if not isinstance(sampler, Sampler):
            raise TypeError("sampler must come from recur.sample_utils.make_sampler")
        uid = self._session.submit(ids, int(max_tokens), stop_tokens=list(stop_tokens),
                                   stop_sequences=[list(q) for q in stop_sequences],
                                   ignore_eos=ignore_eos, vocab_logprobs=bool(logprobs),
                                   **sampler.engine_args())
        self._queues[uid] = deque()
        return uid

    def _cancel(self, uid: int):
        if self._queues.pop(uid, None) is not None:
            self._session.cancel(uid)

    def _step(self) -> bool:
        """One engine step; its events go to their requests' queues. False when idle."""
        busy = self._session.step()
        for ev in self._session.take_events():
            q = self._queues.get(ev[0])
            if q is not None:  # events of cancelled requests have no queue left
                q.append(ev)
        return busy


class TokenizerWrapper:
    """The model's tokenizer and chat template, with the calls mlx-lm scripts make."""

    def __init__(self, session):
        self._session = session

    @property
    def eos_token_ids(self) -> set:
        return set(self._session.eos_token_ids)

    @property
    def eos_token_id(self) -> Optional[int]:
        ids = self._session.eos_token_ids
        return ids[0] if ids else None

    @property
    def vocab_size(self) -> int:
        return self._session.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        # Qwen's tokenizers add no BOS, so add_special_tokens changes nothing for them.
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._session.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._session.decode(_token_list(ids), skip_special_tokens).decode(
            "utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        return self._session.has_chat_template

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True,
                            tokenize: bool = True, documents=None, **kwargs):
        """The model's chat template; kwargs (enable_thinking, ...) reach it as variables."""
        for name in ("chat_template", "continue_final_message", "return_dict"):
            if kwargs.get(name):  # transformers' options that change the result
                raise ValueError(f"apply_chat_template: {name} is not supported by recur")
            kwargs.pop(name, None)
        request: Dict[str, Any] = {"messages": messages,
                                   "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            request["tools"] = tools
        if documents is not None:
            request["documents"] = documents
        if kwargs:
            request["chat_template_kwargs"] = kwargs
        return self._session.render_chat(json.dumps(request), tokenize)


def load(path: str, device: str = "cpu", return_config: bool = False, **engine_options):
    """(model, tokenizer) for a Hugging Face model directory, and its config.json's contents
    with return_config=True (as mlx-lm). engine_options: threads, max_batch, max_batch_tokens,
    max_context, kv_cache_mb, kv_cache_dtype ("f32", "bf16", "f16" or "fp8"), prefix_cache_mb,
    snapshot_interval, seed, pipeline_decode, quantize ("none", "fp8", "int8" or "q4"),
    tensor_parallel, fp8_activations ("e4m3" or "f16"), prompt_activations ("f16x2" or "f16")
    (as `recur serve`'s flags). Of mlx-lm's own options, lazy and trust_remote_code change nothing
    here; tokenizer_config, model_config, adapter_path and revision are refused when set."""
    opts = _recur.SessionOptions()
    opts.device = device
    for name, value in engine_options.items():
        if name in ("lazy", "trust_remote_code"):
            continue
        if name in ("tokenizer_config", "model_config", "adapter_path", "revision"):
            if value:
                raise ValueError(f"load: {name} is not supported by recur")
            continue
        if name not in _ENGINE_OPTIONS:
            raise TypeError(f"load: unknown engine option {name!r}")
        setattr(opts, name, value)
    session = _recur.Session(str(path), opts)
    model, tokenizer = Model(session, str(path)), TokenizerWrapper(session)
    if not return_config:
        return model, tokenizer
    with open(os.path.join(str(path), "config.json")) as f:
        return model, tokenizer, json.load(f)


def _token_list(ids) -> List[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"expected a list of token ids, got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):  # ints, numpy's integers
            raise TypeError(f"token ids must be ints, got {type(t).__name__}")
        out.append(operator.index(t))
    return out


def _prompt_ids(tokenizer: Optional[TokenizerWrapper], prompt) -> List[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("a text prompt needs the tokenizer")
        return tokenizer.encode(prompt)
    return _token_list(prompt)


def _peak_memory_gb(model: Model) -> float:
    return model._session.stats()["peak_bytes"] / 1e9


def _logprobs_vector(raw):
    """An event's log-probabilities (a bytearray of float32 over the vocabulary) as the array
    mlx-lm users index with a token id: numpy's float32 array, or a memoryview without numpy."""
    if raw is None:
        return None
    if _np is not None:
        return _np.frombuffer(raw, dtype=_np.float32)
    return memoryview(raw).cast("f")


# mlx-lm options that would change what is generated: refused, never silently ignored. Those
# that only tune its own machinery (prefill_step_size, kv_group_size, ...) are accepted.
_UNSUPPORTED_OPTIONS = ("draft_model", "logits_processors", "prompt_cache", "max_kv_size",
                        "kv_bits", "input_embeddings")


def _refuse_unsupported(where: str, options: Dict[str, Any]):
    for name in _UNSUPPORTED_OPTIONS:
        if not _unset(options.get(name)):
            raise ValueError(f"{where}: {name} is not supported by recur")


def _unset(value) -> bool:
    """None or an empty list: how mlx-lm's callers leave an option out."""
    return value is None or (isinstance(value, (list, tuple)) and len(value) == 0)


@dataclass
class GenerationResponse:
    text: str
    token: Optional[int]
    # log_softmax of the step's logits over the vocabulary (numpy float32 array, or a memoryview
    # without numpy), as mlx-lm's; index it with a token id. None with return_logprobs=False.
    logprobs: Any
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB, the engine's allocator
    finish_reason: Optional[str] = None  # "stop", "length" on the last response
    from_draft: bool = False  # recur has no draft model


def stream_generate(model: Model, tokenizer: Optional[TokenizerWrapper], prompt,
                    max_tokens: int = 256, sampler: Optional[Sampler] = None, **kwargs):
    """Yields a GenerationResponse per generated token; the last carries finish_reason.
    Beyond mlx-lm's: stop_tokens (ids ending generation besides the EOS ids) and
    return_logprobs (False: responses carry logprobs=None, and the engine is spared the
    vocabulary's log-probabilities per token)."""
    _refuse_unsupported("stream_generate", kwargs)
    ids = _prompt_ids(tokenizer, prompt)
    start = time.perf_counter()
    progress = kwargs.get("prompt_progress_callback") or (lambda *_: None)
    progress(0, len(ids))
    stops = set(model.eos_token_ids) | set(kwargs.get("stop_tokens", ()))
    uid = model._submit(ids, max_tokens, sampler, kwargs.get("stop_tokens", ()),
                        logprobs=kwargs.get("return_logprobs", True))
    q = model._queues[uid]
    done = False
    try:
        pending = None  # held back one token, so that the last can carry finish_reason
        n = 0
        prompt_tps = 0.0
        first = start
        while True:
            while not q:
                if not model._step() and not q:
                    raise RuntimeError("the engine went idle without finishing the request")
            ev = q.popleft()
            _, finish, token, _, text, reason, message = ev[:7]
            text = text.decode("utf-8", errors="replace")
            now = time.perf_counter()
            if not finish:
                if pending is not None:
                    yield pending
                n += 1
                if n == 1:
                    first = now
                    prompt_tps = len(ids) / max(now - start, 1e-9)
                    progress(len(ids), len(ids))
                gen_tps = (n - 1) / (now - first) if n > 1 else 0.0
                pending = GenerationResponse(text, token, _logprobs_vector(ev[9]), len(ids),
                                             prompt_tps, n, gen_tps, _peak_memory_gb(model))
                continue
            done = True
            model._queues.pop(uid, None)
            if reason == "error":
                raise RuntimeError(message)
            if pending is None:
                pending = GenerationResponse(text, None, None, len(ids), prompt_tps, 0, 0.0,
                                             _peak_memory_gb(model))
            elif reason == "stop" and pending.token in stops:
                pending.text = text  # the end-of-sequence token's markup is not text (as mlx-lm)
            else:
                pending.text += text
            pending.finish_reason = reason
            yield pending
            return
    finally:
        if not done:  # the caller stopped iterating: free the engine's slot
            model._cancel(uid)


def generate(model: Model, tokenizer: Optional[TokenizerWrapper], prompt,
             verbose: bool = False, **kwargs) -> str:
    """The whole completion's text; kwargs (max_tokens, sampler, ...) go to stream_generate.
    verbose prints the text as it comes and the figures, as mlx-lm's does."""
    kwargs.setdefault("return_logprobs", False)  # only the text is returned
    if verbose:
        print("=" * 10)
    text = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text.append(last.text)
    if verbose:
        print()
        print("=" * 10)
        if not "".join(text):
            print("No text generated for this prompt")
        if last is not None:
            print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
            print(f"Generation: {last.generation_tokens} tokens, "
                  f"{last.generation_tps:.3f} tokens-per-sec")
            print(f"Peak memory: {last.peak_memory:.3f} GB")
    return "".join(text)


@dataclass
class Response:
    uid: int
    token: Optional[int]
    logprobs: Any  # as GenerationResponse.logprobs (None on a finish without a token)
    finish_reason: Optional[str]


@dataclass
class BatchStats:
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    live_buffers: int = 0
    live_bytes: int = 0
    allocs_total: int = 0


class BatchGenerator:
    """Continuous batching: insert prompts at any time, take each step's tokens with next().
    It never stops at EOS by itself (as mlx-lm's): pass what to stop at as stop_tokens, token
    ids or sequences of them (mlx-lm has had both: [eos, ...] and [[eos], ...]).
    prefill_step_size is the engine's at load (max_batch_tokens); it is kept for mlx-lm's
    signature, as are completion_batch_size and prefill_batch_size (load's max_batch).
    return_logprobs=False: responses carry logprobs=None, and the engine is spared the
    vocabulary's log-probabilities per token."""

    Response = Response

    def __init__(self, model: Model, max_tokens: int = 128,
                 stop_tokens: Optional[Iterable[Any]] = None, sampler: Optional[Sampler] = None,
                 prefill_step_size: int = 2048, return_logprobs: bool = True, **kwargs):
        _refuse_unsupported("BatchGenerator", kwargs)
        self.model = model
        self.max_tokens = max_tokens
        self.stop_tokens, self.stop_sequences = _split_stops(stop_tokens)
        self.sampler = sampler
        self.prefill_step_size = prefill_step_size
        self.return_logprobs = return_logprobs
        self._uids: List[int] = []
        self._closed = False

    def insert(self, prompts, max_tokens: Union[int, Sequence[int], None] = None,
               caches=None, samplers: Optional[Sequence[Optional[Sampler]]] = None,
               **kwargs) -> List[int]:
        """Queues prompts (lists of token ids); their uids, in order. max_tokens and samplers:
        one for all or one per prompt (None: the generator's)."""
        if self._closed:
            raise RuntimeError("BatchGenerator is closed")
        if caches is not None:
            raise ValueError("insert: prompt caches are not supported by recur")
        for name, value in kwargs.items():  # mlx-lm's all_tokens, stop_matchers, ...
            if not _unset(value):
                raise ValueError(f"insert: {name} is not supported by recur")
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise TypeError("insert takes a list of prompts, each a list of token ids")
        prompts = [_token_list(p) for p in prompts]
        if max_tokens is None or isinstance(max_tokens, int):
            max_tokens = [self.max_tokens if max_tokens is None else max_tokens] * len(prompts)
        samplers = [None] * len(prompts) if samplers is None else list(samplers)
        if len(max_tokens) != len(prompts) or len(samplers) != len(prompts):
            raise ValueError("insert: one max_tokens and one sampler per prompt")
        uids = []
        try:
            for p, m, smp in zip(prompts, max_tokens, samplers):
                uids.append(self.model._submit(p, m, smp or self.sampler, self.stop_tokens,
                                               ignore_eos=True,
                                               stop_sequences=self.stop_sequences,
                                               logprobs=self.return_logprobs))
        except Exception:
            for u in uids:  # all or none
                self.model._cancel(u)
            raise
        self._uids.extend(uids)
        return uids

    def remove(self, uids: Iterable[int], return_prompt_caches: bool = False):
        if return_prompt_caches:
            raise ValueError("remove: prompt caches are not supported by recur")
        for u in uids:
            if u in self._uids:
                self._uids.remove(u)
                self.model._cancel(u)

    def _collect(self) -> List[Response]:
        out: List[Response] = []
        last: Dict[int, Response] = {}
        for uid in list(self._uids):
            q = self.model._queues.get(uid)
            while q:
                ev = q.popleft()
                _, finish, token, _, _text, reason, message = ev[:7]
                if not finish:
                    r = Response(uid, token, _logprobs_vector(ev[9]), None)
                    out.append(r)
                    last[uid] = r
                    continue
                self._uids.remove(uid)
                self.model._queues.pop(uid, None)
                if reason == "error":
                    raise RuntimeError(message)
                if uid in last:
                    last[uid].finish_reason = reason
                else:
                    out.append(Response(uid, None, None, reason))
        return out

    def next(self) -> List[Response]:
        """One engine step's responses (none while the prompts are being prefilled)."""
        if self._closed:
            raise RuntimeError("BatchGenerator is closed")
        if not self._uids:
            return []
        busy = self.model._step()
        out = self._collect()
        if not busy and not out and self._uids:
            raise RuntimeError("the engine went idle without finishing requests "
                               f"{sorted(self._uids)}")
        return out

    def next_generated(self) -> List[Response]:
        """Steps until tokens come; an empty list once nothing is left in flight."""
        while self._uids:
            out = self.next()
            if out:
                return out
        return []

    def stats(self) -> BatchStats:
        s = self.model.stats()
        st = BatchStats(prompt_tokens=s["prompt_tokens"], prompt_time=s["prefill_seconds"],
                        generation_tokens=s["generated_tokens"],
                        generation_time=s["decode_seconds"], peak_memory=s["peak_bytes"] / 1e9,
                        live_buffers=s["live_buffers"], live_bytes=s["live_bytes"],
                        allocs_total=s["allocs_total"])
        st.prompt_tps = st.prompt_tokens / st.prompt_time if st.prompt_time else 0.0
        st.generation_tps = (st.generation_tokens / st.generation_time
                             if st.generation_time else 0.0)
        return st

    def close(self):
        self.remove(list(self._uids))
        while self.model._step():  # let the engine release the cancelled requests
            pass
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _split_stops(stop_tokens) -> (List[int], List[List[int]]):
    """stop_tokens as mlx-lm has taken them, ids or sequences of ids: (ids, longer sequences)."""
    ids, sequences = set(), []
    for s in stop_tokens or ():
        if isinstance(s, int) and not isinstance(s, bool):
            ids.add(s)
            continue
        seq = _token_list(s)
        if not seq:
            raise ValueError("a stop sequence is empty")
        if len(seq) == 1:
            ids.add(seq[0])
        else:
            sequences.append(seq)
    return sorted(ids), sequences


@dataclass
class BatchResponse:
    texts: List[str]
    stats: BatchStats
    caches: Optional[List[Any]] = None  # recur keeps no prompt caches for the caller
    token_ids: Optional[List[List[int]]] = None  # with return_token_ids=True
    logprobs: Optional[List[List[float]]] = None  # chosen tokens', with return_logprobs=True


def batch_generate(model: Model, tokenizer: Optional[TokenizerWrapper], prompts,
                   prompt_caches=None, max_tokens: Union[int, Sequence[int]] = 128,
                   verbose: bool = False, return_prompt_caches: bool = False,
                   return_token_ids: bool = False, return_logprobs: bool = False,
                   **kwargs) -> BatchResponse:
    """All prompts at once through a BatchGenerator that stops at the tokenizer's EOS ids;
    kwargs (sampler, ...) go to the BatchGenerator."""
    if prompt_caches is not None or return_prompt_caches:
        raise ValueError("batch_generate: prompt caches are not supported by recur (the "
                         "engine's prefix cache is load's prefix_cache_mb)")
    ids = [_prompt_ids(tokenizer, p) for p in prompts]
    stop = model.eos_token_ids
    gen = BatchGenerator(model, stop_tokens=stop, return_logprobs=return_logprobs, **kwargs)
    tokens: Dict[int, List[int]] = {}
    logprobs: Dict[int, List[float]] = {}
    try:
        uids = gen.insert(ids, max_tokens)
        for u in uids:
            tokens[u], logprobs[u] = [], []
        finished = 0
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                if r.finish_reason is not None:
                    finished += 1
                    if verbose:
                        print(f"[batch_generate] Finished processing {finished}/{len(uids)} ...",
                              end="\r")
                # A stop token ends the completion and is not part of its text (as generate).
                if r.token is not None and not (r.finish_reason == "stop" and r.token in stop):
                    tokens[r.uid].append(r.token)
                    if return_logprobs:
                        logprobs[r.uid].append(float(r.logprobs[r.token]))
        toks = [tokens[u] for u in uids]
        # A model directory without a tokenizer has token ids only (return_token_ids).
        decodes = tokenizer is not None and model._session.has_tokenizer
        texts = [tokenizer.decode(t) for t in toks] if decodes else []
        stats = gen.stats()
        if verbose:
            print(f"[batch_generate] Finished processing {finished}/{len(uids)}")
            print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, "
                  f"{stats.prompt_tps:.3f} tokens-per-sec")
            print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
                  f"{stats.generation_tps:.3f} tokens-per-sec")
            print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
        return BatchResponse(texts, stats, None, toks if return_token_ids else None,
                             [logprobs[u] for u in uids] if return_logprobs else None)
    finally:
        gen.close()
