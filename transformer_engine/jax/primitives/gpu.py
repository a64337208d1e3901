"""CUDA lowering of the fused attention primitives: the project's Triton kernels through XLA FFI.

Route (docs/jax_ffi.rst): at lowering time the kernels are compiled with ``triton.compile``
(no torch needed), specialized exactly as Triton's own JIT specializes the PyTorch launch of
the same call, with the tiles of the shared launch plan (``common.attention.plan``). Each
primitive lowers to one custom call ``te_triton_launch`` handled by the native extension
``transformer_engine.jax.transformer_engine_jax_ffi`` (``csrc/triton_launch.cpp``), which
launches the cubins on XLA's stream. The cubins and a small launch *program* (buffer fills,
then launches with their arguments in Triton's launch ABI order) travel as custom-call
attributes, so a compiled executable is self-contained.

Sequences: without padding the kernels run in their BSHD mode. With padding masks (and THD)
they run in their packed mode over the ``[b * s]`` tokens: sequence ``k`` of row ``r`` starts
at token ``r * s + offset[r, k]``; outputs and gradients are zero-filled first, and the saved
log-sum-exp is ``[b * m, h, s]`` = the primitives' ``[b, m, h, s]`` softmax aux.

A post_scale_bias ``[1|b, 1|h, s_q, s_kv]`` (padded layouts, one sequence per row) goes to the
forward, dK/dV and dQ kernels with the PyTorch launcher's strides, and its gradient comes from the
dBias kernel; ``BIAS_VERIFIED_ON_GPU`` says whether fused_attn selects this path.

Sink softmax: the sink logits (fp32 ``[h_q]``) go to the Triton forward (``SINK``, ``HAS_SINK``); for
the learnable sink the backward launches the sink-gradient kernel after the preprocess, which writes
each sequence's part ``[b * m, h_q]`` (the custom_vjp sums them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common.attention.enums import AttnBiasType, QKVFormat
from transformer_engine.common.attention.kernels.aot import CompiledKernel, Pointer, compile_kernel
from transformer_engine.common.attention.plan import (
    backward_plan, block_grid, forward_plan, mask_flags, tma_eligible,
)

__all__ = ["unavailable_reason", "fused_attn_fwd_lowering", "fused_attn_bwd_lowering", "rocm_lowering"]

FFI_TARGET = "te_triton_launch"
PROGRAM_VERSION = 1
LOG2E = 1.4426950408889634  # as the PyTorch launcher, so both pass the same fp32 scale

_KIND_BUFFER, _KIND_I32, _KIND_I64, _KIND_F32, _KIND_NULL = range(5)

# The bias path (post_scale_bias forward, dBias backward): its launch programs are checked on the
# CPU (tests/jax/test_jax_gpu_lowering.py) and the GPU tests that force it passed on the H200
# (qa/L1_jax_gpu), so fused_attn selects it. False keeps bias
# calls on the unfused backend (for a new bias path awaiting its GPU run).
BIAS_VERIFIED_ON_GPU = True


# ================================================================================================
# The native extension
# ================================================================================================


@functools.lru_cache(maxsize=None)
def _extension_state() -> Tuple[bool, Optional[str]]:
    """Import the FFI extension and register its targets once: (ok, reason when not)."""
    try:
        from transformer_engine.jax import transformer_engine_jax_ffi as ext
    except ImportError as err:
        return False, (
            "the XLA FFI extension transformer_engine.jax.transformer_engine_jax_ffi is not built "
            f"({err}); build with a CUDA toolkit present: NVTE_FRAMEWORK=jax pip install ."
        )
    if getattr(ext, "PROGRAM_VERSION", None) != PROGRAM_VERSION:
        return False, (
            f"transformer_engine_jax_ffi speaks launch program version {getattr(ext, 'PROGRAM_VERSION', None)}, "
            f"this frontend {PROGRAM_VERSION}: rebuild the package"
        )
    for name, capsule in ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return True, None


def unavailable_reason() -> Optional[str]:
    """Why the fused primitives cannot run on this CUDA GPU, or None when they can."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return "triton is not installed"
    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel

    if not isinstance(attn_fwd_kernel, JITFunction):
        return "the Triton kernels were loaded for Triton's interpreter (TRITON_INTERPRET=1), which JAX cannot launch"
    return _extension_state()[1]


def _require_extension() -> None:
    reason = unavailable_reason()
    if reason:
        raise NotImplementedError(f"fused attention on CUDA: {reason}")


def _cuda_target():
    """The Triton target of the GPU JAX runs on (Triton's GPUTarget)."""
    from triton.backends.compiler import GPUTarget

    major, minor = _compute_capability()
    return GPUTarget("cuda", major * 10 + minor, 32)


def _compute_capability() -> Tuple[int, int]:
    device = jax.devices("gpu")[0]
    capability = str(device.compute_capability)
    if capability.lower().startswith("gfx"):
        raise NotImplementedError(ROCM_REASON.format(arch=capability))
    major, minor = (int(x) for x in capability.split("."))
    return major, minor


ROCM_REASON = ("fused attention on a ROCm GPU ({arch}): the JAX launch goes through the XLA FFI extension "
               "(csrc/triton_launch.cpp), which loads CUDA cubins on CUDA streams only; fused_attn runs unfused there")


def rocm_lowering(ctx, *args, **kwargs):
    """Lowering of the inner fused primitives on ROCm: none, and says why (selection never picks them there)."""
    raise NotImplementedError(ROCM_REASON.format(arch=str(getattr(jax.devices()[0], "compute_capability", "gfx"))))


# ================================================================================================
# Launch programs
# ================================================================================================


class Program:
    """Fills and launches over the buffers of one custom call (operands, then results)."""

    def __init__(self, operands: Sequence[jax.ShapeDtypeStruct]):
        self.operands = list(operands)
        self.results: List[jax.ShapeDtypeStruct] = []
        self._kernels: List[CompiledKernel] = []
        self._fills: List[Tuple[int, int, int]] = []
        self._launches: List[Tuple[int, Tuple[int, int, int], List[Tuple[int, int]]]] = []

    def result(self, shape, dtype) -> int:
        self.results.append(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)))
        return len(self.operands) + len(self.results) - 1

    def dtype_of(self, index: int):
        buffers = self.operands + self.results
        return buffers[index].dtype

    def fill(self, index: int, value: int = 0, width: int = 1) -> None:
        """Set buffer ``index`` to ``value`` repeated (``width`` 1: bytes, 4: 32-bit words)."""
        self._fills.append((index, value, width))

    def fill_inf_f32(self, index: int) -> None:
        self.fill(index, 0x7F800000, 4)

    def launch(self, kernel: CompiledKernel, grid: Tuple[int, int, int], args: Dict[str, object]) -> None:
        """``args``: buffer indices for pointer parameters (``Buf(i)``), numbers for the rest."""
        if kernel not in self._kernels:
            self._kernels.append(kernel)
        params = []
        for name, ty in kernel.params:
            value = args[name]
            if ty.startswith("*"):
                if not isinstance(value, Buf):
                    raise TypeError(f"{kernel.name}: parameter {name} ({ty}) needs a buffer, got {value!r}")
                params.append((_KIND_BUFFER, value.index))
            elif ty in ("i32", "u32", "i1", "i8", "i16", "u8", "u16"):
                params.append((_KIND_I32, int(value)))
            elif ty in ("i64", "u64"):
                params.append((_KIND_I64, int(value)))
            elif ty == "fp32":
                params.append((_KIND_F32, int(np.array(value, np.float32).view(np.uint32))))
            else:
                raise NotImplementedError(f"{kernel.name}: parameter {name} of Triton type {ty}")
        # Triton 3.6 appends the global and the profile scratch pointers after the user's.
        for size in (kernel.global_scratch_size, kernel.profile_scratch_size):
            if size > 0:
                workspace = self.result((grid[0] * grid[1] * grid[2] * size,), jnp.uint8)
                params.append((_KIND_BUFFER, workspace))
            else:
                params.append((_KIND_NULL, 0))
        self._launches.append((self._kernels.index(kernel), tuple(int(g) for g in grid), params))

    def encode(self) -> Tuple[np.ndarray, np.ndarray]:
        """(program int64[], blob uint8[]) attributes for the FFI call."""
        blob = bytearray()
        words: List[int] = [PROGRAM_VERSION, len(self._kernels)]
        for k in self._kernels:
            cubin_offset = len(blob)
            blob += k.cubin
            name_offset = len(blob)
            blob += k.name.encode()
            signed_hash = k.hash - (1 << 64) if k.hash >= 1 << 63 else k.hash
            words += [signed_hash, cubin_offset, len(k.cubin), name_offset, len(k.name), k.shared, k.num_warps]
        words.append(len(self._fills))
        for index, value, width in self._fills:
            words += [index, value, width]
        words.append(len(self._launches))
        for kernel_index, grid, params in self._launches:
            words += [kernel_index, *grid, len(params)]
            for kind, value in params:
                words += [kind, value]
        return np.asarray(words, np.int64), np.frombuffer(bytes(blob), np.uint8).copy()

    def call(self, *operands):
        program, blob = self.encode()
        return jax.ffi.ffi_call(FFI_TARGET, self.results)(*operands, program=program, blob=blob)


@dataclass(frozen=True)
class Buf:
    index: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _strides(shape: Sequence[int], packed: bool) -> Tuple[int, ...]:
    """Element strides of a contiguous ``[b, s, h, d]`` buffer seen as the kernels' (b, s, h, d):
    batch stride 0 when the tokens of all rows form one packed sequence axis."""
    b, s, h, d = shape
    return (0 if packed else s * h * d, h * d, d, 1)


def _tma(wanted: bool, dtype, *shapes: Sequence[int]) -> bool:
    """Whether the block loops may read these contiguous [b, s, h, d] buffers through TMA descriptors
    (as the PyTorch launcher decides): every stride but the head dim's a multiple of 16 bytes; XLA
    aligns buffers to more than 16 bytes. The descriptors live in the launch's global scratch."""
    size = jnp.dtype(dtype).itemsize
    return wanted and all(tma_eligible(size, 0, _strides(shape, False)) for shape in shapes)


def _plan_config(static, q, k, v, deterministic: bool) -> AttnConfig:
    """The planning config of a launch, built as the PyTorch launcher builds it."""
    return AttnConfig(
        batch_size=1, num_heads_q=q.shape[2], num_heads_kv=k.shape[2], head_dim_qk=q.shape[3],
        head_dim_v=v.shape[3], max_seqlen_q=0, max_seqlen_kv=0, dtype=jnp.dtype(q.dtype).name,
        attn_mask_type=static.attn_mask_type, window_size=static.window_size, deterministic=deterministic,
        bottom_right_diagonal=static.bottom_right, framework="jax",
        attn_bias_type=AttnBiasType.POST_SCALE_BIAS if static.has_bias else AttnBiasType.NO_BIAS,
        softmax_type=static.softmax_type, device_type="cuda", compute_capability=_compute_capability(),
    )


def _uses_packed_mode(static) -> bool:
    """Padding masks (and THD) run the kernels in packed mode over all tokens."""
    return static.attn_mask_type.is_padding


def _check_supported(static, segments_per_row: int) -> None:
    if static.has_bias:
        if static.attn_bias_type != AttnBiasType.POST_SCALE_BIAS:
            raise NotImplementedError(
                "`attn_bias_type` must be 'post_scale_bias' for the fused kernels (they add the bias after the "
                f"scale), got {static.attn_bias_type.value!r}; fused_attn selects the unfused backend for it"
            )
        # The kernels index the bias by sequence, and dBias reads each row's tokens from position 0:
        # one sequence per row, as the PyTorch launcher (which rejects a bias with THD).
        if static.qkv_format == QKVFormat.THD or segments_per_row > 1:
            raise NotImplementedError(
                "a bias must come with a padded layout (one sequence per row) for the fused kernels, got "
                f"qkv_format={static.qkv_format.value!r} with max_segments_per_seq={segments_per_row}; "
                "fused_attn selects the unfused backend for it"
            )
    if static.has_dropout:
        raise NotImplementedError(
            "the JAX launch passes no dropout to the fused kernels yet; fused_attn selects the unfused backend for it"
        )


def _sequence_arrays(q_seqlens, kv_seqlens, q_offsets, kv_offsets, s_q: int, s_kv: int):
    """Kernel sequences of packed mode: starts and lengths ``[b * m]`` (int32)."""
    b, m = q_seqlens.shape
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    start_q = (rows * s_q + q_offsets[:, :m].astype(jnp.int32)).reshape(-1)
    start_k = (rows * s_kv + kv_offsets[:, :m].astype(jnp.int32)).reshape(-1)
    return start_q, start_k, q_seqlens.astype(jnp.int32).reshape(-1), kv_seqlens.astype(jnp.int32).reshape(-1)


# ================================================================================================
# Forward
# ================================================================================================


def _fwd_impl(q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset, *, static):
    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel
    from transformer_engine.common.attention.kernels.hopper_ws import attn_fwd_ws_kernel

    b, s_q, hq, dqk = q.shape
    s_kv, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    m = q_seqlens.shape[1]
    _check_supported(static, m)
    packed = _uses_packed_mode(static)
    operands = [q, k, v]
    if packed:
        operands += list(_sequence_arrays(q_seqlens, kv_seqlens, q_offsets, kv_offsets, s_q, s_kv))
    bias_buf = _append_bias(operands, bias, static)
    sink_buf = _append_sink(operands, softmax_offset, static)
    nseq = b * m if packed else b
    prog = Program([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands])
    o = prog.result((b, s_q, hq, dv), q.dtype)
    lse = prog.result((nseq, hq, s_q), jnp.float32)
    if packed:
        prog.fill(o)  # packed mode writes only rows inside sequences
        prog.fill_inf_f32(lse)
        seq_bufs = dict(SEQ_START_Q=Buf(3), SEQ_START_K=Buf(4), SEQ_LEN_Q=Buf(5), SEQ_LEN_K=Buf(6))
    else:
        seq_bufs = dict.fromkeys(("SEQ_START_Q", "SEQ_START_K", "SEQ_LEN_Q", "SEQ_LEN_K"), Buf(lse))

    config = _plan_config(static, q, k, v, deterministic=False)
    plan = forward_plan(config)
    flags, left, right = mask_flags(config)
    t = plan.tiles
    kernel_fn, constexprs = attn_fwd_kernel, t.loop_constexprs
    if plan.warp_specialized is not None and _tma(True, q.dtype, q.shape, k.shape, v.shape):
        t = plan.warp_specialized  # as the PyTorch launcher decides (kernels/hopper_ws.py)
        kernel_fn, constexprs = attn_fwd_ws_kernel, t.ws_constexprs
    values = dict(
        Q=Buf(0), K=Buf(1), V=Buf(2), O=Buf(o), LSE=Buf(lse), **seq_bufs,
        **_named_strides("q", _strides(q.shape, packed)), **_named_strides("k", _strides(k.shape, packed)),
        **_named_strides("v", _strides(v.shape, packed)),
        **_named_strides("o", _strides((b, s_q, hq, dv), packed)),
        stride_lb=hq * s_q, stride_lh=s_q,
        num_heads_q=hq, gqa_group=hq // hk, seqlen_q=s_q, seqlen_k=s_kv,
        qk_scale=static.scaling_factor * LOG2E, window_left=left, window_right=right,
        HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=plan.block_dqk, BLOCK_DV=plan.block_dv,
        IS_THD=packed, HAS_SEQLENS=packed, DOT_PRECISION=plan.dot_precision,
        TMA=_tma(t.tma, k.dtype, k.shape, v.shape), **constexprs, **flags, **_bias_values(bias_buf, bias),
        **_sink_values(sink_buf),
    )
    values = _complete(kernel_fn, values, Buf(lse))
    kernel = _compile_launch(kernel_fn, values, prog, t.launch_options)
    prog.launch(kernel, block_grid(_cdiv(s_q, t.block_m), nseq * hq), values)
    out, lse_out = prog.call(*operands)[:2]
    return out, lse_out.reshape(b, nseq // b, hq, s_q)


def _named_strides(prefix: str, strides: Tuple[int, ...]) -> Dict[str, int]:
    return {f"stride_{prefix}{axis}": value for axis, value in zip("bshd", strides)}


def _append_bias(operands: List, bias, static) -> Optional["Buf"]:
    """Add the bias to the call's operands (last, so the other indices stay put): its buffer."""
    if not static.has_bias:
        return None
    operands.append(bias)
    return Buf(len(operands) - 1)


def _append_sink(operands: List, softmax_offset, static) -> Optional["Buf"]:
    """Add the sink logits (fp32 [h_q]) to the call's operands with sink softmax: their buffer."""
    if not static.softmax_type.has_sink:
        return None
    operands.append(softmax_offset)
    return Buf(len(operands) - 1)


def _sink_values(sink_buf: Optional["Buf"]) -> Dict[str, object]:
    """The Triton forward's sink parameters (none without sink softmax: ``_complete`` passes the
    switched-off values; the Gluon forward has none and the plan keeps sink configs off it)."""
    return {} if sink_buf is None else dict(SINK=sink_buf, HAS_SINK=True)


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a row-major buffer (what torch.empty gives, size-1 dims included)."""
    return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))


def _bias_strides(shape: Sequence[int]) -> Tuple[int, int, int, int]:
    """(zb, zh, zm, zn) of a bias [1|b, 1|h, s_q, s_kv]: 0 along a broadcast dim, as
    ``ScoreMods.stride_args`` of the PyTorch launcher."""
    zb, zh, zm, zn = _contiguous_strides(shape)
    return (zb if shape[0] > 1 else 0, zh if shape[1] > 1 else 0, zm, zn)


def _bias_values(bias_buf: Optional["Buf"], bias) -> Dict[str, object]:
    """The forward, dK/dV and dQ kernels' bias parameters (none without a bias: ``_complete``
    passes the switched-off values)."""
    if bias_buf is None:
        return {}
    zb, zh, zm, zn = _bias_strides(bias.shape)
    return dict(BIAS=bias_buf, stride_zb=zb, stride_zh=zh, stride_zm=zm, stride_zn=zn, HAS_BIAS=True)


# Kernel parameters of features switched off (ALiBi and dropout always, the bias when the call has
# none): what to pass. Pointers get the log-sum-exp buffer as a never-read placeholder, as the
# PyTorch launcher does.
_FEATURES_OFF = dict(
    stride_zb=0, stride_zh=0, stride_zm=0, stride_zn=0, stride_alibi_b=0, dropout_p=0.0,
    HAS_BIAS=False, HAS_ALIBI=False, DROPOUT=False, SUM_ROWS=False, HAS_SINK=False,
)
_PLACEHOLDER_POINTERS = ("BIAS", "ALIBI_SLOPES", "RNG_STATE", "SINK")


def _complete(fn, values: Dict[str, object], placeholder: "Buf") -> Dict[str, object]:
    """``values`` plus the switched-off features' parameters; any other missing parameter is a
    kernel change this launcher does not know yet, and an error."""
    out = dict(values)
    for name in fn.arg_names:
        if name in out:
            continue
        if name in _PLACEHOLDER_POINTERS:
            out[name] = placeholder
        elif name in _FEATURES_OFF:
            out[name] = _FEATURES_OFF[name]
        else:
            raise NotImplementedError(
                f"{fn.__name__} has a parameter `{name}` that transformer_engine.jax.primitives.gpu does not "
                "pass yet: update the JAX launcher along with the kernels"
            )
    return out


def _compile_launch(fn, values: Dict[str, object], prog: Program, launch_options: Dict[str, int]) -> CompiledKernel:
    """Compile ``fn`` for the launch ``values`` (buffers become typed Pointers)."""
    args = {}
    for name in fn.arg_names:
        value = values[name]
        args[name] = Pointer(jnp.dtype(prog.dtype_of(value.index)).name) if isinstance(value, Buf) else value
    return compile_kernel(fn, args, launch_options, _cuda_target())


# ================================================================================================
# Backward
# ================================================================================================


def _bwd_impl(q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
              softmax_offset, *, static):
    from transformer_engine.common.attention.kernels.backward import (
        attn_bwd_dkdv_kernel,
        attn_bwd_dq_kernel,
        attn_bwd_dsink_kernel,
        attn_bwd_preprocess_kernel,
    )
    from transformer_engine.common.attention.kernels.hopper_ws import attn_bwd_dkdv_ws_kernel, attn_bwd_dq_ws_kernel

    b, s_q, hq, dqk = q.shape
    s_kv, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    m = q_seqlens.shape[1]
    _check_supported(static, m)
    packed = _uses_packed_mode(static)
    nseq = b * m if packed else b
    lse_in = softmax_aux.reshape(nseq, hq, s_q)
    operands = [q, k, v, out, dout, lse_in]
    if packed:
        operands += list(_sequence_arrays(q_seqlens, kv_seqlens, q_offsets, kv_offsets, s_q, s_kv))
    bias_buf = _append_bias(operands, bias, static)
    sink_buf = _append_sink(operands, softmax_offset, static) if static.softmax_type.is_learnable else None
    prog = Program([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands])
    Q, K, V, O, DO, LSE = (Buf(i) for i in range(6))
    dq = prog.result(q.shape, q.dtype)
    dk = prog.result(k.shape, k.dtype)
    dvt = prog.result(v.shape, v.dtype)
    delta = prog.result((nseq, hq, s_q), jnp.float32)
    # The dBias kernel writes every element of its [s_q, s_kv] tiles: no fill.
    dbias = prog.result(bias.shape, bias.dtype) if bias_buf is not None else None
    if packed:
        for index in (dq, dk, dvt):
            prog.fill(index)  # packed mode writes only rows inside sequences
        seq = dict(SEQ_START_Q=Buf(6), SEQ_START_K=Buf(7), SEQ_LEN_Q=Buf(8), SEQ_LEN_K=Buf(9))
    else:
        seq = dict.fromkeys(("SEQ_START_Q", "SEQ_START_K", "SEQ_LEN_Q", "SEQ_LEN_K"), LSE)

    config = _plan_config(static, q, k, v, deterministic=static.deterministic)
    plan = backward_plan(config)
    if static.deterministic and plan.atomic_dq:
        raise RuntimeError("deterministic backward planned with atomic dQ; this is a planning bug")
    flags, left, right = mask_flags(config)
    common = dict(IS_THD=packed, HAS_SEQLENS=packed)
    strides = dict(
        **_named_strides("q", _strides(q.shape, packed)), **_named_strides("k", _strides(k.shape, packed)),
        **_named_strides("v", _strides(v.shape, packed)), **_named_strides("o", _strides(out.shape, packed)),
        **_named_strides("do", _strides(dout.shape, packed)), **_named_strides("dq", _strides(q.shape, packed)),
        **_named_strides("dk", _strides(k.shape, packed)), **_named_strides("dv", _strides(v.shape, packed)),
        stride_lb=hq * s_q, stride_lh=s_q,
    )

    pre = plan.preprocess
    pre_values = dict(
        O=O, DO=DO, DELTA=Buf(delta), SEQ_START_Q=seq["SEQ_START_Q"], SEQ_LEN_Q=seq["SEQ_LEN_Q"], **strides,
        num_heads_q=hq, seqlen_q=s_q, HEAD_DIM_V=dv, BLOCK_DV=plan.block_dv, BLOCK_M=pre.block_m, **common,
    )
    pre_values = _complete(attn_bwd_preprocess_kernel, pre_values, LSE)
    kernel = _compile_launch(attn_bwd_preprocess_kernel, pre_values, prog, dict(num_warps=pre.num_warps))
    prog.launch(kernel, block_grid(_cdiv(s_q, pre.block_m), nseq * hq), pre_values)

    dsink = None
    if sink_buf is not None:  # each sequence's part of d softmax_offset, as launch.sink_grad launches it
        dsink = prog.result((nseq, hq), jnp.float32)
        t = plan.dsink
        sink_values = dict(LSE=LSE, DELTA=Buf(delta), SINK=sink_buf, DSINK=Buf(dsink), SEQ_LEN_Q=seq["SEQ_LEN_Q"],
                           stride_lb=hq * s_q, stride_lh=s_q, stride_dsb=hq, seqlen_q=s_q, BLOCK_M=t.block_m,
                           HAS_SEQLENS=packed)
        kernel = _compile_launch(attn_bwd_dsink_kernel, sink_values, prog, dict(num_warps=t.num_warps))
        prog.launch(kernel, plan.dsink_grid(nseq, hq), sink_values)

    if plan.atomic_dq:
        dq_acc = prog.result(q.shape, jnp.float32)
        prog.fill(dq_acc)
        dq_acc_buf, dq_acc_strides = Buf(dq_acc), _strides(q.shape, packed)
    else:
        dq_acc_buf, dq_acc_strides = LSE, (0, 0, 0, 0)  # unused by the kernel without ATOMIC_DQ
    shared = dict(
        Q=Q, K=K, V=V, DO=DO, LSE=LSE, DELTA=Buf(delta), **seq, **strides, seqlen_q=s_q, seqlen_k=s_kv,
        gqa_group=hq // hk, sm_scale=static.scaling_factor, qk_scale=static.scaling_factor * LOG2E,
        window_left=left, window_right=right, HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=plan.block_dqk,
        BLOCK_DV=plan.block_dv, DOT_PRECISION=plan.dot_precision, **flags, **common, **_bias_values(bias_buf, bias),
    )
    t = plan.dkdv
    kernel_fn, constexprs = attn_bwd_dkdv_kernel, t.loop_constexprs
    if plan.dkdv_warp_specialized is not None and _tma(True, q.dtype, q.shape, k.shape, v.shape, dout.shape):
        t = plan.dkdv_warp_specialized  # as the PyTorch launcher decides (kernels/hopper_ws.py)
        kernel_fn, constexprs = attn_bwd_dkdv_ws_kernel, t.ws_constexprs
    dkdv_values = dict(
        shared, DK=Buf(dk), DV=Buf(dvt), DQ_ACC=dq_acc_buf, **_named_strides("dq", dq_acc_strides),
        num_heads_kv=hk, ATOMIC_DQ=plan.atomic_dq, TMA=_tma(t.tma, q.dtype, q.shape, dout.shape),
        **constexprs,
    )
    dkdv_values = _complete(kernel_fn, dkdv_values, LSE)
    kernel = _compile_launch(kernel_fn, dkdv_values, prog, t.launch_options)
    prog.launch(kernel, block_grid(_cdiv(s_kv, t.block_n), nseq * hk), dkdv_values)

    if bias_buf is not None:  # launched between dK/dV and dQ, as the PyTorch launcher does
        _launch_dbias(prog, plan, static, q, k, v, bias, bias_buf, Buf(dbias), Buf(delta), seq, packed, flags, left,
                      right)

    if not plan.atomic_dq:
        t = plan.dq
        kernel_fn, constexprs = attn_bwd_dq_kernel, t.loop_constexprs
        if plan.dq_warp_specialized is not None and _tma(True, q.dtype, q.shape, k.shape, v.shape, dout.shape):
            t = plan.dq_warp_specialized  # as the PyTorch launcher decides (kernels/hopper_ws.py)
            kernel_fn, constexprs = attn_bwd_dq_ws_kernel, t.ws_constexprs
        dq_values = dict(shared, DQ=Buf(dq), num_heads_q=hq, TMA=_tma(t.tma, k.dtype, k.shape, v.shape),
                         **constexprs)
        dq_values = _complete(kernel_fn, dq_values, LSE)
        kernel = _compile_launch(kernel_fn, dq_values, prog, t.launch_options)
        prog.launch(kernel, block_grid(_cdiv(s_q, t.block_m), nseq * hq), dq_values)

    results = prog.call(*operands)
    dq_out, dk_out, dv_out = results[:3]
    if plan.atomic_dq:
        dq_out = results[dq_acc - len(operands)].astype(q.dtype)
    dbias_out = results[dbias - len(operands)] if dbias is not None else jnp.zeros_like(bias)
    if dsink is not None:
        dsink_out = results[dsink - len(operands)].reshape(b, m, hq)
    else:
        dsink_out = jnp.zeros((b, m, hq), jnp.float32)
    return dq_out, dk_out, dv_out, dbias_out, dsink_out


def _launch_dbias(prog: Program, plan, static, q, k, v, bias, bias_buf: Buf, dbias_buf: Buf, delta_buf: Buf,
                  seq: Dict[str, Buf], packed: bool, flags: Dict[str, bool], left: int, right: int) -> None:
    """dBias in the bias's shape, summed over its broadcast dims in a fixed order, with the
    arguments, tiles and grid (``plan.dbias``, ``plan.dbias_grid``) of ``launch._dbias``."""
    from transformer_engine.common.attention.kernels.backward import attn_bwd_dbias_kernel

    b, s_q, hq, dqk = q.shape
    s_kv, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    Q, K, V, DO, LSE = (Buf(i) for i in (0, 1, 2, 4, 5))
    t = plan.dbias
    zb, zh, zm, zn = _bias_strides(bias.shape)
    # This kernel has no packed mode: it reads rows as the padded launch (batch strides, lengths
    # only), which is where the packed mode's sequences are when each row holds one from token 0.
    values = dict(
        Q=Q, K=K, V=V, DO=DO, LSE=LSE, DELTA=delta_buf, BIAS=bias_buf, DBIAS=dbias_buf, RNG_STATE=LSE,
        SEQ_LEN_Q=seq["SEQ_LEN_Q"], SEQ_LEN_K=seq["SEQ_LEN_K"],
        **_named_strides("q", _strides(q.shape, False)), **_named_strides("k", _strides(k.shape, False)),
        **_named_strides("v", _strides(v.shape, False)), **_named_strides("do", _strides((b, s_q, hq, dv), False)),
        stride_lb=hq * s_q, stride_lh=s_q, stride_zb=zb, stride_zh=zh, stride_zm=zm, stride_zn=zn,
        **{f"stride_dz{axis}": value for axis, value in zip("bhmn", _contiguous_strides(bias.shape))},
        batch_size=b, num_heads_q=hq, gqa_group=hq // hk, bias_batch=bias.shape[0], bias_heads=bias.shape[1],
        seqlen_q=s_q, seqlen_k=s_kv, qk_scale=static.scaling_factor * LOG2E, window_left=left,
        window_right=right, dropout_p=0.0, HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=plan.block_dqk,
        BLOCK_DV=plan.block_dv, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_SEQLENS=packed, HAS_LEFT=flags["HAS_LEFT"],
        HAS_RIGHT=flags["HAS_RIGHT"], BOTTOM_RIGHT=flags["BOTTOM_RIGHT"], DROPOUT=False,
        DOT_PRECISION=plan.dot_precision,
    )
    values = _complete(attn_bwd_dbias_kernel, values, LSE)
    kernel = _compile_launch(attn_bwd_dbias_kernel, values, prog, t.launch_options)
    prog.launch(kernel, plan.dbias_grid(s_q, s_kv, bias.shape[0], bias.shape[1]), values)


# ================================================================================================
# Lowering rules (registered for platform "cuda" by primitives.attention)
# ================================================================================================


def fused_attn_fwd_lowering(ctx, *args, static):
    _require_extension()
    return mlir.lower_fun(functools.partial(_fwd_impl, static=static), multiple_results=True)(ctx, *args)


def fused_attn_bwd_lowering(ctx, *args, static):
    _require_extension()
    return mlir.lower_fun(functools.partial(_bwd_impl, static=static), multiple_results=True)(ctx, *args)
