"""The engine behind mlx-lm's generation calls. A Model owns one engine; every request on it
(stream_generate's, a BatchGenerator's) is one engine request, and each engine step's events are
handed to the queue of the request they belong to, so generators sharing a model do not mix."""

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

try:  # from the build folder (build/python on PYTHONPATH), which is never stale
    import _recur
except ImportError:  # installed: the copy inside the package (`make python`)
    from . import _recur
from .sample_utils import GREEDY, Sampler

_ENGINE_OPTIONS = ("threads", "max_batch", "max_batch_tokens", "max_context", "kv_cache_mb",
                   "prefix_cache_mb", "snapshot_interval", "seed", "pipeline_decode",
                   "kv_cache_dtype")


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
                stop_tokens: Iterable[int] = (), ignore_eos: bool = False) -> int:
        if sampler is None:
            sampler = GREEDY  # mlx-lm's default sampler is argmax
        if not isinstance(sampler, Sampler):
            raise TypeError("sampler must come from recur.sample_utils.make_sampler")
        uid = self._session.submit(ids, int(max_tokens), stop_tokens=list(stop_tokens),
                                   ignore_eos=ignore_eos, **sampler.engine_args())
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

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs):
        """The model's chat template; kwargs (enable_thinking, ...) reach it as variables."""
        request: Dict[str, Any] = {"messages": messages,
                                   "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            request["tools"] = tools
        if kwargs:
            request["chat_template_kwargs"] = kwargs
        return self._session.render_chat(json.dumps(request), tokenize)


def load(path: str, device: str = "cpu", **engine_options):
    """(model, tokenizer) for a Hugging Face model directory. engine_options: threads,
    max_batch, max_batch_tokens, max_context, kv_cache_mb, prefix_cache_mb, snapshot_interval,
    seed, pipeline_decode, kv_cache_dtype ("f32", "bf16" or "fp8") (as `recur serve`'s flags)."""
    opts = _recur.SessionOptions()
    opts.device = device
    for name, value in engine_options.items():
        if name not in _ENGINE_OPTIONS:
            raise TypeError(f"load: unknown engine option {name!r}")
        setattr(opts, name, value)
    session = _recur.Session(str(path), opts)
    return Model(session, str(path)), TokenizerWrapper(session)


def _token_list(ids) -> List[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"expected a list of token ids, got {type(ids).__name__}")
    out = list(ids)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {type(t).__name__}")
    return out


def _prompt_ids(tokenizer: Optional[TokenizerWrapper], prompt) -> List[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("a text prompt needs the tokenizer")
        return tokenizer.encode(prompt)
    return _token_list(prompt)


def _peak_memory_gb(model: Model) -> float:
    return model._session.stats()["peak_bytes"] / 1e9


@dataclass
class GenerationResponse:
    text: str
    token: Optional[int]
    logprobs: Optional[float]  # the chosen token's log-probability (mlx-lm: the whole vector)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB, the engine's allocator
    finish_reason: Optional[str] = None  # "stop", "length" on the last response


def stream_generate(model: Model, tokenizer: Optional[TokenizerWrapper], prompt,
                    max_tokens: int = 256, sampler: Optional[Sampler] = None, **kwargs):
    """Yields a GenerationResponse per generated token; the last carries finish_reason."""
    ids = _prompt_ids(tokenizer, prompt)
    start = time.perf_counter()
    stops = set(model.eos_token_ids) | set(kwargs.get("stop_tokens", ()))
    uid = model._submit(ids, max_tokens, sampler, kwargs.get("stop_tokens", ()))
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
            _, finish, token, logprob, text, reason, message = ev[:7]
            text = text.decode("utf-8", errors="replace")
            now = time.perf_counter()
            if not finish:
                if pending is not None:
                    yield pending
                n += 1
                if n == 1:
                    first = now
                    prompt_tps = len(ids) / max(now - start, 1e-9)
                gen_tps = (n - 1) / (now - first) if n > 1 else 0.0
                pending = GenerationResponse(text, token, logprob, len(ids), prompt_tps, n,
                                             gen_tps, _peak_memory_gb(model))
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
             max_tokens: int = 256, sampler: Optional[Sampler] = None, verbose: bool = False,
             **kwargs) -> str:
    """The whole completion's text."""
    text = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens, sampler, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text.append(last.text)
    if verbose and last is not None:
        print()
        print(f"prompt: {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tokens/s")
        print(f"generation: {last.generation_tokens} tokens at "
              f"{last.generation_tps:.1f} tokens/s")
        print(f"peak memory: {last.peak_memory:.3f} GB")
    return "".join(text)


@dataclass
class Response:
    uid: int
    token: Optional[int]
    logprobs: Optional[float]
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
    It never stops at EOS by itself (as mlx-lm's): pass the ids to stop at as stop_tokens.
    prefill_step_size is the engine's at load (max_batch_tokens); it is kept for mlx-lm's
    signature."""

    def __init__(self, model: Model, max_tokens: int = 128,
                 stop_tokens: Optional[Iterable[int]] = None, sampler: Optional[Sampler] = None,
                 prefill_step_size: int = 2048, **kwargs):
        self.model = model
        self.max_tokens = max_tokens
        self.stop_tokens = sorted(set(stop_tokens or ()))
        self.sampler = sampler
        self.prefill_step_size = prefill_step_size
        self._uids: List[int] = []
        self._closed = False

    def insert(self, prompts, max_tokens: Union[int, Sequence[int], None] = None) -> List[int]:
        if self._closed:
            raise RuntimeError("BatchGenerator is closed")
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise TypeError("insert takes a list of prompts, each a list of token ids")
        prompts = [_token_list(p) for p in prompts]
        if max_tokens is None or isinstance(max_tokens, int):
            max_tokens = [self.max_tokens if max_tokens is None else max_tokens] * len(prompts)
        if len(max_tokens) != len(prompts):
            raise ValueError("insert: one max_tokens per prompt")
        uids = []
        try:
            for p, m in zip(prompts, max_tokens):
                uids.append(self.model._submit(p, m, self.sampler, self.stop_tokens,
                                               ignore_eos=True))
        except Exception:
            for u in uids:  # all or none
                self.model._cancel(u)
            raise
        self._uids.extend(uids)
        return uids

    def remove(self, uids: Iterable[int]):
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
                _, finish, token, logprob, _text, reason, message = q.popleft()[:7]
                if not finish:
                    r = Response(uid, token, logprob, None)
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


@dataclass
class BatchResponse:
    texts: List[str]
    stats: BatchStats
    tokens: List[List[int]] = field(default_factory=list)


def batch_generate(model: Model, tokenizer: Optional[TokenizerWrapper], prompts,
                   max_tokens: Union[int, Sequence[int]] = 128, sampler: Optional[Sampler] = None,
                   verbose: bool = False, **kwargs) -> BatchResponse:
    """All prompts at once through a BatchGenerator that stops at the tokenizer's EOS ids."""
    ids = [_prompt_ids(tokenizer, p) for p in prompts]
    stop = model.eos_token_ids
    gen = BatchGenerator(model, stop_tokens=stop, sampler=sampler)
    tokens: Dict[int, List[int]] = {}
    try:
        uids = gen.insert(ids, max_tokens)
        for u in uids:
            tokens[u] = []
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                # A stop token ends the completion and is not part of its text (as generate).
                if r.token is not None and not (r.finish_reason == "stop" and r.token in stop):
                    tokens[r.uid].append(r.token)
        toks = [tokens[u] for u in uids]
        texts = [tokenizer.decode(t) for t in toks] if tokenizer is not None else []
        if verbose:
            for i, t in enumerate(texts):
                print(f"[{i}] {t}")
        return BatchResponse(texts, gen.stats(), toks)
    finally:
        gen.close()
