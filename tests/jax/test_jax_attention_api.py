"""fused_attn's API around the numerics: argument errors, enums, SequenceDescriptor, backend
selection and forcing, the determinism switch (read at trace time), and jit/grad/vmap/remat."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax_testing import attn_fn, random_qkv, skip_unless_backend_runs
from transformer_engine.common.attention.backends import NoBackendError
from transformer_engine.jax import attention as te_attention
from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    QKVFormat,
    QKVLayout,
    SequenceDescriptor,
    fused_attn,
    is_deterministic_mode,
    is_fused_attn_kernel_available,
)

B, S, H, D = 2, 16, 4, 16


def _inputs(dtype=jnp.float32, h_kv=H):
    return random_qkv(jax.random.PRNGKey(0), B, S, S, H, h_kv, D, D, dtype)


def _skip_unless_runs(backend, h_kv=H, bias_shape=None, **overrides):
    """Skip where ``backend`` cannot run ``_kwargs(**overrides)`` on ``_inputs(h_kv=h_kv)`` (only
    the fused backend on a GPU skips, e.g. for dropout: the JAX launch passes none yet)."""
    kw = _kwargs(**overrides)
    skip_unless_backend_runs(
        backend, is_training=kw["is_training"], q_dtype=jnp.float32, kv_dtype=jnp.float32,
        qkv_layout=kw["qkv_layout"], attn_bias_type=kw["attn_bias_type"], attn_mask_type=kw["attn_mask_type"],
        dropout_probability=kw["dropout_probability"], q_num_heads=H, kv_num_heads=h_kv, q_max_seqlen=S,
        kv_max_seqlen=S, head_dim_qk=D, head_dim_v=D, window_size=kw.get("window_size"), bias_shape=bias_shape,
    )


def _kwargs(**overrides):
    kwargs = dict(
        bias=None, sequence_descriptor=None, seed=None, attn_bias_type=AttnBiasType.NO_BIAS,
        attn_mask_type=AttnMaskType.CAUSAL_MASK, qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=D**-0.5,
        dropout_probability=0.0, is_training=True,
    )
    kwargs.update(overrides)
    return kwargs


# ------------------------------------------------------------------------------------------------
# Errors name the argument
# ------------------------------------------------------------------------------------------------

q, k, v = _inputs()
_LENS = SequenceDescriptor.from_seqlens(jnp.array([16, 9]))


@pytest.mark.parametrize(
    "qkv, overrides, error, words",
    [
        ((q, k, v), dict(qkv_layout="bshd"), ValueError, "`qkv_layout` must be one of"),
        ((q, k, v), dict(attn_mask_type="diagonal"), ValueError, "`attn_mask_type` must be one of"),
        ((q, k), dict(), ValueError, "`qkv` must hold 3 array(s)"),
        ((q,), dict(qkv_layout=QKVLayout.BS3HD), ValueError, "`qkv[0]` must be [b, s, 3, h, d]"),
        ((q, k[..., :8], v), dict(), ValueError, "`q` and `k` must share head_dim"),
        ((q, k.astype(jnp.float16), v), dict(), ValueError, "must share one dtype"),
        ((q.astype(jnp.int32), k, v), dict(), ValueError, "`q` must be float16, bfloat16 or float32"),
        ((q, k[:, :, :3], v[:, :, :3]), dict(), ValueError, "multiple of `k` heads"),
        ((q, k, v), dict(attn_mask_type=AttnMaskType.PADDING_MASK), ValueError, "`sequence_descriptor` must be given"),
        ((q, k, v), dict(qkv_layout=QKVLayout.THD_THD_THD, sequence_descriptor=_LENS), ValueError,
         "`attn_mask_type` must be a padding mask"),
        ((q, k, v), dict(max_segments_per_seq=0), ValueError, "`max_segments_per_seq` must be a positive int"),
        ((q, k, v), dict(dropout_probability=1.0), ValueError, "`dropout_probability` must be in [0, 1)"),
        ((q, k, v), dict(dropout_probability=0.1), ValueError, "`seed` must be a PRNG key"),
        ((q, k, v), dict(bias=jnp.zeros((1, H, S, S))), ValueError, "`bias` must be None with attn_bias_type"),
        ((q, k, v), dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS), ValueError, "`bias` must be an array"),
        ((q, k, v), dict(attn_bias_type="post_scale_bias", bias=jnp.zeros((3, H, S, S))), ValueError,
         "`bias` must have shape [1|2, 1|4, 16, 16]"),
        ((q, k, v), dict(window_size=(4, 2)), ValueError, "`window_size` must have right in (-1, 0)"),
        ((q, k, v), dict(window_size=(4,)), ValueError, "`window_size` must be a pair"),
        ((q, k, v), dict(attn_mask_type=AttnMaskType.ARBITRARY_MASK), NotImplementedError, "`attn_mask_type`"),
        ((q, k, v), dict(attn_bias_type=AttnBiasType.ALIBI, bias=jnp.zeros((1, H, S, S))), NotImplementedError,
         "`attn_bias_type` must not be 'alibi'"),
        ((q, k, v), dict(attn_mask_type=AttnMaskType.PADDING_MASK,
                         sequence_descriptor=SequenceDescriptor.from_seqlens(jnp.array([16, 9, 3]))), ValueError,
         "`seqlens` (q) must be [2]"),
        ((q, k, v), dict(attn_mask_type=AttnMaskType.PADDING_MASK,
                         sequence_descriptor=SequenceDescriptor.from_segment_ids_and_pos(jnp.ones((2, 8), jnp.int32))),
         ValueError, "`segment_ids[0] (q)` must be an integer array of shape [2, 16]"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(qkv, overrides, error, words):
    with pytest.raises(error) as info:
        fused_attn(qkv, **_kwargs(**overrides))
    assert words in str(info.value)


def test_enums_use_transformer_engine_names_and_accept_strings():
    assert AttnMaskType.CAUSAL_MASK.value == "causal"
    assert AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK.value == "padding_causal_bottom_right"
    assert QKVLayout.THD_T2HD.qkv_format == QKVFormat.THD
    assert AttnBiasType.POST_SCALE_BIAS.value == "post_scale_bias"
    by_enum = fused_attn((q, k, v), **_kwargs())
    by_str = fused_attn((q, k, v), **_kwargs(attn_mask_type="causal", qkv_layout="bshd_bshd_bshd",
                                             attn_bias_type="no_bias"))
    np.testing.assert_array_equal(np.asarray(by_enum), np.asarray(by_str))


def test_fused_attn_passes_every_parameter_on():
    """fused_attn hands its arguments to the parsing as one _FusedAttnArgs, field for parameter, in
    its order and with its defaults; each parameter reaches the parsing (a bad value of each raises
    the error naming that parameter)."""
    import dataclasses
    import inspect

    params = inspect.signature(fused_attn).parameters
    fields = dataclasses.fields(te_attention._FusedAttnArgs)
    assert [f.name for f in fields] == list(params)
    for f in fields:
        default = params[f.name].default
        assert (f.default is dataclasses.MISSING) == (default is inspect.Parameter.empty), f.name
        if default is not inspect.Parameter.empty:
            assert f.default == default, f.name
    q, k, v = _inputs()
    bad = dict(bias=q[:, None, :, :, 0], attn_bias_type="alibi", attn_mask_type="bogus", qkv_layout="bogus",
               softmax_type=3, scaling_factor=float("nan"), dropout_probability=1.0, max_segments_per_seq=0,
               window_size="x", context_parallel_strategy="ring", context_parallel_causal_load_balanced="yes",
               context_parallel_axis=3, context_checkpoint_name="", softmax_offset=jnp.zeros((1, H, 1, 1)),
               stripe_size=0, score_mod=len, score_mod_bprop=len, score_mod_tensors={}, score_mod_bprop_tensors={},
               bottom_right_diagonal=1, return_max_logit="yes")
    bad["seed"] = dict(seed=None, dropout_probability=0.1)  # a missing seed counts only with dropout
    bad["sequence_descriptor"] = dict(sequence_descriptor=None, attn_mask_type=AttnMaskType.PADDING_MASK)
    assert set(bad) | {"qkv", "is_training"} == set(params)  # qkv: throughout; is_training: any value is one
    for name, value in bad.items():
        overrides = value if name in ("seed", "sequence_descriptor") else {name: value}
        with pytest.raises((ValueError, NotImplementedError), match=f"`{name}`"):
            fused_attn((q, k, v), **_kwargs(**overrides))


# ------------------------------------------------------------------------------------------------
# SequenceDescriptor
# ------------------------------------------------------------------------------------------------


def test_descriptor_forms_agree_on_segments():
    lens = jnp.array([[5, 3, 0], [7, 0, 0]], jnp.int32)
    offsets = jnp.array([[0, 6, 9, 9], [1, 8, 8, 8]], jnp.int32)  # gaps before, between, after
    ids = np.zeros((2, 12), np.int32)
    ids[0, 0:5], ids[0, 6:9], ids[1, 1:8] = 1, 2, 1
    from_offsets = SequenceDescriptor.from_seqlens_and_offsets(lens, offsets).to_seq_info(2, 12, 12, True, 3)
    from_ids = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids)).to_seq_info(2, 12, 12, True, 3)
    for a, b in zip(from_offsets, from_ids):
        np.testing.assert_array_equal(np.asarray(a)[:, :3], np.asarray(b)[:, :3])
    packed = SequenceDescriptor.from_seqlens(lens).to_seq_info(2, 12, 12, True, 3)
    np.testing.assert_array_equal(np.asarray(packed.q_offsets)[:, :3], [[0, 5, 8], [0, 7, 7]])


def test_segment_ids_runs_need_not_be_numbered_in_order():
    ids = jnp.array([[9, 9, 4, 4, 4, 0]], jnp.int32)
    info = SequenceDescriptor.from_segment_ids_and_pos(ids).to_seq_info(1, 6, 6, True, 2)
    np.testing.assert_array_equal(np.asarray(info.q_seqlens), [[2, 3]])
    np.testing.assert_array_equal(np.asarray(info.q_offsets)[:, :2], [[0, 2]])


def test_descriptor_is_a_pytree_through_jit():
    desc = SequenceDescriptor.from_seqlens((jnp.array([16, 9]), jnp.array([12, 16])))
    f = jax.jit(lambda q, k, v, d: fused_attn((q, k, v), **_kwargs(sequence_descriptor=d,
                                                                   attn_mask_type=AttnMaskType.PADDING_MASK)))
    out = f(q, k, v, desc)
    eager = fused_attn((q, k, v), **_kwargs(sequence_descriptor=desc, attn_mask_type=AttnMaskType.PADDING_MASK))
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(out[1, 9:]).max()) == 0.0  # padded queries of row 1 give zeros


# ------------------------------------------------------------------------------------------------
# Backend selection
# ------------------------------------------------------------------------------------------------

_AVAILABLE_ARGS = dict(
    is_training=True, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
    attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.CAUSAL_MASK, softmax_type="vanilla",
    dropout_probability=0.0, q_num_heads=8, kv_num_heads=2, q_max_seqlen=128, kv_max_seqlen=128, head_dim_qk=64, head_dim_v=64,
)


def _on_cpu():
    return jax.devices()[0].platform == "cpu"


@pytest.mark.skipif(not _on_cpu(), reason="CPU-only selection facts")
def test_fused_kernel_unavailable_on_cpu_with_a_reason():
    assert not is_fused_attn_kernel_available(**_AVAILABLE_ARGS)
    reasons = te_attention.fused_attn_unavailable_reasons(**_AVAILABLE_ARGS)
    assert any("CUDA" in r for r in reasons), reasons


def test_unsupported_features_are_reasons():
    reasons = te_attention.fused_attn_unavailable_reasons(**{**_AVAILABLE_ARGS, "head_dim_qk": 512,
                                                             "q_dtype": jnp.float16})
    assert any("head_dim_qk=512" in r for r in reasons)
    assert any("q_dtype=float16 != kv_dtype=bfloat16" in r for r in reasons)


def test_disabled_fused_backend_is_a_reason(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    assert "disabled by NVTE_FUSED_ATTN=0" in te_attention.fused_attn_unavailable_reasons(**_AVAILABLE_ARGS)


@pytest.mark.skipif(not _on_cpu(), reason="on CPU the fused backend cannot be forced")
def test_forcing_the_fused_backend_on_cpu_raises_with_its_reasons(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    with pytest.raises(NoBackendError, match="(?s)FusedAttention.*CUDA"):
        fused_attn((q, k, v), **_kwargs())


def test_forcing_the_unfused_backend_runs_it(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    out = fused_attn((q, k, v), **_kwargs())
    ref = attn_fn("unfused", **{k_: v_ for k_, v_ in _kwargs().items() if k_ != "bias"})((q, k, v), None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_no_backend_left_raises(monkeypatch):
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with pytest.raises(NoBackendError, match="no attention backend can run this call"):
        fused_attn((q, k, v), **_kwargs())


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def te_log(monkeypatch):
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    handler = _Records()
    logger = logging.getLogger("transformer_engine")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_selection_is_logged_under_nvte_debug(te_log):
    fused_attn((q, k, v), **_kwargs())
    assert any(m.startswith("Running with config:") and "framework=jax" in m for m in te_log)
    assert any(m.startswith("Selected backend = ") for m in te_log)
    if _on_cpu():
        assert "Selected backend = UnfusedDotProductAttention" in te_log
        assert any(m.startswith("Disabling FusedAttention:") for m in te_log)


# ------------------------------------------------------------------------------------------------
# Determinism switch: read at trace time of each call
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, xla_flags, expected",
    [
        ({}, "", False),
        ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}, "", True),
        ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "", False),
        ({}, "--xla_gpu_deterministic_ops=true", True),
        ({}, "--xla_gpu_deterministic_ops", True),
        ({}, "--xla_gpu_deterministic_ops=false", False),
        ({}, "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
        ({}, "--xla_gpu_exclude_nondeterministic_ops=true", True),
        ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "--xla_gpu_deterministic_ops=true", True),
    ],
)
def test_deterministic_mode_sources(monkeypatch, env, xla_flags, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    assert is_deterministic_mode() is expected


def _traced_statics(fn, *args):
    """The FusedAttnStatic of every fused primitive in fn's jaxpr (through jvp/vjp sub-jaxprs)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if "static" in eqn.params:
                found.append(eqn.params["static"])
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(inner if hasattr(inner, "eqns") else inner.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_deterministic_flag_is_read_at_trace_time_of_each_call(monkeypatch):
    """Each trace reads the switch (JAX reuses a trace of the *same* function object, so this
    builds the function anew, as a user re-jitting after changing the environment does)."""
    fused = attn_fn("fused", **{k_: v_ for k_, v_ in _kwargs().items() if k_ != "bias"})

    def statics():
        grad = jax.grad(lambda q: jnp.sum(fused((q, k, v), None)))
        found = _traced_statics(grad, q)
        assert len(found) == 2  # forward and backward primitives
        return [s.deterministic for s in found]

    assert statics() == [False, False]
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    assert statics() == [True, True]
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    assert statics() == [False, False]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert statics() == [True, True]


def test_deterministic_flag_reaches_the_config(te_log, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    jax.jit(lambda q: fused_attn((q, k, v), **_kwargs()))(q)
    assert any("deterministic=True" in m and "framework=jax" in m for m in te_log)


# ------------------------------------------------------------------------------------------------
# Transformations: jit, grad, vmap (extra batch axis), remat
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_vmap_over_an_extra_batch_axis_matches_a_loop(backend, with_bias):
    """The no-bias variant keeps vmap through the fused kernels tested on a GPU, where the fused
    backend takes no bias yet (its bias variant is skipped there with the backend's reason)."""
    bias_type = AttnBiasType.POST_SCALE_BIAS if with_bias else AttnBiasType.NO_BIAS
    mask = AttnMaskType.PADDING_CAUSAL_MASK
    _skip_unless_runs(backend, h_kv=2, bias_shape=(1, H, S, S) if with_bias else None, attn_bias_type=bias_type,
                      attn_mask_type=mask)
    qs, ks, vs = (jnp.stack([x, 0.5 * x]) for x in _inputs(h_kv=2))
    bias = jax.random.normal(jax.random.PRNGKey(5), (2, 1, H, S, S)) if with_bias else None  # per instance
    lens = jnp.array([[16, 9], [4, 16]])
    kwargs = {k_: v_ for k_, v_ in _kwargs(attn_bias_type=bias_type, attn_mask_type=mask).items()
              if k_ not in ("bias", "sequence_descriptor")}

    def one(q, k, v, bias, lens):
        desc = SequenceDescriptor.from_seqlens(lens)
        f = lambda qkv, b: attn_fn(backend, sequence_descriptor=desc, **kwargs)(qkv, b)  # noqa: E731
        out, vjp = jax.vjp(f, (q, k, v), bias)
        return out, vjp(jnp.ones_like(out))

    batched = jax.jit(jax.vmap(one))(qs, ks, vs, bias, lens)
    for i in range(2):
        single = jax.jit(one)(qs[i], ks[i], vs[i], None if bias is None else bias[i], lens[i])
        leaves_b, leaves_s = jax.tree.leaves(batched), jax.tree.leaves(single)
        assert len(leaves_b) == len(leaves_s) == (5 if with_bias else 4)  # out, dq, dk, dv (, dbias)
        for a, b in zip(leaves_b, leaves_s):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_vmap_with_unbatched_inputs_and_batched_dropout_seed(backend):
    """Fused skips on a GPU with the backend's reason (the JAX launch passes no dropout yet); the
    unfused backend (what fused_attn selects for dropout there) keeps it tested on a GPU."""
    _skip_unless_runs(backend, dropout_probability=0.3)
    q_, k_, v_ = _inputs()
    seeds = jax.random.split(jax.random.PRNGKey(0), 3)
    kwargs = {k2: v2 for k2, v2 in _kwargs(dropout_probability=0.3).items() if k2 not in ("bias", "seed")}

    def one(seed):
        return attn_fn(backend, seed=seed, **kwargs)((q_, k_, v_), None)

    batched = jax.vmap(one)(seeds)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(one(seeds[i])), rtol=2e-5, atol=2e-5)
    assert not np.allclose(np.asarray(batched[0]), np.asarray(batched[1]))


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_remat_gives_the_same_gradients(backend):
    f = attn_fn(backend, **{k_: v_ for k_, v_ in _kwargs().items() if k_ != "bias"})

    def loss(q, k, v):
        return jnp.sum(jnp.sin(f((q, k, v), None)))

    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(plain, remat):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_primitive_eager_and_jit_agree():
    f = attn_fn("fused", **{k_: v_ for k_, v_ in _kwargs().items() if k_ != "bias"})
    eager = f((q, k, v), None)
    jitted = jax.jit(f)((q, k, v), None)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_fused_and_unfused_agree_through_grad_of_grad_free_loss():
    """Both backends differentiate to the same gradients (fp32, within rounding). At full fp32
    precision: on a GPU XLA runs fp32 dots in TF32 by default (the unfused path), while the fused
    kernels use IEEE fp32 dots for fp32 inputs."""
    kwargs = {k_: v_ for k_, v_ in _kwargs(attn_mask_type=AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK,
                                           window_size=(3, 0)).items() if k_ != "bias"}

    def grads(backend):
        f = attn_fn(backend, **kwargs)
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f((q, k, v), None) ** 2), argnums=(0, 1, 2)))(q, k, v)

    with jax.default_matmul_precision("highest"):  # traced (and compiled) under it: jit happens inside
        fused, unfused = grads("fused"), grads("unfused")
    for a, b in zip(fused, unfused):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_jax_backends_are_the_registry_with_runners():
    """fused_attn's backends are the common registry's JAX backends, in its order, each with its runner."""
    from transformer_engine.common.attention.backends import backends_for

    common = backends_for("jax")
    assert [b.NAME for b in te_attention._CANDIDATES] == [b.NAME for b in common]
    for frontend, base in zip(te_attention._CANDIDATES, common):
        assert issubclass(frontend, base) and callable(frontend.run)
