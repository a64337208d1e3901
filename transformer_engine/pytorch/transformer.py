"""TransformerLayer: TransformerEngine's transformer block (self attention, cross attention for a decoder, MLP).

Built from :class:`MultiheadAttention` (``self_attention``, ``inter_attention``) and :class:`LayerNormMLP`
(``layernorm_mlp``), plus ``layernorm`` with ``output_layernorm``: TransformerEngine's submodule and parameter
names. The order of sublayers, norms and residual additions is ``transformer_engine.common.modules.LayerStructure``'s
(shared with the JAX frontend); each residual addition is ``residual + drop_path(dropout(out + bias))`` with
``hidden_dropout`` (torch's default generator, as in TransformerEngine) and ``drop_path_rate`` (self attention and
MLP only, as in TransformerEngine).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch

from transformer_engine.common.modules import LayerStructure
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.module.base import resolve_device
from transformer_engine.pytorch.module.layernorm import LayerNorm, RMSNorm
from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP

__all__ = ["DropPath", "TransformerLayer"]


def _probability(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"`{name}` must be a probability in [0, 1), got {value!r}")
    return float(value)


class DropPath(torch.nn.Module):
    """Stochastic depth: in training, each index of the first dim keeps its slice (scaled by ``1 / (1 - p)``)
    with probability ``1 - drop_prob`` and zeroes it otherwise. The first dim is the batch for bshd inputs and,
    as in TransformerEngine, the sequence for sbhd ones. Draws from torch's default generator."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = _probability("drop_prob", drop_prob)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep = 1.0 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.dim() - 1)
        mask = torch.floor(keep + torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device))
        return hidden_state.div(keep) * mask


class TransformerLayer(torch.nn.Module):
    """TransformerEngine's ``TransformerLayer``: constructor and forward signatures, submodules and parameter
    names; the output has the input's shape ([s, b, hidden] for ``attn_input_format="sbhd"``, [b, s, hidden]
    for "bshd", [t, hidden] for "thd").

    Arguments follow TransformerEngine's; ``device=None`` is CUDA when available, else the CPU. With
    ``fuse_qkv_params=False`` (the default) the QKV projection has one parameter per part (``query_weight``,
    ...). ``seq_length`` and ``micro_batch_size`` only size TransformerEngine's JIT warm-up (and
    ``seq_length`` checks a sequence-parallel input's length, as there). Refused by name:
    ``ub_tp_comm_overlap=True`` (userbuffer overlap; the other ``ub_*`` flags only matter with it) and
    ``inference_params`` for a decoder (the KV cache holds self-attention keys); ``fuse_wgrad_accumulation``
    needs ``fuse_qkv_params=True`` (``ValueError``, as in TransformerEngine).

    Dropout: ``attention_dropout`` inside the attention (through ``get_rng_state_tracker`` when given: see
    :class:`MultiheadAttention`), ``hidden_dropout`` and ``drop_path_rate`` on the sublayer outputs, all in
    training mode only.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        get_rng_state_tracker: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        normalization: str = "LayerNorm",
        device: Union[str, int, torch.device, None] = None,
        attn_input_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        if ub_tp_comm_overlap:
            raise NotImplementedError("TransformerLayer: `ub_tp_comm_overlap=True` (userbuffer communication "
                                      "overlap) is not implemented; collectives run through torch.distributed")
        # Checks layer_type and the flags parallel_attention_mlp excludes, with TransformerEngine's rules.
        self.structure = LayerStructure(
            layer_type=layer_type,
            apply_residual_connection_post_layernorm=bool(apply_residual_connection_post_layernorm),
            output_layernorm=bool(output_layernorm), parallel_attention_mlp=bool(parallel_attention_mlp))
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError("`fuse_wgrad_accumulation=True` needs `fuse_qkv_params=True` (the QKV weight as one "
                             "parameter), got fuse_qkv_params=False")
        for arg, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                           ("num_attention_heads", num_attention_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{arg}` must be a positive int, got {value!r}")
        if attn_input_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"`attn_input_format` must be 'sbhd', 'bshd' or 'thd', got {attn_input_format!r}")
        self.hidden_dropout = _probability("hidden_dropout", hidden_dropout)
        drop_path_rate = _probability("drop_path_rate", drop_path_rate)
        device = resolve_device(device)
        if tp_group is not None:
            tp_size = torch.distributed.get_world_size(tp_group)

        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.enc_dec_bottom_right_diagonal = enc_dec_bottom_right_diagonal
        self.layer_number = layer_number
        self.layer_type = layer_type
        self.output_layernorm = bool(output_layernorm)
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.parallel_attention_mlp = bool(parallel_attention_mlp)
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.seq_length = seq_length
        self.get_rng_state_tracker = get_rng_state_tracker
        self.attn_input_format = attn_input_format
        self.softmax_type = softmax_type
        self.name = name
        sub = lambda suffix: None if name is None else f"{name}.{suffix}"  # noqa: E731

        ub = dict(ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False,
                  ub_bulk_wgrad=False)  # off without ub_tp_comm_overlap, as in TransformerEngine
        attention = dict(
            kv_channels=self.kv_channels, attention_dropout=attention_dropout, layernorm_epsilon=layernorm_epsilon,
            init_method=init_method, output_layer_init_method=output_layer_init_method, layer_number=layer_number,
            tp_group=tp_group, tp_size=tp_size, num_gqa_groups=num_gqa_groups,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, get_rng_state_tracker=get_rng_state_tracker,
            sequence_parallel=self.sequence_parallel, params_dtype=params_dtype,
            return_layernorm_output=self.apply_residual_connection_post_layernorm, set_parallel_mode=set_parallel_mode,
            fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved, rotary_pos_interleaved=rotary_pos_interleaved,
            qkv_format=attn_input_format, seq_length=seq_length, micro_batch_size=micro_batch_size,
            softmax_type=softmax_type, bias=bias, normalization=normalization, device=device,
            qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope, **ub)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, attn_mask_type=self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, input_layernorm=self.structure.normalizes_input(
                "self_attention"), attention_type="self", return_bias=not self.parallel_attention_mlp,
            name=sub("self_attention"), **attention)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size, bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                input_layernorm=True, attention_type="cross", return_bias=True, name=sub("inter_attention"),
                **attention)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            tp_group=tp_group, tp_size=tp_size, get_rng_state_tracker=get_rng_state_tracker,
            init_method=init_method, output_layer_init_method=output_layer_init_method, bias=bias,
            return_bias=not self.parallel_attention_mlp, sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype, return_layernorm_output=self.apply_residual_connection_post_layernorm,
            seq_length=seq_length, micro_batch_size=micro_batch_size, set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma, activation=activation, activation_params=activation_params,
            normalization=normalization, device=device, name=sub("layernorm_mlp"), **ub)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if self.output_layernorm:
            norm = RMSNorm if normalization == "RMSNorm" else LayerNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, sequence_parallel=self.sequence_parallel,
                                  params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma, device=device)

    # -- parallel groups ------------------------------------------------------------------------------------

    def set_tensor_parallel_group(self, tp_group: Optional[Any]) -> None:
        """Set the tensor-parallel group of every submodule."""
        for child in self.modules():
            if child is not self and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Context parallelism of the attention sublayers (``MultiheadAttention``'s method)."""
        for attn in (self.self_attention, getattr(self, "inter_attention", None)):
            if attn is not None:
                attn.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    # -- forward --------------------------------------------------------------------------------------------

    def _bias_dropout_add(self, out: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                          drop_path: Optional[DropPath]) -> torch.Tensor:
        if bias is not None and bias.numel():
            from transformer_engine.pytorch.batch_invariance import bias_add

            out = bias_add(out, bias)  # x + bias; in batch-invariant mode, JAX's bias gradient
        out = torch.nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)
        if drop_path is not None:
            out = drop_path(out)
        return residual + out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        self_attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        enc_dec_attn_mask_type: Optional[str] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
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
    ) -> torch.Tensor:
        """The layer on ``hidden_states``. Self attention reads ``attention_mask``, ``self_attn_mask_type``,
        ``window_size``, ``bottom_right_diagonal`` (each defaulting to the constructor's) and ``cu_seqlens_q``
        (also as its keys' boundaries); a decoder's cross attention reads ``encoder_output``, the ``enc_dec_*``
        arguments and ``cu_seqlens_q``/``cu_seqlens_kv``. The other arguments go to both attentions."""
        if self.layer_type == "decoder":
            if encoder_output is None:
                raise ValueError("`encoder_output` must be given for layer_type='decoder', got None")
            if inference_params is not None:
                raise NotImplementedError("`inference_params` with layer_type='decoder' is not implemented: the "
                                          "KV cache holds self-attention keys, not the encoder output's")
        if self.sequence_parallel and self.seq_length is not None \
                and hidden_states.shape[0] != self.seq_length // self.tp_size:
            raise ValueError(f"`hidden_states` must hold this rank's {self.seq_length // self.tp_size} tokens of the "
                             f"sequence (seq_length={self.seq_length} // tp_size={self.tp_size}) in dim 0 with "
                             f"sequence parallelism, got shape {tuple(hidden_states.shape)}")
        hidden_states = hidden_states.contiguous()
        if hidden_states.is_cuda and torch.is_autocast_enabled("cuda"):
            hidden_states = hidden_states.to(torch.get_autocast_dtype("cuda"))

        common = dict(is_first_microbatch=is_first_microbatch, checkpoint_core_attention=checkpoint_core_attention,
                      rotary_pos_emb=rotary_pos_emb, core_attention_bias_type=core_attention_bias_type,
                      core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                      fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs)

        def sublayer(name: str, inp: torch.Tensor):
            """(output, norm output or None); the output is (out, bias) where the sublayer returns its bias."""
            if name == "self_attention":
                outs = self.self_attention(
                    inp, attention_mask=attention_mask,
                    attn_mask_type=self_attn_mask_type if self_attn_mask_type is not None else self.self_attn_mask_type,
                    window_size=window_size if window_size is not None else self.window_size,
                    bottom_right_diagonal=(bottom_right_diagonal if bottom_right_diagonal is not None
                                           else self.bottom_right_diagonal),
                    inference_params=inference_params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_q,
                    cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_q_padded,
                    max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_q, **common)
                with_bias = not self.parallel_attention_mlp
            elif name == "cross_attention":
                outs = self.inter_attention(
                    inp, attention_mask=enc_dec_attn_mask,
                    attn_mask_type=(enc_dec_attn_mask_type if enc_dec_attn_mask_type is not None
                                    else self.enc_dec_attn_mask_type),
                    window_size=enc_dec_window_size if enc_dec_window_size is not None else self.enc_dec_window_size,
                    bottom_right_diagonal=(enc_dec_bottom_right_diagonal if enc_dec_bottom_right_diagonal is not None
                                           else self.enc_dec_bottom_right_diagonal),
                    encoder_output=encoder_output, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                    cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                    max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, **common)
                with_bias = True
            else:
                outs = self.layernorm_mlp(inp, is_first_microbatch=is_first_microbatch)
                with_bias = not self.parallel_attention_mlp
            if not isinstance(outs, tuple):
                outs = (outs,)
            ln_out = outs[-1] if self.structure.returns_norm_output(name) else None
            return (outs[:2] if with_bias else outs[0]), ln_out

        def add(residual: torch.Tensor, out, name: str) -> torch.Tensor:
            out, bias = out if isinstance(out, tuple) else (out, None)
            # As in TransformerEngine: no drop path after cross attention.
            return self._bias_dropout_add(out, bias, residual, None if name == "cross_attention" else self.drop_path)

        return self.structure.run(hidden_states, sublayer, add,
                                  self.layernorm if self.output_layernorm else None)

    def extra_repr(self) -> str:
        return (f"layer_type={self.layer_type!r}, output_layernorm={self.output_layernorm}, "
                f"parallel_attention_mlp={self.parallel_attention_mlp}, attn_input_format={self.attn_input_format!r}")
