"""recur from Python, with mlx-lm's calls: load, generate, stream_generate, batch_generate,
BatchGenerator and sample_utils.make_sampler. The engine runs in the caller's thread, one engine
step per call into it, with the GIL released while it computes."""

from . import sample_utils
from .generate import (BatchGenerator, BatchResponse, BatchStats, GenerationResponse, Model,
                       Response, TokenizerWrapper, batch_generate, generate, load,
                       stream_generate)

__all__ = ["load", "generate", "stream_generate", "batch_generate", "BatchGenerator",
           "BatchResponse", "BatchStats", "GenerationResponse", "Response", "Model",
           "TokenizerWrapper", "sample_utils"]
