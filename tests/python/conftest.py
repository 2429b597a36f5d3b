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
