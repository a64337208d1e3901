"""Records every Triton compile of this process (a cache hit or a compile), for dev/device/kernel_cache.py.

Put this folder first on PYTHONPATH and set TE_KERNEL_RECORD to a folder: each process appends one JSON line
per ``triton.compile`` to ``<folder>/<pid>.jsonl`` through Triton's compilation listener. A line holds what
``triton.compile`` needs to build the same kernel again without a GPU (the kernel's module and name, the
specialised signature, constexprs, attributes, options, cache-invalidating environment, target) and what it
cost here (start time, microseconds, cache hit or not). With TE_KERNEL_RECORD unset this does nothing.
"""

import os

_FOLDER = os.environ.get("TE_KERNEL_RECORD")


def _install(folder):
    import base64
    import json
    import pickle
    import threading
    import time

    from triton import knobs

    lock = threading.Lock()
    path = os.path.join(folder, f"{os.getpid()}.jsonl")

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        try:
            now = time.time()
            us = int(times.total)
            fn = getattr(src, "fn", None)
            line = {"hash": metadata.get("hash"), "hit": bool(cache_hit), "us": us, "start": now - us / 1e6,
                    "pid": os.getpid()}
            if fn is not None:
                from triton.compiler.compiler import get_cache_invalidating_env_vars

                target = metadata.get("target")
                if isinstance(target, dict):
                    target = (target["backend"], target["arch"], target["warp_size"])
                elif target is not None and not isinstance(target, (list, tuple)):
                    target = (target.backend, target.arch, target.warp_size)
                line.update(
                    module=fn.__module__, name=fn.__name__, gluon=bool(getattr(fn, "is_gluon", lambda: False)()),
                    signature=src.signature,
                    constants=base64.b64encode(pickle.dumps(dict(src.constants))).decode(),
                    attrs=[[list(k), v] for k, v in src.attrs.items()],
                    options=getattr(calls, "options", {}),
                    env=get_cache_invalidating_env_vars(), target=list(target) if target else None)
            text = json.dumps(line, default=repr)
            with lock, open(path, "a") as f:
                f.write(text + "\n")
        except Exception as e:  # recording must never break the run it watches
            with lock, open(path, "a") as f:
                f.write(json.dumps({"error": repr(e), "pid": os.getpid()}) + "\n")

    import triton
    import triton.compiler

    original = triton.compiler.compile
    calls = threading.local()

    def compile(src, target=None, options=None, _env_vars=None):
        # The options as the caller passed them (the listener sees the compiled kernel's metadata, in which
        # some fields, num_warps among them, are what the compiler made of them).
        calls.options = dict(options or {})
        return original(src, target=target, options=options, _env_vars=_env_vars)

    triton.compiler.compile = triton.compile = compile
    knobs.compilation.listener = listener


if _FOLDER:
    try:
        os.makedirs(_FOLDER, exist_ok=True)
        _install(_FOLDER)
    except ImportError:
        pass
