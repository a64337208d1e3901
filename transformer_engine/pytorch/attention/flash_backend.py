"""flash-attn-4 integration point: is the package importable here?"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional


@functools.lru_cache(maxsize=1)
def _import_error() -> Optional[str]:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn-4 is not installed (pip install .[flash])"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as err:  # any import failure means the backend cannot run
        return f"flash_attn.cute failed to import: {type(err).__name__}: {err}"
    return None


def unavailable_reason() -> Optional[str]:
    """None when flash-attn-4 can be used, else why not."""
    return _import_error()
