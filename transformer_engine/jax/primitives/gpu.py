"""CUDA lowering of the fused attention primitives: the project's Triton kernels through XLA FFI.

Route (docs/jax_ffi.rst): the launches are those of the framework-free launch description
(``common.attention.launch_description``: kernels, grids, arguments, tiles of the shared plan). At
lowering time their kernels are compiled with ``triton.compile`` (no torch needed), specialized exactly as
Triton's own JIT specializes a launch with the same arguments. Each
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
forward, dK/dV and dQ kernels, and its gradient comes from the dBias kernel.

``return_max_logit``: the forward also writes each row's max logit (slot ``row_max``, laid out as the
log-sum-exp, -inf-filled in packed mode); the frontend's max over rows gives each head's.

Sink softmax: the sink logits (fp32 ``[h_q]``) go to the Triton forward (``SINK``, ``HAS_SINK``); for
the learnable sink the backward launches the sink-gradient kernel after the preprocess, which writes
each sequence's part ``[b * m, h_q]`` (the custom_vjp sums them).

A paged KV cache (primitives.paged, forward only): K and V are the cache's pools viewed as rows, and slot
``page_table`` (int32, one row of pages per kernel sequence) says where each key is; one kernel sequence per
segment (``segments_per_row`` 1), ``max_k`` the keys a table row holds. On Hopper the Gluon forward (where its
loader follows the page size) builds its TMA descriptors over the pools in the launch's global scratch, as the
contiguous Gluon launches do over their rows.

A partial backward (``FusedAttnStatic.backward_grads``: dQ only or dK/dV only, as context parallelism
asks) leaves the other pass out of the program, and its gradients are zeros of their shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from transformer_engine.common.attention import launch_description
from transformer_engine.common.attention.enums import AttnBiasType, QKVFormat
from transformer_engine.common.attention.kernels.aot import CompiledKernel, Pointer, compile_kernel

__all__ = ["unavailable_reason", "fused_attn_fwd_lowering", "fused_attn_paged_fwd_lowering", "fused_attn_bwd_lowering",
           "rocm_lowering"]

FFI_TARGET = "te_triton_launch"
PROGRAM_VERSION = 1
_KIND_BUFFER, _KIND_I32, _KIND_I64, _KIND_F32, _KIND_NULL = range(5)


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
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    from transformer_engine.common.attention.kernels import triton_compat
    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel

    if not triton_compat.is_jit_function(attn_fwd_kernel):
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

    def fill_neg_inf_f32(self, index: int) -> None:
        self.fill(index, 0xFF800000, 4)

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

    def add_launches(self, described, buffers: Dict[str, "Buf"]) -> None:
        """Compile each described launch (``launch_description.Launch``) for this GPU and add it."""
        target = _cuda_target()
        for launch in described:
            values = launch.bind(buffers)
            args = {name: Pointer(jnp.dtype(self.dtype_of(value.index)).name) if isinstance(value, Buf) else value
                    for name, value in values.items()}
            self.launch(compile_kernel(launch.kernel, args, launch.options, target), launch.grid, values)

    def call(self, *operands):
        program, blob = self.encode()
        return jax.ffi.ffi_call(FFI_TARGET, self.results)(*operands, program=program, blob=blob)


@dataclass(frozen=True)
class Buf:
    index: int


def _strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a row-major buffer (size-1 dims included)."""
    return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))


def _uses_packed_mode(static) -> bool:
    """Padding masks (and THD) run the kernels in packed mode over all tokens."""
    return static.attn_mask_type.is_padding()


def _check_supported(static, segments_per_row: int) -> None:
    if static.has_bias:
        if static.attn_bias_type != AttnBiasType.POST_SCALE_BIAS:
            raise NotImplementedError(
                "`attn_bias_type` must be 'post_scale_bias' for the fused kernels (they add the bias after the "
                f"scale), got {static.attn_bias_type.value!r}; fused_attn selects the unfused backend for it"
            )
        # The kernels index the bias by sequence, and dBias reads each row's tokens from position 0:
        # one sequence per row.
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


def launch_call(static, shapes: Dict[str, Sequence[int]], dtype, num_seqs: int, bias_shape: Optional[Sequence[int]],
                compute_capability: Optional[Tuple[int, int]], segments_per_row: int = 1, max_k: Optional[int] = None,
                page_size: int = 0, page_table_stride: int = 0, page_rows: int = 0,
                device: Optional[Dict[str, object]] = None) -> launch_description.Call:
    """The launch description's view of a call (``static``: its parameters) on contiguous ``[b, s, h, d]``
    buffers (``shapes`` by slot name: q, k, v, out, and d_out, dq, dk, dv for the backward) of ``num_seqs``
    kernel sequences; ``segments_per_row``: the packed mode's sequences per row (max_segments_per_seq), whose
    lengths only the device knows: the kernels then cover each row's blocks (launch_description.Call).
    A paged KV cache (``page_size`` > 0): k and v are the cache's rows ``[1, pages * page_size, h_kv, d]``
    (``page_rows`` of them), ``max_k`` the keys a sequence's page table row holds and ``page_table_stride`` that
    row's length. ``device``: other device facts than this CUDA GPU's (the interpreter's: primitives.interpret)."""
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    bias = None
    if bias_shape is not None:
        bias = launch_description.Bias(tuple(bias_shape), _strides(bias_shape))
    # XLA aligns buffers to more than 16 bytes.
    return launch_description.Call(
        params=static, num_heads_q=q[2], num_heads_kv=k[2], head_dim_qk=q[3], head_dim_v=v[3],
        dtype=jnp.dtype(dtype).name, num_seqs=num_seqs, max_q=q[1], max_k=k[1] if max_k is None else max_k,
        packed=_uses_packed_mode(static),
        has_seqlens=_uses_packed_mode(static),
        views={name: launch_description.View(_strides(shape)) for name, shape in shapes.items()},
        lse_strides=(q[2] * q[1], q[1]),
        device=device if device is not None else dict(device_type="cuda", compute_capability=compute_capability),
        bias=bias, segments_per_row=segments_per_row, page_size=page_size, page_table_stride=page_table_stride,
        page_rows=page_rows,
    )


def _sequence_arrays(q_seqlens, kv_seqlens, q_offsets, kv_offsets, s_q: int, s_kv: int):
    """Kernel sequences of packed mode: starts and lengths ``[b * m]`` (int32)."""
    b, m = q_seqlens.shape
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    start_q = (rows * s_q + q_offsets[:, :m].astype(jnp.int32)).reshape(-1)
    start_k = (rows * s_kv + kv_offsets[:, :m].astype(jnp.int32)).reshape(-1)
    return start_q, start_k, q_seqlens.astype(jnp.int32).reshape(-1), kv_seqlens.astype(jnp.int32).reshape(-1)


_SEQ_SLOTS = ("seq_start_q", "seq_start_k", "seq_len_q", "seq_len_k")


def _operands(static, named: List[Tuple[str, object]], seqs, bias, softmax_offset, with_offset: bool):
    """The call's operands and their buffers by slot name: ``named`` first, then the packed mode's
    sequences, the bias and the sink logits where the call has them."""
    operands, buffers = [], {}
    extra = list(zip(_SEQ_SLOTS, seqs)) if _uses_packed_mode(static) else []
    if static.has_bias:
        extra.append(("bias", bias))
    if with_offset:
        extra.append(("softmax_offset", softmax_offset))
    for name, x in named + extra:
        buffers[name] = Buf(len(operands))
        operands.append(x)
    return operands, buffers


# ================================================================================================
# Forward
# ================================================================================================


def _fwd_impl(q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset, *, static,
              program=Program, device=None):
    b, s_q, hq, dqk = q.shape
    s_kv, dv = k.shape[1], v.shape[3]
    m = q_seqlens.shape[1]
    _check_supported(static, m)
    packed = _uses_packed_mode(static)
    seqs = _sequence_arrays(q_seqlens, kv_seqlens, q_offsets, kv_offsets, s_q, s_kv) if packed else ()
    operands, buffers = _operands(static, [("q", q), ("k", k), ("v", v)], seqs, bias, softmax_offset,
                                  static.softmax_type.has_sink)
    nseq = b * m if packed else b
    prog = program([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands])
    o = prog.result((b, s_q, hq, dv), q.dtype)
    lse = prog.result((nseq, hq, s_q), jnp.float32)
    # return_max_logit: each row's max logit, laid out as lse (-inf where a row sees no key)
    row_max = prog.result((nseq, hq, s_q), jnp.float32) if static.return_max_logit else None
    if packed:
        prog.fill(o)  # packed mode writes only rows inside sequences
        prog.fill_inf_f32(lse)
        if row_max is not None:
            prog.fill_neg_inf_f32(row_max)
    buffers.update(out=Buf(o), lse=Buf(lse))
    if row_max is not None:
        buffers["row_max"] = Buf(row_max)
    call = launch_call(static, dict(q=q.shape, k=k.shape, v=v.shape, out=(b, s_q, hq, dv)), q.dtype, nseq,
                       bias.shape if static.has_bias else None, None if device else _compute_capability(),
                       m if packed else 1, device=device)
    workspace = launch_description.split_kv(call)
    if workspace is not None:  # split-KV: the chunks' states (fp32 workspace results, not returned)
        buffers.update(part_o=Buf(prog.result((workspace.part_o_size,), jnp.float32)),
                       part_ml=Buf(prog.result((workspace.part_ml_size,), jnp.float32)))
    prog.add_launches(launch_description.forward_launches(call), buffers)
    results = prog.call(*operands)
    out, lse_out = results[:2]
    if row_max is None:
        return out, lse_out.reshape(b, nseq // b, hq, s_q)
    return out, lse_out.reshape(b, nseq // b, hq, s_q), results[2].reshape(b, nseq // b, hq, s_q)


def _paged_fwd_impl(q, k_pages, v_pages, page_table, q_seqlens, kv_seqlens, q_offsets, softmax_offset, *, static):
    """The forward on a paged KV cache (primitives.paged): the planned forward (Triton, or Gluon where the page size
    fits its key blocks) reads K/V through the page table (``PAGE_SIZE``; launch_description.forward_launches), one
    kernel sequence per segment, in packed mode; the Gluon forward's descriptors over the pools are built on the
    device in the launch's global scratch, as for contiguous rows."""
    b, s_q, hq, dqk = q.shape
    num_pages, page_size, hk, dv = v_pages.shape
    m, n = page_table.shape[1:]
    nseq = b * m
    if not _uses_packed_mode(static) or page_size != static.kv_page_size:
        raise NotImplementedError(f"a paged KV cache forward needs a padding mask and kv_page_size={page_size}, got "
                                  f"{static.attn_mask_type.value!r} and {static.kv_page_size}")
    _check_supported(static, 1)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    start_q = (rows * s_q + q_offsets[:, :m].astype(jnp.int32)).reshape(-1)
    # The keys' starts are not read (the page table says where each key is); PyTorch passes its cu_seqlens_kv.
    seqs = (start_q, jnp.zeros((nseq,), jnp.int32), q_seqlens.astype(jnp.int32).reshape(-1),
            kv_seqlens.astype(jnp.int32).reshape(-1))
    named = [("q", q), ("k", k_pages), ("v", v_pages)]
    operands, buffers = _operands(static, named, seqs, None, softmax_offset, static.softmax_type.has_sink)
    buffers["page_table"] = Buf(len(operands))
    operands.append(page_table.reshape(nseq, n).astype(jnp.int32))
    prog = Program([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands])
    o = prog.result((b, s_q, hq, dv), q.dtype)
    lse = prog.result((nseq, hq, s_q), jnp.float32)
    prog.fill(o)  # packed mode writes only rows inside sequences
    prog.fill_inf_f32(lse)
    buffers.update(out=Buf(o), lse=Buf(lse))
    rows_shape = (1, num_pages * page_size, hk)
    call = launch_call(static, dict(q=q.shape, k=rows_shape + (dqk,), v=rows_shape + (dv,), out=(b, s_q, hq, dv)),
                       q.dtype, nseq, None, _compute_capability(), 1, max_k=n * page_size, page_size=page_size,
                       page_table_stride=n, page_rows=num_pages * page_size)
    workspace = launch_description.split_kv(call)
    if workspace is not None:  # split-KV: the chunks' states (fp32 workspace results, not returned)
        buffers.update(part_o=Buf(prog.result((workspace.part_o_size,), jnp.float32)),
                       part_ml=Buf(prog.result((workspace.part_ml_size,), jnp.float32)))
    prog.add_launches(launch_description.forward_launches(call), buffers)
    out, lse_out = prog.call(*operands)[:2]
    return out, lse_out.reshape(b, m, hq, s_q)


# ================================================================================================
# Backward
# ================================================================================================


def _bwd_impl(q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
              softmax_offset, *, static, program=Program, device=None):
    b, s_q, hq, dqk = q.shape
    s_kv = k.shape[1]
    m = q_seqlens.shape[1]
    _check_supported(static, m)
    packed = _uses_packed_mode(static)
    nseq = b * m if packed else b
    lse_in = softmax_aux.reshape(nseq, hq, s_q)
    seqs = _sequence_arrays(q_seqlens, kv_seqlens, q_offsets, kv_offsets, s_q, s_kv) if packed else ()
    sink_grad = static.softmax_type.is_learnable
    named = [("q", q), ("k", k), ("v", v), ("out", out), ("d_out", dout), ("lse", lse_in)]
    operands, buffers = _operands(static, named, seqs, bias, softmax_offset, sink_grad)
    prog = program([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands])
    # Gradients the call does not ask for (static.backward_grads) are no results: zeros outside the program.
    grads = static.backward_grads
    dq = prog.result(q.shape, q.dtype) if grads.has_dq else None
    dk = prog.result(k.shape, k.dtype) if grads.has_dkdv else None
    dvt = prog.result(v.shape, v.dtype) if grads.has_dkdv else None
    delta = prog.result((nseq, hq, s_q), jnp.float32)
    # The dBias kernel writes every element of its [s_q, s_kv] tiles: no fill.
    dbias = prog.result(bias.shape, bias.dtype) if static.has_bias else None
    dsink = prog.result((nseq, hq), jnp.float32) if sink_grad else None
    grad_results = {name: index for name, index in (("dq", dq), ("dk", dk), ("dv", dvt)) if index is not None}
    if packed:
        for index in grad_results.values():
            prog.fill(index)  # packed mode writes only rows inside sequences
    buffers.update({name: Buf(index) for name, index in grad_results.items()}, delta=Buf(delta))
    if dbias is not None:
        buffers["dbias"] = Buf(dbias)
    if dsink is not None:
        buffers["dsink"] = Buf(dsink)
    shapes = dict(q=q.shape, k=k.shape, v=v.shape, out=out.shape, d_out=dout.shape, dq=q.shape, dk=k.shape,
                  dv=v.shape)
    call = launch_call(static, shapes, q.dtype, nseq, bias.shape if static.has_bias else None,
                       None if device else _compute_capability(), m if packed else 1, device=device)
    prog.add_launches(launch_description.backward_launches(call, bias_grad=static.has_bias, sink_grad=sink_grad,
                                                           grads=grads), buffers)

    results = prog.call(*operands)
    dq_out, dk_out, dv_out = (results[index - len(operands)] if index is not None else jnp.zeros(x.shape, x.dtype)
                              for index, x in ((dq, q), (dk, k), (dvt, v)))
    dbias_out = results[dbias - len(operands)] if dbias is not None else jnp.zeros_like(bias)
    if dsink is not None:
        dsink_out = results[dsink - len(operands)].reshape(b, m, hq)
    else:
        dsink_out = jnp.zeros((b, m, hq), jnp.float32)
    return dq_out, dk_out, dv_out, dbias_out, dsink_out


# ================================================================================================
# Lowering rules (registered for platform "cuda" by primitives.attention)
# ================================================================================================


def fused_attn_fwd_lowering(ctx, *args, static):
    _require_extension()
    return mlir.lower_fun(functools.partial(_fwd_impl, static=static), multiple_results=True)(ctx, *args)


def fused_attn_paged_fwd_lowering(ctx, *args, static):
    _require_extension()
    return mlir.lower_fun(functools.partial(_paged_fwd_impl, static=static), multiple_results=True)(ctx, *args)


def fused_attn_bwd_lowering(ctx, *args, static):
    _require_extension()
    return mlir.lower_fun(functools.partial(_bwd_impl, static=static), multiple_results=True)(ctx, *args)
