"""The installed Triton has every API the package uses (kernels/triton_compat.py lists them): a release that
drops or renames one fails a test named after it here, not a kernel compile or a launch deep inside a
frontend. Where the Gluon kernels cannot be built, the plan keeps the Triton kernels and says why."""

import inspect
import logging
import os
import re

import pytest

pytest.importorskip("triton")

from transformer_engine.common import log  # noqa: E402
from transformer_engine.common.attention import AttnConfig, AttnMaskType  # noqa: E402
from transformer_engine.common.attention.kernels import triton_compat  # noqa: E402
from transformer_engine.common.attention.plan import backward_plan, forward_plan  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_installed_triton_is_a_supported_release():
    assert triton_compat.triton_version() in triton_compat.SUPPORTED_RELEASES, (
        f"triton {triton_compat.triton_version()} is not one of {triton_compat.SUPPORTED_RELEASES}: check "
        "kernels/triton_compat.py against it (tests/common/test_kernel_compile*.py) and add it")


@pytest.mark.parametrize("path", sorted(triton_compat.PRIVATE_APIS))
def test_private_triton_api_exists(path):
    triton_compat.resolve(path)  # raises ImportError / AttributeError naming what is gone


@pytest.mark.parametrize("name", sorted(triton_compat._ALTERNATIVES))
def test_release_dependent_api_resolves_to_a_working_spelling(name):
    """Each name that differs between releases resolves; the public (newest) spelling wins where it exists."""
    found = triton_compat._first(name)
    assert found is not None, f"{name}: none of {triton_compat._ALTERNATIVES[name]}"
    newest = triton_compat._ALTERNATIVES[name][0]
    try:
        public = triton_compat.resolve(newest)
    except (ImportError, AttributeError):
        public = None
    if public is not None:
        assert found is public, f"{name}: {newest} exists, but an older spelling was chosen"


def test_removed_gluon_builtins_are_not_taken_for_working_ones():
    """Triton keeps a removed Gluon builtin as a stub that raises at compile time (3.9: the old TMA and
    cp.async load names); such a stub must not count as the API."""
    from triton.language.core import builtin

    @builtin
    def async_copy_global_to_shared(*args, _semantic=None, **kwargs):
        raise RuntimeError("async_copy_global_to_shared has been removed; call async_load instead")

    @builtin
    def async_load(tensor_desc, coord, barrier, result, pred=True, _semantic=None):
        pass

    assert triton_compat._removed_stub(async_copy_global_to_shared)
    assert not triton_compat._removed_stub(async_load)
    assert not triton_compat._removed_stub(triton_compat.tma_async_load)
    assert not triton_compat._removed_stub(triton_compat.cp_async_load)


def test_gluon_kernels_build_with_the_installed_triton():
    triton_compat.gluon_unavailable_reason.cache_clear()
    assert triton_compat.gluon_unavailable_reason() is None


def test_aot_compile_sets_every_option_jit_run_takes_from_knobs():
    """kernels/aot.py compiles as JITFunction.run does; run sets options from Triton's knobs before binding
    (debug, instrumentation_mode; 3.9 adds fpsan_homomorphic_casts). Each one run sets is set here too, so
    an ahead-of-time cubin (the JAX CUDA lowering's) keeps the JIT's options and hash."""
    from triton.runtime.jit import JITFunction

    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel

    source = inspect.getsource(JITFunction.run)
    set_by_run = set(re.findall(r"kwargs\[\"(\w+)\"\]\s*=", source))
    assert "debug" in set_by_run
    assert set_by_run <= set(triton_compat.jit_run_options(attn_fwd_kernel, {"num_warps": 4}))


def test_no_triton_release_checks_outside_triton_compat():
    """Release differences live in kernels/triton_compat.py alone: no Triton version checks and no
    release-dependent spellings elsewhere in the package."""
    pattern = re.compile(r"triton\.__version__|async_copy_global_to_shared|\.async_load\b|language\.core\._aggregate|"
                         r"gluon\._runtime")
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "transformer_engine")):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path.endswith(os.path.join("kernels", "triton_compat.py")):
                continue
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if pattern.search(line):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


HOPPER = AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=16, head_dim_qk=128, head_dim_v=128,
                    max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=AttnMaskType.CAUSAL_MASK,
                    deterministic=True, device_type="cuda", compute_capability=(9, 0))


@pytest.mark.parametrize("dims", [(128, 128), (256, 256), (192, 128)])
def test_plan_keeps_the_triton_kernels_where_gluon_cannot_be_built(monkeypatch, caplog, dims):
    """A Triton without the Gluon APIs the kernels need: the plan has no Gluon tiles (the Triton kernels
    run, the same as NVTE_FUSED_ATTN_WS=0), says why once at WARNING, and never fails."""
    from transformer_engine.common.attention.kernels.resources import contiguous_call, planned_launches

    cfg = HOPPER.replace(head_dim_qk=dims[0], head_dim_v=dims[1])
    assert forward_plan(cfg).warp_specialized is not None  # served by Gluon with the installed Triton

    real_first = triton_compat._first
    monkeypatch.setattr(triton_compat, "_first", lambda name: None if name == "tma_async_load" else real_first(name))
    triton_compat.gluon_unavailable_reason.cache_clear()
    log._warned_once.discard("plan:gluon_unavailable")
    try:
        with caplog.at_level(logging.WARNING, logger="transformer_engine"):
            fwd, bwd = forward_plan(cfg), backward_plan(cfg)
            forward_plan(cfg)
        assert fwd.warp_specialized is None
        assert (bwd.dq_warp_specialized, bwd.dkdv_warp_specialized, bwd.dv_warp_specialized) == (None,) * 3
        monkeypatch.setenv("NVTE_FUSED_ATTN_WS", "0")
        assert (fwd, bwd) == (forward_plan(cfg), backward_plan(cfg))
        names = {x.name for x in planned_launches(contiguous_call(cfg, seqlen=4096))}
        assert not any(name.endswith("_ws_kernel") for name in names), names
        warnings = [r.getMessage() for r in caplog.records if "Gluon" in r.getMessage()]
        assert len(warnings) == 1 and "tma" in warnings[0] and "lacks the Gluon APIs" in warnings[0], warnings
    finally:
        triton_compat.gluon_unavailable_reason.cache_clear()
        log._warned_once.discard("plan:gluon_unavailable")


_KEYS = """
import sys
from triton.runtime.jit import JITFunction
from transformer_engine.common.attention.kernels import masking, scores
first = [v for m in (masking, scores) for v in vars(m).values() if isinstance(v, JITFunction)]
{touch}
from transformer_engine.common.attention.kernels import backward, fill, forward, hopper_ws, rope
for m in (forward, backward, fill, hopper_ws, rope):
    for name, v in sorted(vars(m).items()):
        if isinstance(v, JITFunction) and v.__module__ == m.__name__:
            print(m.__name__, name, v.cache_key)
"""


def test_kernel_cache_keys_do_not_depend_on_what_a_process_computes_first():
    """Triton before 3.9 keys a kernel by its callees' constexpr globals only where their keys were computed
    first; the kernel modules settle every key callees first (triton_compat.settle_cache_keys), so a process
    that touches helpers first (in either order) keys every kernel as one that does not."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JIT functions
    outs = []
    for touch in ("", "[f.cache_key for f in first]", "[f.cache_key for f in reversed(first)]"):
        run = subprocess.run([sys.executable, "-c", _KEYS.format(touch=touch)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(run.stdout)
    assert len(outs[0].splitlines()) >= 6, outs[0]
    assert outs[1] == outs[0] and outs[2] == outs[0]
