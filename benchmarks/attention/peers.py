"""PyTorch subjects and peers of the attention benchmark: one small function each.

Each function takes a :class:`~cases.Case` and the shared :class:`Inputs` and returns either a
:class:`Runner` (a forward callable plus what the harness needs to time it, run its backward
and check its gradients) or a string: the reason it is skipped here (package missing, no GPU).
A peer that cannot run a shape raises; the harness records the error in the row.

Layouts: ``bshd`` inputs are ``[b, s, h, d]``; ``thd`` inputs are ``[t, h, d]`` packed by
``cu_seqlens`` (int32, ``[n + 1]``). v, the output and its gradient have the head dim ``case.d_v``.
Every runner's ``grad_out`` has its output's shape.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Optional, Sequence, Union

import torch

from cases import Case
from transformer_engine.common import settings


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor  # gradient of the output: q's shape with v's head dim
    cu_seqlens: Optional[torch.Tensor]  # thd only
    max_seqlen: int

    @property
    def device(self) -> torch.device:
        return self.q.device


def make_inputs(case: Case, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """N(0, 1) inputs from a fixed seed; q, k, v are leaves with requires_grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    lead = (case.tokens,) if case.layout == "thd" else (case.b, case.s)

    def randn(heads, d):
        return torch.randn(*lead, heads, d, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k = randn(case.hq, case.d).requires_grad_(), randn(case.hkv, case.d).requires_grad_()
    v = randn(case.hkv, case.d_v).requires_grad_()
    do = randn(case.hq, case.d_v)
    cu = None
    if case.layout == "thd":
        cu = torch.tensor([0] + list(_cumsum(case.seqlens)), dtype=torch.int32, device=device)
    return Inputs(q, k, v, do, cu, case.s)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


@dataclass
class Runner:
    fwd: Callable[[], torch.Tensor]
    leaves: Sequence[torch.Tensor]  # the tensors whose gradients are timed and compared
    grad_out: torch.Tensor
    context: Callable[[], ContextManager] = contextlib.nullcontext  # held over the whole measurement
    backend: Optional[Callable[[], Optional[str]]] = None  # what actually ran, read after the run
    notes: list = field(default_factory=list)


class PeerFailure(Exception):
    """The peer is installed but cannot run this case here (e.g. its workspace would not fit)."""


@contextlib.contextmanager
def torch_deterministic(flag: bool):
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(flag)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


def _scale(case: Case) -> float:
    return case.d ** -0.5


# ------------------------------------------------------------------------------------------------
# Subjects: our public PyTorch module, with the backend it selects or with our Triton backend forced
# ------------------------------------------------------------------------------------------------

def _te_module(case: Case, inp: Inputs, deterministic: bool, forced: bool) -> Union[Runner, str]:
    from transformer_engine.pytorch import DotProductAttention

    thd = case.layout == "thd"
    mask = ("padding_causal" if case.causal else "padding") if thd else ("causal" if case.causal else "no_mask")
    module = DotProductAttention(case.hq, (case.d, case.d_v), num_gqa_groups=case.hkv, attention_dropout=0.0,
                                 qkv_format=case.layout, attn_mask_type=mask)
    kwargs = {}
    if thd:
        kwargs = dict(cu_seqlens_q=inp.cu_seqlens, cu_seqlens_kv=inp.cu_seqlens, max_seqlen_q=inp.max_seqlen,
                      max_seqlen_kv=inp.max_seqlen)
    env = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0" if deterministic else "1",
           "NVTE_FUSED_ATTN_BACKEND": "fused" if forced else None}

    def fwd():
        return module(inp.q, inp.k, inp.v, **kwargs)

    return Runner(fwd, (inp.q, inp.k, inp.v), inp.do.reshape(*inp.do.shape[:-2], case.hq * case.d_v),
                  context=lambda: settings.environment(**env), backend=lambda: module.last_backend)


def te_dpa(case, inp):
    """transformer_engine.pytorch.DotProductAttention, the backend it selects, non-deterministic."""
    return _te_module(case, inp, deterministic=False, forced=False)


def te_dpa_det(case, inp):
    """DotProductAttention under NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (the backend it selects)."""
    return _te_module(case, inp, deterministic=True, forced=False)


def te_fused(case, inp):
    """DotProductAttention with NVTE_FUSED_ATTN_BACKEND=fused: our Triton kernels."""
    return _te_module(case, inp, deterministic=False, forced=True)


def te_fused_det(case, inp):
    return _te_module(case, inp, deterministic=True, forced=True)


# ------------------------------------------------------------------------------------------------
# flash-attn-4 (flash_attn.cute), called directly
# ------------------------------------------------------------------------------------------------

def _fa4(case: Case, inp: Inputs, deterministic: bool) -> Union[Runner, str]:
    if inp.device.type != "cuda":
        return "flash-attn-4 runs on NVIDIA SM90/SM100 GPUs only"
    try:
        import flash_attn.cute as fa
    except Exception as err:  # not installed, or its CuTe DSL stack is missing
        return (f"flash_attn.cute not importable ({type(err).__name__}: {str(err)[:120]}); "
                "install it with pip install \".[flash]\"")
    thd = case.layout == "thd"
    func = fa.flash_attn_varlen_func if thd else fa.flash_attn_func
    if "deterministic" not in inspect.signature(func).parameters:
        return "this flash-attn-4 has no `deterministic` argument"
    kwargs = dict(softmax_scale=_scale(case), causal=case.causal, deterministic=deterministic)
    if thd:
        kwargs.update(cu_seqlens_q=inp.cu_seqlens, cu_seqlens_k=inp.cu_seqlens, max_seqlen_q=inp.max_seqlen,
                      max_seqlen_k=inp.max_seqlen)

    def fwd():
        out = func(inp.q, inp.k, inp.v, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in 4.0 betas

    return Runner(fwd, (inp.q, inp.k, inp.v), inp.do, backend=lambda: "flash_attn.cute")


def fa4(case, inp):
    return _fa4(case, inp, deterministic=False)


def fa4_det(case, inp):
    return _fa4(case, inp, deterministic=True)


# ------------------------------------------------------------------------------------------------
# torch SDPA: flash (default and under torch.use_deterministic_algorithms(True)) and cuDNN
# ------------------------------------------------------------------------------------------------

def _sdpa(case: Case, inp: Inputs, backend_name: str, deterministic: bool) -> Union[Runner, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend_name == "CUDNN_ATTENTION" and inp.device.type != "cuda":
        return "torch SDPA's cuDNN backend needs a CUDA GPU"
    backend = getattr(SDPBackend, backend_name)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    scale = _scale(case)
    context = (lambda: torch_deterministic(True)) if deterministic else (lambda: torch_deterministic(False))
    notes = []

    if case.layout == "thd":
        # No varlen entry point: nested (jagged) tensors dispatch to the backend's varlen kernel.
        offsets = inp.cu_seqlens.to(torch.int64)

        def jagged(x):
            return torch.nested.nested_tensor_from_jagged(x, offsets, max_seqlen=inp.max_seqlen).transpose(1, 2)

        def fwd():
            with sdpa_kernel(backend):
                out = sdpa(jagged(inp.q), jagged(inp.k), jagged(inp.v), is_causal=case.causal, scale=scale)
            return out.transpose(1, 2).values()

        notes.append("thd via nested (jagged) tensors")
        return Runner(_explained(fwd), (inp.q, inp.k, inp.v), inp.do, context=context, notes=notes)

    gqa = case.hq != case.hkv
    state = {"expand": False}

    def fwd():
        q, k, v = (t.transpose(1, 2) for t in (inp.q, inp.k, inp.v))
        with sdpa_kernel(backend):
            if gqa and state["expand"]:
                rep = case.hq // case.hkv
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                return sdpa(q, k, v, is_causal=case.causal, scale=scale).transpose(1, 2)
            try:
                return sdpa(q, k, v, is_causal=case.causal, scale=scale, enable_gqa=gqa).transpose(1, 2)
            except RuntimeError:
                if not gqa:
                    raise
                state["expand"] = True  # this backend refuses enable_gqa: expand K/V heads instead
                notes.append("enable_gqa refused: K/V heads expanded with repeat_interleave (counted)")
                return fwd()

    return Runner(_explained(fwd), (inp.q, inp.k, inp.v), inp.do, context=context, notes=notes,
                  backend=lambda: backend_name.lower())


def _explained(fwd: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """fwd, whose refusal says why: torch SDPA raises a bare 'No available kernel' and gives its
    reasons (e.g. d_v != d_qk for flash) as warnings, so a refused call is repeated once recording them."""
    def call():
        try:
            return fwd()
        except RuntimeError as err:
            if "No available kernel" not in str(err):
                raise
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fwd()
                except RuntimeError:
                    pass
            why = [str(w.message).split("(Triggered internally")[0].strip() for w in caught]
            why = [w for w in why if w and not w.endswith("because:")]
            raise RuntimeError(f"torch SDPA has no kernel for this call: {'; '.join(why) or err}") from err
    return call


def torch_flash(case, inp):
    return _sdpa(case, inp, "FLASH_ATTENTION", deterministic=False)


def torch_flash_det(case, inp):
    """torch SDPA flash under torch.use_deterministic_algorithms(True) (held through the backward)."""
    return _sdpa(case, inp, "FLASH_ATTENTION", deterministic=True)


def torch_cudnn(case, inp):
    return _sdpa(case, inp, "CUDNN_ATTENTION", deterministic=False)


# ------------------------------------------------------------------------------------------------
# cuDNN frontend SDPA graphs (nvidia-cudnn-frontend), backward with use_deterministic_algorithm
# ------------------------------------------------------------------------------------------------

class _CudnnSdpa:
    """Forward and backward cuDNN frontend graphs for one case, wrapped in an autograd.Function.

    bshd: q/k/v/o are [b, s, h, d] tensors declared to cuDNN as (b, h, s, d) with their strides.
    thd: cuDNN's ragged layout: each tensor is declared (n, h, s_max, d) with bshd strides and a
    ragged offset (cu_seqlens * h * d elements); the buffers hold n * s_max tokens (the capacity
    cuDNN reads bounds from) and the leaves are views of their packed first t tokens.
    (heads, head dim) per tensor: q (hq, d), k (hkv, d), v (hkv, d_v), the output and its gradient
    (hq, d_v).
    """

    def __init__(self, case: Case, inp: Inputs, deterministic: bool):
        import cudnn

        self.cudnn, self.case, self.deterministic = cudnn, case, deterministic
        self.thd = case.layout == "thd"
        self.Q, self.K = (case.hq, case.d), (case.hkv, case.d)
        self.V, self.O = (case.hkv, case.d_v), (case.hq, case.d_v)
        dev, dtype = inp.device, inp.q.dtype
        if dtype != torch.bfloat16 and dtype != torch.float16:
            raise PeerFailure(f"cuDNN SDPA takes fp16/bf16, got {dtype}")
        self.io_type = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        if self.thd:
            n, s = len(case.seqlens), case.s
            self.n, self.s, self.t = n, s, case.tokens

            def packed(src, hd, leaf):
                h, d = hd
                buf = torch.zeros(n * s * h * d, device=dev, dtype=dtype)
                view = buf[: self.t * h * d].view(self.t, h, d)
                view.copy_(src.detach())
                if leaf:
                    view.requires_grad_()
                return buf, view

            self.q_buf, q = packed(inp.q, self.Q, True)
            self.k_buf, k = packed(inp.k, self.K, True)
            self.v_buf, v = packed(inp.v, self.V, True)
            self.do_buf, do = packed(inp.do, self.O, False)
            self.leaves, self.grad_out = (q, k, v), do
            cu = inp.cu_seqlens.to(torch.int64)
            off_type = torch.int64 if cudnn.backend_version() >= 90600 else torch.int32
            self.rag = {hd: (cu * hd[0] * hd[1]).to(off_type).view(n + 1, 1, 1, 1)
                        for hd in (self.Q, self.K, self.V, self.O)}
            self.seq_len = (inp.cu_seqlens[1:] - inp.cu_seqlens[:-1]).to(torch.int32).view(n, 1, 1, 1).contiguous()
            self.max_total = ((self.t + 63) // 64) * 64  # cuDNN's samples round the token total to 64
            b_dims = (n, s)
        else:
            self.leaves, self.grad_out = (inp.q, inp.k, inp.v), inp.do
            b_dims = (case.b, case.s)
        self.stats_shape = (b_dims[0], case.hq, b_dims[1], 1)
        self._build(dev, dtype)

    # bshd-strided (b, h, s, d) view: of a packed buffer (thd) or of a [b, s, h, d] tensor
    def _bhsd(self, x, hd):
        if self.thd:
            h, d = hd
            return x.as_strided((self.n, h, self.s, d), (self.s * h * d, d, h * d, 1))
        return x.permute(0, 2, 1, 3)

    def _sample(self, hd, dev, dtype):
        h, d = hd
        if self.thd:
            return self._bhsd(torch.empty(self.n * self.s * h * d, device=dev, dtype=dtype), hd)
        return torch.empty(self.case.b, self.case.s, h, d, device=dev, dtype=dtype).permute(0, 2, 1, 3)

    def _graph(self):
        cudnn = self.cudnn
        return cudnn.pygraph(io_data_type=self.io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)

    def _mask_kwargs(self, g):
        cudnn = self.cudnn
        kw = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                  diagonal_band_right_bound=0 if self.case.causal else None)
        if self.thd:
            self.t_seq_q, self.t_seq_kv = g.tensor_like(self.seq_len), g.tensor_like(self.seq_len)
            kw.update(use_padding_mask=True, seq_len_q=self.t_seq_q, seq_len_kv=self.t_seq_kv)
        return kw

    def _ragged(self, g, tensor, hd):
        if self.thd:
            off = g.tensor_like(self.rag[hd])
            tensor.set_ragged_offset(off)
            return {off: self.rag[hd]}
        return {}

    @staticmethod
    def _finish(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans(_heuristics())
        g.check_support()
        g.build_plans()

    def _build(self, dev, dtype):
        cudnn, case = self.cudnn, self.case
        scale = _scale(case)
        sq, sk, sv, so = (self._sample(hd, dev, dtype) for hd in (self.Q, self.K, self.V, self.O))
        stats = torch.empty(self.stats_shape, device=dev, dtype=torch.float32)
        # forward
        g = self._graph()
        tq, tk, tv = g.tensor_like(sq), g.tensor_like(sk), g.tensor_like(sv)
        fixed = {}
        for t, hd in ((tq, self.Q), (tk, self.K), (tv, self.V)):
            fixed.update(self._ragged(g, t, hd))
        mask_kw = self._mask_kwargs(g)
        if self.thd:
            fixed.update({self.t_seq_q: self.seq_len, self.t_seq_kv: self.seq_len})
        o, st = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, attn_scale=scale, generate_stats=True, **mask_kw)
        o.set_output(True).set_dim(list(so.shape)).set_stride(list(so.stride()))
        fixed.update(self._ragged(g, o, self.O))
        st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(stats.shape)).set_stride(
            list(stats.stride()))
        self._finish(g)
        self.fwd_graph, self.fwd_tensors, self.fwd_fixed = g, (tq, tk, tv, o, st), fixed
        # backward
        g = self._graph()
        bq, bk, bv, bo, bdo = (g.tensor_like(x) for x in (sq, sk, sv, so, so))
        bst = g.tensor_like(stats)
        fixed = {}
        for t, hd in ((bq, self.Q), (bk, self.K), (bv, self.V), (bo, self.O), (bdo, self.O)):
            fixed.update(self._ragged(g, t, hd))
        mask_kw = self._mask_kwargs(g)
        if self.thd:
            fixed.update({self.t_seq_q: self.seq_len, self.t_seq_kv: self.seq_len})
            mask_kw.update(max_total_seq_len_q=self.max_total, max_total_seq_len_kv=self.max_total)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst,
                                     attn_scale=scale, use_deterministic_algorithm=self.deterministic, **mask_kw)
        for t, x, hd in ((dq, sq, self.Q), (dk, sk, self.K), (dv, sv, self.V)):
            t.set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride()))
            fixed.update(self._ragged(g, t, hd))
        self._finish(g)
        self.bwd_graph, self.bwd_tensors, self.bwd_fixed = g, (bq, bk, bv, bo, bdo, bst, dq, dk, dv), fixed
        self.ws_fwd, self.ws_bwd = self.fwd_graph.get_workspace_size(), self.bwd_graph.get_workspace_size()
        free, _ = torch.cuda.mem_get_info()
        if self.ws_bwd > 0.9 * free:
            raise PeerFailure(f"would OOM: backward workspace {self.ws_bwd / 1e9:.1f} GB > free {free / 1e9:.1f} GB")

    def _new(self, hd, like):
        """An output buffer in the layout the graphs were built for; returns (binding view, user view)."""
        h, d = hd
        if self.thd:
            buf = torch.empty(self.n * self.s * h * d, device=like.device, dtype=like.dtype)
            return self._bhsd(buf, hd), buf[: self.t * h * d].view(self.t, h, d)
        out = torch.empty(self.case.b, self.case.s, h, d, device=like.device, dtype=like.dtype)
        return out.permute(0, 2, 1, 3), out

    def _inputs(self, q, k, v):
        """q, k, v as bound to the graphs: the capacity buffers (thd) or the tensors' (b, h, s, d) views."""
        if self.thd:
            return self._bhsd(self.q_buf, self.Q), self._bhsd(self.k_buf, self.K), self._bhsd(self.v_buf, self.V)
        return tuple(x.permute(0, 2, 1, 3) for x in (q, k, v))

    def forward(self, q, k, v):
        o_bind, o_user = self._new(self.O, q)
        stats = torch.empty(self.stats_shape, device=q.device, dtype=torch.float32)
        tq, tk, tv, to, tst = self.fwd_tensors
        pack = dict(zip((tq, tk, tv), self._inputs(q, k, v)))
        pack.update({to: o_bind, tst: stats})
        pack.update(self.fwd_fixed)
        ws = torch.empty(self.ws_fwd, device=q.device, dtype=torch.uint8)
        self.fwd_graph.execute(pack, ws, handle=self.handle)
        return o_user, o_bind, stats

    def backward(self, q, k, v, o_bind, stats, d_out):
        if self.thd:
            if d_out.data_ptr() != self.do_buf.data_ptr():
                self.do_buf[: d_out.numel()].view_as(d_out).copy_(d_out)
            do_bind = self._bhsd(self.do_buf, self.O)
        else:
            do_bind = d_out.contiguous().permute(0, 2, 1, 3)
        dq_bind, dq = self._new(self.Q, q)
        dk_bind, dk = self._new(self.K, k)
        dv_bind, dv = self._new(self.V, v)
        bq, bk, bv, bo, bdo, bst, tdq, tdk, tdv = self.bwd_tensors
        pack = dict(zip((bq, bk, bv), self._inputs(q, k, v)))
        pack.update({bo: o_bind, bdo: do_bind, bst: stats, tdq: dq_bind, tdk: dk_bind, tdv: dv_bind})
        pack.update(self.bwd_fixed)
        ws = torch.empty(self.ws_bwd, device=q.device, dtype=torch.uint8)
        self.bwd_graph.execute(pack, ws, handle=self.handle)
        return dq, dk, dv

    def runner(self) -> Runner:
        sdpa = self

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                o_user, o_bind, stats = sdpa.forward(q, k, v)
                ctx.save_for_backward(q, k, v, stats)
                ctx.o_bind = o_bind
                return o_user

            @staticmethod
            def backward(ctx, d_out):
                q, k, v, stats = ctx.saved_tensors
                return sdpa.backward(q, k, v, ctx.o_bind, stats, d_out)

        q, k, v = self.leaves
        return Runner(lambda: Fn.apply(q, k, v), self.leaves, self.grad_out,
                      backend=lambda: f"cudnn {self.cudnn.backend_version()} frontend graph",
                      notes=[f"workspace fwd {self.ws_fwd / 1e9:.2f} GB, bwd {self.ws_bwd / 1e9:.2f} GB"])


def _heuristics():
    import cudnn

    return [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]


def _cudnn_fe(case: Case, inp: Inputs, deterministic: bool) -> Union[Runner, str]:
    if inp.device.type != "cuda":
        return "cuDNN frontend SDPA needs a CUDA GPU"
    try:
        importlib.import_module("cudnn")
    except Exception as err:
        return (f"nvidia-cudnn-frontend not importable ({type(err).__name__}: {str(err)[:120]}); "
                "install it with pip install nvidia-cudnn-frontend")
    return _CudnnSdpa(case, inp, deterministic).runner()


def cudnn_fe_det(case, inp):
    """cuDNN frontend SDPA graph, backward with use_deterministic_algorithm=True."""
    return _cudnn_fe(case, inp, deterministic=True)


def cudnn_fe(case, inp):
    return _cudnn_fe(case, inp, deterministic=False)


@dataclass(frozen=True)
class Spec:
    label: str
    role: str  # subject | peer
    deterministic: bool
    factory: Callable[[Case, Inputs], Union[Runner, str]]


TORCH_PEERS: Dict[str, Spec] = {
    "te_fused_det": Spec("TE Triton fused (forced), det", "subject", True, te_fused_det),
    "te_fused": Spec("TE Triton fused (forced)", "subject", False, te_fused),
    "te_dpa_det": Spec("TE DotProductAttention, det", "subject", True, te_dpa_det),
    "te_dpa": Spec("TE DotProductAttention", "subject", False, te_dpa),
    "fa4_det": Spec("flash-attn-4, det", "peer", True, fa4_det),
    "fa4": Spec("flash-attn-4", "peer", False, fa4),
    "cudnn_fe_det": Spec("cuDNN frontend SDPA, det", "peer", True, cudnn_fe_det),
    "cudnn_fe": Spec("cuDNN frontend SDPA", "peer", False, cudnn_fe),
    "torch_flash_det": Spec("torch SDPA flash, deterministic flag", "peer", True, torch_flash_det),
    "torch_flash": Spec("torch SDPA flash", "peer", False, torch_flash),
    "torch_cudnn": Spec("torch SDPA cuDNN", "peer", False, torch_cudnn),
}
