import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "models")


@pytest.fixture(scope="session")
def realvocab():
    import recur
    # Small pools: the tiny models need little, and every test session loads a few.
    return recur.load(os.path.join(MODELS, "qwen3next-tiny-realvocab"), kv_cache_mb=32, seed=7)


@pytest.fixture(scope="session")
def tiny():
    import recur
    return recur.load(os.path.join(MODELS, "qwen3next-tiny"), kv_cache_mb=32)


def read_golden(model):
    """tests/data/golden/<model>/golden.safetensors as numpy arrays (transformers' reference:
    p<i>.ids, p<i>.gen, and p<i>.gen_logits [steps, vocab], the logits that chose gen)."""
    import json
    import struct

    import numpy as np
    dtypes = {"F32": np.float32, "I64": np.int64}
    with open(os.path.join(ROOT, "tests", "data", "golden", model, "golden.safetensors"),
              "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=dtypes[t["dtype"]]).reshape(t["shape"])
    return out
