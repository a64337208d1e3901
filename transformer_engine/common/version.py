"""Package versions: one source for setup.py, docs and runtime.

Two versions, for two readers:

``package_version``
    This distribution's own version (``deterministic-attention``, SemVer from 0.x up). pip,
    setup.py (through build_tools/version.py) and the docs use it.

``__version__``
    The TransformerEngine API level this package implements, with ``package_version`` as a
    PEP 440 local label: ``"2.10.0+da0.2.0"``. Clients written against NVIDIA TransformerEngine
    (Megatron-core's ``is_te_min_version``/``get_te_version`` read ``transformer_engine.__version__``)
    compare the public part, ``2.10.0``, and choose the arguments they pass by it; the local label
    keeps our own version visible and orders after the bare ``2.10.0``.

``te_api_level``
    The public part alone, ``"2.10.0"``.

Why 2.10.0: it is the highest level at which every Megatron-core 0.19.2 gate that passes an
attention argument passes one DotProductAttention accepts (``num_gqa_groups``,
``attention_type``, ``window_size``, ``cp_comm_type``, ``softmax_scale`` with a ``(k, v)``
channel pair, ``softmax_type``, ``return_max_logit``, ``num_splits``, ``pad_between_seqs``,
``cu_seqlens_*_padded``, ``max_seqlen_*``), and below the 2.14 gates (grouped-linear paths that
are not implemented here). docs/megatron.rst lists every gate checked.
"""

package_version = "0.2.0"

# TransformerEngine API level. Megatron-core 0.19.2 gates checked (megatron/core/extensions/
# transformer_engine.py unless named); "on" = passes at this level and what it passes is supported,
# "refused" = passes, but the feature it enables raises a clear error here when a user asks for it:
#   0.8/1.5/1.6 ub_* overlap kwargs: only with tp_comm_overlap, refused
#   0.10 DPA attention_type: on          0.11 DPA num_gqa_groups, LayerNormLinear normalization: on
#   0.12 modules' device kwarg, DPA forward attn_mask_type: on      1.0 context parallelism: on
#   1.2 window_size, attention_bias: on  1.3 max_seqlen_q/kv: on    1.5 te_checkpoint kwargs (FP8 only)
#   1.6 DelayedScaling fp8_dpa/fp8_mha: FP8, refused               1.7 Linear rng_tracker_name: on
#   1.7 thd padding mask types: on; spec_provider: TE Linear MoE experts (SequentialMLP): on
#   1.8 fp8_interval dropped (FP8)       1.9 TENorm for qk-layernorm (spec_provider, backends): on
#   1.9 TEGroupedLinear subclass defined: constructing GroupedLinear is refused
#   1.10 cp_comm_type, softmax_scale, (k, v) channels, cu_seqlens_*_padded: on; bert b11s mask: on
#   1.12 a2a+p2p context parallelism: on 1.13 TE ops classes (use_te_activation_func,
#   fused_residual_rmsnorm, TEFusedMLP, use_te_op_fuser): pytorch.ops not provided, refused
#   2.0/2.2 fp8_utils QuantizedTensor (isinstance checks only): on; 2.1 FusedAdam
#   store_param_remainders: TE optimizers not provided, Megatron falls back to torch
#   2.2 DPA pad_between_seqs: on         2.3 delay_wgrad_compute, symmetric_ar_type: refused
#   2.3 rope module path, interleaved fused RoPE: no fused RoPE module, Megatron reports it
#   2.6 MoE activation recompute with FP8: FP8, refused
#   2.7 router module (fused top-k, aux-loss scores and loss): on; cross entropy
#   is_cg_capturable kwarg: on (accepted, no effect)
#   2.8 DPA softmax_type: on             2.9 DPA return_max_logit (qk-clip): on
#   2.10 DPA num_splits: on; cpu offload retain_pinned kwarg (cpu_offload not provided)
#   2.14 single grouped weight/bias, TEFusedMLPWithGroupedLinear: off (not implemented here)
te_api_level = "2.10.0"

__version__ = f"{te_api_level}+da{package_version}"
