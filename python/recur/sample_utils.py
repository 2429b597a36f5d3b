"""Samplers shaped like mlx-lm's ``make_sampler``.

recur samples inside the engine, so a sampler here is a description of the sampling (read by the
engine for every token), not a Python function called on logits.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Sampler:
    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    seed: Optional[int] = None

    def engine_args(self):
        """The engine's sampling fields; mlx-lm's "off" values (0) become the engine's."""
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        args = {"temperature": float(self.temp)}
        if 0.0 < self.top_p < 1.0:
            args["top_p"] = float(self.top_p)
        if self.min_p > 0.0:
            args["min_p"] = float(self.min_p)
        if self.top_k > 0:
            args["top_k"] = int(self.top_k)
        if self.seed is not None:
            args["seed"] = int(self.seed)
        return args


def make_sampler(temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, top_k: int = 0, xtc_probability: float = 0.0,
                 xtc_threshold: float = 0.0, xtc_special_tokens=(), seed: Optional[int] = None,
                 **unsupported):
    """temp 0 is greedy; top_p 0 or 1, min_p 0 and top_k 0 are off (as in mlx-lm). XTC is
    refused when it would act (xtc_probability > 0), as is a min_p that must keep more than
    one token, rather than silently sampling otherwise than asked."""
    if xtc_probability > 0:
        raise ValueError("make_sampler: XTC sampling is not supported by recur")
    if min_p > 0 and min_tokens_to_keep > 1:
        raise ValueError("make_sampler: min_tokens_to_keep > 1 is not supported by recur")
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"make_sampler: {name} is not supported by recur")
    return Sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed)


GREEDY = Sampler()
