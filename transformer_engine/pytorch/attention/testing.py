"""Test and benchmark scaffolding for context parallelism: every rank of a CP call in one process."""

from __future__ import annotations

from transformer_engine.common.attention import QKVFormat
from transformer_engine.pytorch.attention.buffers import host_values
from transformer_engine.pytorch.attention.context_parallel import (FusedSpec, SeqSplit, _seq_dim, assemble,
                                                                   fused_backward_step, fused_forward_step,
                                                                   local_tokens, tile_alignment)

__all__ = ["run_ranks_in_one_process", "split_of_globals"]


def split_of_globals(q, fmt: QKVFormat, cp: int, cu_seqlens=None, cu_seqlens_padded=None) -> SeqSplit:
    """Rank 0's :class:`SeqSplit` of global (whole-sequence) tensors; ``with_rank`` gives the others."""
    if fmt == QKVFormat.THD:
        padded = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        bounds = [int(x) for x in host_values(padded)]
        lengths = [int(x) for x in host_values(cu_seqlens[1:] - cu_seqlens[:-1])]
        return SeqSplit(fmt, cp, 0, starts=tuple(bounds[:-1]),
                        padded=tuple(e - s for s, e in zip(bounds[:-1], bounds[1:])), lengths=tuple(lengths))
    return SeqSplit(fmt, cp, 0, seqlen=q.shape[_seq_dim(fmt)])


def run_ranks_in_one_process(q, k, v, d_out, fmt: str, cp: int, causal: bool, softmax_scale: float,
                             deterministic: bool = True, cu_seqlens=None, cu_seqlens_padded=None):
    """Every rank's "all_gather"/"p2p" steps on one device, the exchanges as tensor copies: from the global
    q, k, v, d_out (global order) to the global (out, dq, dk, dv) assembled from the ranks' tokens."""
    qkv_format = QKVFormat(fmt)
    sd = _seq_dim(qkv_format)
    base = split_of_globals(q, qkv_format, cp, cu_seqlens, cu_seqlens_padded)
    spec = FusedSpec(softmax_scale, causal, deterministic, tile_alignment(q, k, v, qkv_format, causal, deterministic))
    splits = [base.with_rank(r) for r in range(cp)]
    lse_dim = 1 if base.is_thd else 2
    outs, lses = zip(*(fused_forward_step(local_tokens(q, sd, s), k, v, s, spec) for s in splits))
    out_g, lse_g = assemble(outs, sd, base), assemble(lses, lse_dim, base)
    grads = [fused_backward_step(q, k, v, out_g, d_out, lse_g, s, spec) for s in splits]
    dq, dk, dv = (assemble([g[j] for g in grads], sd, base) for j in range(3))
    return out_g, dq, dk, dv
