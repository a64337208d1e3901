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

# TransformerEngine API level. Megatron-core 0.19.2 gates (megatron/core/extensions/
# transformer_engine.py unless named), "on" = passes at this level:
#   0.8 tp_comm_overlap ub_* kwargs (only when the user sets tp_comm_overlap; refused here)
#   0.10 DPA attention_type on | 0.11 DPA num_gqa_groups on, LayerNormLinear normalization on
#   0.12 device kwarg on, forward attn_mask_type on | 1.0 context parallel on
#   1.2 window_size, attention_bias on | 1.3 max_seqlen_q/kv on | 1.5 te_checkpoint kwargs on
#   1.6 fp8_dpa/fp8_mha recipe kwargs (FP8: refused) | 1.7 rng_tracker_name on, thd padding masks on
#   1.9 GroupedLinear subclass (constructing it raises) | 1.10 cp_comm_type, softmax_scale,
#   (k, v) channels, cu_seqlens_padded on | 1.12 a2a+p2p cp on | 1.13 TE ops classes (only used
#   when use_te_activation_func / fused_residual_rmsnorm / TEFusedMLP are asked for)
#   2.0/2.2 fp8_utils QuantizedTensor branch (FP8 only) | 2.2 pad_between_seqs on
#   2.3 delay_wgrad_compute, symmetric_ar_type (refused when set), rope module path
#   2.7 router module import (functions refuse when called) | 2.8 softmax_type on
#   2.9 return_max_logit (qk-clip) on | 2.10 num_splits on, cpu offload retain_pinned kwarg
#   2.14 (off) grouped-linear single-parameter paths.
te_api_level = "2.10.0"

__version__ = f"{te_api_level}+da{package_version}"
