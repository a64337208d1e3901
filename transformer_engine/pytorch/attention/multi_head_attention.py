"""MultiheadAttention: TransformerEngine's attention block (QKV projection, RoPE, attention, output projection).

The block is built from the package's modules, named as TransformerEngine names them, so state dicts carry over:

- self attention: ``layernorm_qkv`` (:class:`LayerNormLinear`, with ``input_layernorm``) or ``qkv``
  (:class:`Linear`) projecting to ``num_attention_heads + 2 * num_gqa_groups`` heads; cross attention:
  ``layernorm_query`` or ``query_layer`` on ``hidden_states`` and ``key_value`` on ``encoder_output``;
- ``core_attention`` (:class:`DotProductAttention`) and ``proj`` (:class:`Linear`);
- ``q_norm`` / ``k_norm`` with ``qk_norm_type``.

Without ``fuse_qkv_params`` the projection keeps one parameter per part (``query_weight``, ``key_weight``,
``value_weight``, ...: ``parameters_split``) and its output is ``[q | k | v]``. With it the weight is one
parameter whose output, with ``qkv_weight_interleaved`` (the default), holds per key/value group ``g`` that
group's query heads then its key and value head: ``[g0: q.., k, v | g1: ...]``. Query head ``j`` attends with
key/value head ``j // (num_attention_heads // num_gqa_groups)`` in both layouts.

Tensor parallelism (``set_parallel_mode=True``): the projections into heads are column parallel and ``proj`` row
parallel, so each rank holds ``num_attention_heads / tp_size`` query heads and ``num_gqa_groups / tp_size``
key/value heads; ``sequence_parallel`` splits ``hidden_states`` along the sequence, as the linear modules do.
The QK norms' weights are replicated and each rank normalizes its own heads, so (as in TransformerEngine) each
rank's gradient of ``q_norm``/``k_norm`` covers its heads only: sum it over the tensor-parallel group, as for
sequence-parallel norm weights.

KV cache: with ``inference_params`` the call's tokens are a generation step's new ones; their keys and values
go to layer ``layer_number``'s cache (allocated on first use) and rotary positions start at each sequence's
cached length (``inference_params.get_seqlens_pre_step()``). The attention of each row is bitwise the training
forward's row (``DotProductAttention``); the norms, RoPE and the projections work row by row, so a decoded
row equals the training row when the GEMMs and norms give a row the same bits whatever the number of rows: in
batch-invariant mode (``NVTE_BATCH_INVARIANT=1`` or ``transformer_engine.pytorch.batch_invariant()``); by
default cuBLAS and CPU BLAS may sum a row differently for different row counts.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional, Tuple, Union

import torch

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
from transformer_engine.pytorch.module.base import check_normalization, resolve_device
from transformer_engine.pytorch.module.layernorm import LayerNorm, RMSNorm
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.ops.basic.l2normalization import L2Normalization

__all__ = ["MultiheadAttention"]

_QK_NORMS = (None, "L2Normalization", "RMSNorm", "LayerNorm")


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _refuse_ub(owner: str, **flags: bool) -> None:
    for name, value in flags.items():
        if value:
            raise NotImplementedError(f"{owner}: `{name}=True` (userbuffer communication overlap) is not "
                                      "implemented; collectives run through torch.distributed")


class MultiheadAttention(torch.nn.Module):
    """TransformerEngine's ``MultiheadAttention``: constructor and forward signatures, parameter names and
    outputs (``out``, then the projection's bias with ``return_bias``, then the norm's output with
    ``input_layernorm`` and ``return_layernorm_output``). See the module docstring for the layouts.

    Arguments follow TransformerEngine's; ``device=None`` is CUDA when available, else the CPU. Accepted with
    no effect: ``seq_length`` and ``micro_batch_size`` (TransformerEngine warms up JIT kernels with them).
    Refused by name (``NotImplementedError``): the ``ub_*`` userbuffer overlaps, and what the submodules
    refuse (FP8 output tensors, ``fuse_wgrad_accumulation`` without ``fuse_qkv_params``). ``inference_params``
    with ``attention_type="cross"`` is refused: the KV cache holds a layer's self-attention keys.

    ``attention_dropout`` is applied by ``core_attention`` in training mode, drawing from
    ``get_rng_state_tracker().fork()`` when a tracker is given, so a run under the same tracker states
    reproduces the same dropout masks.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        num_gqa_groups: Optional[int] = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        sequence_parallel: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Union[str, int, torch.device, None] = None,
        qkv_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        _refuse_ub(owner, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                   ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad)
        _positive_int("hidden_size", hidden_size)
        _positive_int("num_attention_heads", num_attention_heads)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"`attention_type` must be 'self' or 'cross', got {attention_type!r}")
        if layer_number is not None:
            _positive_int("layer_number", layer_number)
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(f"`hidden_size` ({hidden_size}) must be divisible by num_attention_heads="
                                 f"{num_attention_heads} when `kv_channels` is None")
            kv_channels = hidden_size // num_attention_heads
        _positive_int("kv_channels", kv_channels)
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(num_gqa_groups, int) or num_gqa_groups < 1 or num_attention_heads % num_gqa_groups:
            raise ValueError(f"`num_gqa_groups` must be a positive divisor of num_attention_heads="
                             f"{num_attention_heads}, got {num_gqa_groups!r}")
        check_normalization(owner, normalization)
        if qk_norm_type not in _QK_NORMS:
            raise ValueError(f"`qk_norm_type` must be one of {_QK_NORMS}, got {qk_norm_type!r}")
        if tp_group is not None:
            tp_size = torch.distributed.get_world_size(tp_group)
        _positive_int("tp_size", tp_size)
        if num_attention_heads % tp_size or num_gqa_groups % tp_size:
            raise ValueError(f"`tp_size` ({tp_size}) must divide num_attention_heads={num_attention_heads} and "
                             f"num_gqa_groups={num_gqa_groups}")
        if not fuse_qkv_params:
            qkv_weight_interleaved = False  # one parameter per part: [q | k | v]
        device = resolve_device(device)

        self.hidden_size = hidden_size
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm = bool(input_layernorm)
        self.attention_type = attention_type
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.num_attention_heads_per_partition = num_attention_heads // tp_size
        self.num_gqa_groups_per_partition = num_gqa_groups // tp_size
        self.hidden_size_per_attention_head = kv_channels
        self.hidden_size_q = kv_channels * num_attention_heads
        self.hidden_size_kv = kv_channels * num_gqa_groups
        self.fuse_qkv_params = bool(fuse_qkv_params)
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved)
        self.rotary_pos_interleaved = bool(rotary_pos_interleaved)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        self.softmax_type = softmax_type
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size  # JIT warm-up sizes: unused
        self.name = name
        self.cp_size, self.cp_rank = 1, 0

        sub = lambda suffix: None if name is None else f"{name}.{suffix}"  # noqa: E731
        gemm = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
                    get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                    params_dtype=self.params_dtype, device=device)
        column = "column" if set_parallel_mode else None
        norm = dict(eps=layernorm_epsilon, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                    return_layernorm_output=return_layernorm_output)

        # Registered first, as TransformerEngine registers them (the state dict's order).
        if qk_norm_type == "L2Normalization":
            # Parameter-free: one instance serves both, as in TransformerEngine.
            self.q_norm = self.k_norm = L2Normalization(eps=qk_norm_eps, seq_length=seq_length,
                                                        micro_batch_size=micro_batch_size)
        elif qk_norm_type is not None:
            cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
            self.q_norm, self.k_norm = (cls(kv_channels, eps=qk_norm_eps, device=device, params_dtype=params_dtype)
                                        for _ in range(2))
        else:
            self.q_norm = self.k_norm = None

        if attention_type == "self":
            width = self.hidden_size_q + 2 * self.hidden_size_kv
            split = None if fuse_qkv_params else collections.OrderedDict(
                [("query", self.hidden_size_q), ("key", self.hidden_size_kv), ("value", self.hidden_size_kv)])
            if self.input_layernorm:
                self.layernorm_qkv = LayerNormLinear(hidden_size, width, init_method=init_method, bias=bias,
                                                     parallel_mode=column, parameters_split=split,
                                                     ub_name="qkv", name=sub("layernorm_linear_qkv"), **norm, **gemm)
            else:
                self.qkv = Linear(hidden_size, width, init_method=init_method, bias=bias, parallel_mode=column,
                                  parameters_split=split, name=sub("linear_qkv"), **gemm)
        else:
            if self.input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size, self.hidden_size_q, init_method=init_method, bias=bias, parallel_mode=column,
                    parameters_split=None if fuse_qkv_params else ("query",), ub_name="qkv",
                    name=sub("layernorm_linear_q"), **norm, **gemm)
            else:
                self.query_layer = Linear(hidden_size, self.hidden_size_q, init_method=init_method, bias=bias,
                                          parallel_mode=column, **gemm)
            self.key_value = Linear(hidden_size, 2 * self.hidden_size_kv, init_method=init_method, bias=bias,
                                    parallel_mode=column, parameters_split=None if fuse_qkv_params else ("key", "value"),
                                    name=sub("linear_kv"), **gemm)

        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel, tp_group=tp_group,
            layer_number=self.layer_number, attention_type=attention_type, softmax_type=softmax_type,
            name=sub("core_attention"))
        self.proj = Linear(self.hidden_size_q, hidden_size, init_method=output_layer_init_method, bias=bias,
                           return_bias=return_bias, parallel_mode="row" if set_parallel_mode else None,
                           ub_name="proj", name=sub("proj"), **gemm)

    # -- parallel groups ------------------------------------------------------------------------------------

    def set_tensor_parallel_group(self, tp_group: Optional[Any]) -> None:
        """Set the tensor-parallel group of every projection (Megatron builds modules before torch.distributed)."""
        self.tp_group = tp_group
        for child in self.modules():
            if child is not self and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Context parallelism of ``core_attention`` (its method's arguments); RoPE then rotates each rank's
        tokens at their positions in the load-balanced split."""
        if cp_group is None:
            self.cp_size, self.cp_rank = 1, 0
        elif isinstance(cp_group, (list, tuple)):  # a2a+p2p: [a2a group, p2p group]
            a2a, p2p = cp_group
            size_a2a = torch.distributed.get_world_size(a2a)
            self.cp_size = size_a2a * torch.distributed.get_world_size(p2p)
            self.cp_rank = size_a2a * torch.distributed.get_rank(p2p) + torch.distributed.get_rank(a2a)
        else:
            self.cp_size = torch.distributed.get_world_size(cp_group)
            self.cp_rank = torch.distributed.get_rank(cp_group)
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    # -- forward --------------------------------------------------------------------------------------------

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., heads * d] (or heads already split) as [s, b, heads, d] / [t, heads, d]."""
        lead = 1 if self.qkv_format == "thd" else 2
        return x.reshape(*x.shape[:lead], -1, self.hidden_size_per_attention_head)

    def _self_qkv(self, mixed: torch.Tensor):
        """q, k, v of the self-attention projection's output (this rank's heads)."""
        d = self.hidden_size_per_attention_head
        groups = self.num_gqa_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        if self.qkv_weight_interleaved:  # per group: its query heads, then its key and value head
            mixed = mixed.view(*mixed.shape[:-1], groups, per_group + 2, d)
            q, k, v = mixed.split((per_group, 1, 1), dim=-2)
        else:  # [q | k | v]
            mixed = mixed.view(*mixed.shape[:-1], per_group + 2, groups, d)
            q, k, v = mixed.split((per_group, 1, 1), dim=-3)
        return self._heads(q), self._heads(k), self._heads(v)

    def _cross_kv(self, mixed: torch.Tensor):
        d = self.hidden_size_per_attention_head
        groups = self.num_gqa_groups_per_partition
        if self.qkv_weight_interleaved:  # per group: its key head then its value head
            k, v = mixed.view(*mixed.shape[:-1], groups, 2 * d).split((d, d), dim=-1)
        else:  # [k | v]
            k, v = mixed.view(*mixed.shape[:-1], 2 * groups, d).split((groups, groups), dim=-2)
        return self._heads(k), self._heads(v)

    def _rotary(self, q, k, rotary_pos_emb, inference_params, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                cu_seqlens_kv_padded, pad_between_seqs):
        q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        if pad_between_seqs:
            cu_seqlens_q, cu_seqlens_kv = cu_seqlens_q_padded, cu_seqlens_kv_padded
        start = None
        if inference_params is not None:
            # Each sequence's new tokens continue at its cached length (step order).
            start = inference_params.get_seqlens_pre_step()
            if self.qkv_format == "thd":
                if cu_seqlens_q is None:
                    cu_seqlens_q = cu_seqlens_kv = inference_params.cu_seqlens_q
            else:
                start = start[:q.shape[1 if self.qkv_format == "sbhd" else 0]]
        rope = dict(fused=True, cp_size=self.cp_size, cp_rank=self.cp_rank, start_positions=start,
                    interleaved=self.rotary_pos_interleaved)
        q = apply_rotary_pos_emb(q, q_emb, self.qkv_format, cu_seqlens=cu_seqlens_q, **rope)
        k = apply_rotary_pos_emb(k, k_emb, self.qkv_format, cu_seqlens=cu_seqlens_kv, **rope)
        return q, k

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        encoder_output: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params: Optional[InferenceParams] = None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: Optional[bool] = None,
    ):
        """Attention of ``hidden_states`` ([s, b, hidden] for sbhd, [b, s, hidden] for bshd, [t, hidden] for
        thd): to itself, or to ``encoder_output`` for cross attention. The mask, window, bias and sequence
        arguments are ``DotProductAttention``'s (``attn_mask_type``, ``window_size`` and
        ``bottom_right_diagonal`` default to the constructor's). ``rotary_pos_emb``: the angles of
        ``RotaryPositionEmbedding`` ([s, 1, 1, d2]), or a (query, key) pair of them, applied with the fused
        rotation. Returns ``out``, ``(out, bias)``, ``(out, ln_out)`` or ``(out, bias, ln_out)`` as
        TransformerEngine does."""
        if self.attention_type == "cross":
            if encoder_output is None:
                raise ValueError("`encoder_output` must be given for attention_type='cross', got None")
            if inference_params is not None:
                raise NotImplementedError("`inference_params` with attention_type='cross' is not implemented: the "
                                          "KV cache holds a layer's self-attention keys and values")
        if inference_params is not None:
            if self.layer_number not in inference_params.cache_manager.cache:
                inference_params.allocate_memory(self.layer_number)
        if rotary_pos_emb is not None and isinstance(rotary_pos_emb, (list, tuple)):
            if len(rotary_pos_emb) != 2:
                raise ValueError("`rotary_pos_emb` must be a tensor or a (query, key) pair of tensors, got "
                                 f"{len(rotary_pos_emb)} items")
            rotary_pos_emb = tuple(rotary_pos_emb)

        ln_out = None
        if self.attention_type == "self":
            if self.input_layernorm:
                mixed = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
                if self.return_layernorm_output:
                    mixed, ln_out = mixed
            else:
                mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
            q, k, v = self._self_qkv(mixed)
        else:
            k, v = self._cross_kv(self.key_value(encoder_output, is_first_microbatch=is_first_microbatch))
            if self.input_layernorm:
                q = self.layernorm_query(hidden_states, is_first_microbatch=is_first_microbatch)
                if self.return_layernorm_output:
                    q, ln_out = q
            else:
                q = self.query_layer(hidden_states, is_first_microbatch=is_first_microbatch)
            q = self._heads(q)

        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            q, k = self._rotary(q, k, rotary_pos_emb, inference_params, cu_seqlens_q, cu_seqlens_kv,
                                cu_seqlens_q_padded, cu_seqlens_kv_padded, pad_between_seqs)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)

        context = self.core_attention(
            q, k, v, attention_mask=attention_mask, qkv_format=self.qkv_format, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type if attn_mask_type is not None else self.attn_mask_type,
            window_size=window_size if window_size is not None else self.window_size,
            bottom_right_diagonal=(bottom_right_diagonal if bottom_right_diagonal is not None
                                   else self.bottom_right_diagonal),
            checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill,
            inference_params=inference_params, pad_between_seqs=pad_between_seqs)

        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        outputs = out if self.return_bias else (out,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs = outputs + (ln_out,)
        return outputs if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_attention_heads}, "
                f"gqa_groups={self.num_gqa_groups}, kv_channels={self.hidden_size_per_attention_head}, "
                f"attention_type={self.attention_type!r}, input_layernorm={self.input_layernorm}, "
                f"qkv_format={self.qkv_format!r}, tp_size={self.tp_size}")
