"""The cached kernel launch (``pytorch/attention/launch_cache.py``).

On the CPU a stand-in kernel records what the launcher asks of Triton: one compile per key, a new key for
each thing Triton specializes on (a tensor's dtype and 16-byte alignment, a number's value and type, the
options), Triton's JIT call wherever the cache must not be used, and the least recently used key evicted
first. On a GPU the real kernels: a fused fwd+bwd through the cache is bitwise the same as through Triton's JIT
call, the repeat compiles nothing new, and a misaligned view gets a kernel of its own.
"""

from __future__ import annotations

import pytest
import torch

from dpa_helpers import ON_GPU, requires_fused
from fused_helpers import make_qkv

from transformer_engine.common import settings
from transformer_engine.pytorch.attention import launch_cache

STREAM = 1234


class _Compiled:
    """Stands in for Triton's CompiledKernel: records its launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log, self.loaded = log, False

    def _init_handles(self):
        self.loaded = True

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *values):
        assert self.loaded and (function, metadata) == ("function", "metadata")
        self.log.append(("compiled", (gx, gy, gz), stream, values, enter))

    def __getitem__(self, grid):
        return lambda *values, stream: self.log.append(("compiled with hooks", tuple(grid), stream, values, None))


class _Kernel:
    """Stands in for a Triton JIT function: counts compiles, records JIT calls."""

    def __init__(self):
        self.arg_names = ["X", "n", "flag", "BLOCK"]
        self.pre_run_hooks = []
        self.compiles, self.log = 0, []

    def run(self, grid, warmup, **kwargs):
        assert warmup and list(kwargs)[:4] == self.arg_names
        self.compiles += 1
        return _Compiled(self.log)

    def __getitem__(self, grid):
        return lambda **kwargs: self.log.append(("jit", tuple(grid), kwargs))


class _Incomplete:
    """A compiled form without the launcher attributes (another Triton version)."""


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch_cache, "_device_and_stream", lambda: (0, STREAM))
    monkeypatch.setattr(launch_cache, "triton_interpreting", lambda: False)
    monkeypatch.setattr(launch_cache, "_hooks", lambda: (None, None))
    launch_cache.clear()
    yield _Kernel()
    launch_cache.clear()


def _args(x, n=16, flag=True, block=64):
    return dict(X=x, n=n, flag=flag, BLOCK=block)


OPTIONS = dict(num_warps=4, num_stages=2)


def test_one_compile_per_key_and_launches_in_parameter_order(fake):
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):
        launch_cache.launch(fake, (2, 3, 1), _args(x), OPTIONS)
    assert fake.compiles == 1 and launch_cache.cached_kernels() == 1
    assert fake.log == [("compiled", (2, 3, 1), STREAM, (x, 16, True, 64), None)] * 3


@pytest.mark.parametrize("change", ["alignment", "dtype", "number", "type", "constexpr", "options"])
def test_each_specialization_gets_its_own_compile(fake, change):
    base = torch.zeros(64, dtype=torch.float16)
    launch_cache.launch(fake, (1, 1, 1), _args(base), OPTIONS)
    args, options = _args(base), OPTIONS
    if change == "alignment":
        args = _args(base[1:])  # 2 bytes past a 16-byte boundary
    elif change == "dtype":
        args = _args(torch.zeros(64, dtype=torch.float32))
    elif change == "number":
        args = _args(base, n=17)
    elif change == "type":
        args = _args(base, flag=1)  # equal to True as a key, but Triton types it i32, not i1
    elif change == "constexpr":
        args = _args(base, block=128)
    else:
        options = dict(OPTIONS, num_warps=8)
    launch_cache.launch(fake, (1, 1, 1), args, options)
    assert fake.compiles == 2 and launch_cache.cached_kernels() == 2
    # the same (aligned, float16) tensor at another address hits the first key
    launch_cache.launch(fake, (1, 1, 1), _args(torch.zeros(64, dtype=torch.float16)), OPTIONS)
    assert fake.compiles == 2


def test_least_recently_used_key_goes_first(fake, monkeypatch):
    monkeypatch.setattr(launch_cache, "_MAX_ENTRIES", 2)
    x = torch.zeros(64, dtype=torch.float16)
    for n in (1, 2, 1, 3):  # 1 is used again after 2, so 2 is the one evicted at 3
        launch_cache.launch(fake, (1, 1, 1), _args(x, n=n), OPTIONS)
    assert fake.compiles == 3 and launch_cache.cached_kernels() == 2
    launch_cache.launch(fake, (1, 1, 1), _args(x, n=1), OPTIONS)
    assert fake.compiles == 3
    launch_cache.launch(fake, (1, 1, 1), _args(x, n=2), OPTIONS)
    assert fake.compiles == 4


@pytest.mark.parametrize("reason", ["setting", "interpreter", "debug", "pre_run_hook"])
def test_jit_call_where_the_cache_must_not_be_used(fake, monkeypatch, reason):
    if reason == "setting":
        monkeypatch.setenv("NVTE_FUSED_ATTN_CACHED_LAUNCH", "0")
    elif reason == "interpreter":
        monkeypatch.setattr(launch_cache, "triton_interpreting", lambda: True)
    elif reason == "debug":
        from triton import knobs

        monkeypatch.setattr(knobs.runtime, "debug", True)
    else:
        fake.pre_run_hooks.append(lambda *a, **k: None)
    x = torch.zeros(64, dtype=torch.float16)
    launch_cache.launch(fake, (4, 1, 1), _args(x), OPTIONS)
    assert fake.compiles == 0 and launch_cache.cached_kernels() == 0
    assert fake.log == [("jit", (4, 1, 1), dict(_args(x), **OPTIONS))]


def test_a_compiled_form_without_a_launcher_falls_back_to_the_jit_call(fake, monkeypatch):
    compiles = []

    def run(grid, warmup, **kwargs):
        compiles.append(grid)
        return _Incomplete()

    monkeypatch.setattr(fake, "run", run)
    x = torch.zeros(64, dtype=torch.float16)
    launch_cache.launch(fake, (1, 1, 1), _args(x), OPTIONS)
    launch_cache.launch(fake, (1, 1, 1), _args(x), OPTIONS)
    assert len(compiles) == 1 and launch_cache.cached_kernels() == 0  # asked once, then the JIT call only
    assert [entry[0] for entry in fake.log] == ["jit", "jit"]


def test_a_background_compile_takes_the_jit_call_until_ready(fake, monkeypatch):
    ready = []
    real_run = fake.run

    def run(grid, warmup, **kwargs):  # Triton's asynchronous mode: None until the compile is done
        return real_run(grid, warmup, **kwargs) if ready else None

    monkeypatch.setattr(fake, "run", run)
    x = torch.zeros(64, dtype=torch.float16)
    launch_cache.launch(fake, (1, 1, 1), _args(x), OPTIONS)
    assert launch_cache.cached_kernels() == 0 and [entry[0] for entry in fake.log] == ["jit"]
    ready.append(True)
    launch_cache.launch(fake, (1, 1, 1), _args(x), OPTIONS)
    assert launch_cache.cached_kernels() == 1 and [entry[0] for entry in fake.log] == ["jit", "compiled"]


def test_launch_hooks_see_the_launch(fake, monkeypatch):
    monkeypatch.setattr(launch_cache, "_hooks", lambda: ("enter", "exit"))
    x = torch.zeros(64, dtype=torch.float16)
    launch_cache.launch(fake, (2, 1, 1), _args(x), OPTIONS)
    assert fake.log == [("compiled with hooks", (2, 1, 1), STREAM, (x, 16, True, 64), None)]


def test_hooks_reads_tritons_chains():
    from triton import knobs

    enter = knobs.runtime.launch_enter_hook
    if enter is None or not hasattr(enter, "add"):
        pytest.skip(f"this Triton's launch hook is {type(enter).__name__}, not a chain")
    assert launch_cache._hooks() == (None, None) or enter.calls
    probe = lambda *a: None  # noqa: E731
    enter.add(probe)
    try:
        assert launch_cache._hooks()[0] is enter
    finally:
        enter.remove(probe)


def test_the_setting_is_declared():
    assert settings.get("NVTE_FUSED_ATTN_CACHED_LAUNCH") is True


def _fwd_bwd(q, k, v, d_out):
    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    out = fused_attn_func(q, k, v, "bshd", "causal", (-1, 0), q.shape[-1] ** -0.5, deterministic=True)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), d_out))


@requires_fused
@pytest.mark.skipif(not ON_GPU, reason="the compiled launchers need a GPU (the interpreter takes the JIT call)")
@pytest.mark.parametrize("d", [64, 128])
def test_cached_launch_is_bitwise_the_jit_call(monkeypatch, d):
    launch_cache.clear()
    q, k, v, _ = make_qkv(2, 384, 384, 4, 2, d, d, torch.bfloat16)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
    cached = _fwd_bwd(q, k, v, d_out)
    kernels = launch_cache.cached_kernels()
    assert kernels >= 3  # the forward, and at least preprocess and the dK/dV and dQ passes
    again = _fwd_bwd(q, k, v, d_out)
    assert launch_cache.cached_kernels() == kernels  # the repeat hits every key
    monkeypatch.setenv("NVTE_FUSED_ATTN_CACHED_LAUNCH", "0")
    jit = _fwd_bwd(q, k, v, d_out)
    assert launch_cache.cached_kernels() == kernels
    for a, b, c in zip(cached, again, jit):
        assert torch.equal(a, b) and torch.equal(a, c)

    # a view 2 bytes past a 16-byte boundary: Triton specializes on alignment, so the cache must too
    monkeypatch.delenv("NVTE_FUSED_ATTN_CACHED_LAUNCH")
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    q_off = flat[1:].view(q.shape).copy_(q.detach()).requires_grad_()
    shifted = _fwd_bwd(q_off, k, v, d_out)
    assert launch_cache.cached_kernels() > kernels
    monkeypatch.setenv("NVTE_FUSED_ATTN_CACHED_LAUNCH", "0")
    shifted_jit = _fwd_bwd(q_off, k, v, d_out)
    for a, b in zip(shifted, shifted_jit):
        assert torch.equal(a, b)


@requires_fused
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cached_launch_replays_in_a_cuda_graph():
    """Captured launches keep the addresses of the capture's tensors: a replay on new inputs copied into them
    gives what an eager call on those inputs gives."""
    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    def forward(q, k, v):
        return fused_attn_func(q, k, v, "bshd", "causal", (-1, 0), q.shape[-1] ** -0.5, deterministic=True)

    q, k, v, _ = make_qkv(2, 256, 256, 4, 4, 128, 128, torch.bfloat16)
    q, k, v = (t.detach() for t in (q, k, v))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        forward(q, k, v)  # compiles and fills the cache outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured = forward(q, k, v)
    q2, k2, v2, _ = make_qkv(2, 256, 256, 4, 4, 128, 128, torch.bfloat16, seed=5)
    for dst, src in zip((q, k, v), (q2, k2, v2)):
        dst.copy_(src.detach())
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert torch.equal(captured, forward(q, k, v))
