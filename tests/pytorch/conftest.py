import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_signature_caches():
    """Each test starts without the decisions of earlier tests' calls: tests patch the functions those
    decisions come from (selection, device facts, backends), which a cached decision would not call again."""
    from transformer_engine.pytorch.attention import signature_cache

    signature_cache.clear_all()
    yield
