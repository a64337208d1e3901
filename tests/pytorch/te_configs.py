"""TransformerEngine's PyTorch attention test configurations, as data, and the cases its tests build.

The rows are the public ModelConfig tables of TransformerEngine's ``tests/pytorch/attention/
test_attention.py`` (b, s_q, h, d_qk first, then keywords); ``cases()`` lists (table, row, dtype,
qkv_layout, pad_between_seqs, swa) the way each of its test functions parametrizes them. FP8,
context-parallel and layer tables are left out (no FP8 or CP here yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Tuple


@dataclass(frozen=True)
class Row:
    batch_size: int
    max_seqlen_q: int
    num_heads: int
    head_dim_qk: int
    max_seqlen_kv: Optional[int] = None
    num_gqa_groups: Optional[int] = None
    head_dim_v: Optional[int] = None
    softmax_type: str = "vanilla"
    dropout_p: float = 0.0
    attn_mask_type: str = "no_mask"
    attn_bias_type: str = "no_bias"
    alibi_type: str = "none"
    bias_shape: str = "1hss"
    window_size: Tuple[int, int] = (-1, -1)
    return_max_logit: bool = False
    num_splits: int = 1

    @property
    def seqlen_kv(self) -> int:
        return self.max_seqlen_q if self.max_seqlen_kv is None else self.max_seqlen_kv

    @property
    def heads_kv(self) -> int:
        return self.num_heads if self.num_gqa_groups is None else self.num_gqa_groups

    @property
    def dim_v(self) -> int:
        return self.head_dim_qk if self.head_dim_v is None else self.head_dim_v

    @property
    def is_cross(self) -> bool:
        return self.seqlen_kv != self.max_seqlen_q


TABLES = {
    'base': {
        'base_1_0': Row(8, 128, 16, 64),
        'base_1_1': Row(4, 128, 16, 64, max_seqlen_kv=256),
        'base_2_0': Row(2, 2048, 24, 128),
        'base_2_1': Row(1, 2048, 24, 128, max_seqlen_kv=4096),
        'base_3_0': Row(8, 1, 16, 128, max_seqlen_kv=2048),
        'base_3_1': Row(8, 1, 16, 256, max_seqlen_kv=2048),
        'base_4_0': Row(8, 1, 16, 192, max_seqlen_kv=2048),
        'base_4_1': Row(8, 128, 16, 192, max_seqlen_kv=2048),
        'base_5_0': Row(8, 1, 16, 512, max_seqlen_kv=2048),
        'base_5_1': Row(8, 128, 16, 512, max_seqlen_kv=2048),
        'base_6_0': Row(8, 1, 16, 1024, max_seqlen_kv=2048),
        'base_6_1': Row(8, 128, 16, 1024, max_seqlen_kv=2048),
    },
    'max_logit': {
        'max_logit_1': Row(1, 2048, 24, 128, max_seqlen_kv=4096),
        'max_logit_2': Row(2, 2048, 24, 128, attn_mask_type='causal'),
        'max_logit_3': Row(2, 1, 16, 128, max_seqlen_kv=2048, attn_mask_type='padding_causal'),
        'max_logit_4': Row(8, 128, 16, 192, max_seqlen_kv=2048, attn_bias_type='post_scale_bias'),
        'max_logit_5': Row(8, 128, 16, 512, max_seqlen_kv=2048, attn_mask_type='causal', window_size=(20, 0)),
        'max_logit_6': Row(8, 1, 16, 1024, max_seqlen_kv=2048),
    },
    'num_splits': {
        'num_splits_1_0': Row(2, 2048, 24, 128, num_splits=2),
        'num_splits_1_1': Row(1, 2048, 24, 128, max_seqlen_kv=4096, num_splits=4),
    },
    'd256': {
        'd256_no_mask': Row(2, 512, 16, 256),
        'd256_padding': Row(2, 512, 16, 256, attn_mask_type='padding'),
        'd256_causal_swa': Row(2, 1024, 16, 256, attn_mask_type='causal', window_size=(128, 0)),
        'd256_padding_causal_gqa': Row(2, 1024, 16, 256, num_gqa_groups=4, attn_mask_type='padding_causal'),
    },
    'softmax': {
        'softmax_1_0': Row(2, 2048, 64, 64, num_gqa_groups=8),
        'softmax_1_1': Row(2, 2048, 64, 64, num_gqa_groups=8, softmax_type='off-by-one'),
        'softmax_1_2': Row(2, 2048, 64, 64, num_gqa_groups=8, softmax_type='learnable'),
        'softmax_2_0': Row(2, 2048, 64, 64, num_gqa_groups=8, attn_mask_type='causal'),
        'softmax_2_1': Row(2, 2048, 64, 64, num_gqa_groups=8, attn_mask_type='causal', softmax_type='off-by-one'),
        'softmax_2_2': Row(2, 2048, 64, 64, num_gqa_groups=8, attn_mask_type='causal', softmax_type='learnable'),
        'softmax_3_0': Row(2, 2048, 64, 64, num_gqa_groups=8, attn_mask_type='padding'),
        'softmax_3_1': Row(2, 2048, 64, 64, num_gqa_groups=8, attn_mask_type='padding', softmax_type='off-by-one'),
        'softmax_3_2': Row(2, 2048, 64, 64, num_gqa_groups=8, attn_mask_type='padding', softmax_type='learnable'),
        'softmax_4_0': Row(2, 2048, 64, 64, num_gqa_groups=8, window_size=(128, 0), attn_mask_type='causal'),
        'softmax_4_1': Row(2, 2048, 64, 64, num_gqa_groups=8, window_size=(128, 0), attn_mask_type='causal', softmax_type='off-by-one'),
        'softmax_4_2': Row(2, 2048, 64, 64, num_gqa_groups=8, window_size=(128, 0), attn_mask_type='causal', softmax_type='learnable'),
        'softmax_5_0': Row(2, 2048, 64, 64, num_gqa_groups=8, window_size=(128, 0), attn_mask_type='padding_causal'),
        'softmax_5_1': Row(2, 2048, 64, 64, num_gqa_groups=8, window_size=(128, 0), attn_mask_type='padding_causal', softmax_type='off-by-one'),
        'softmax_5_2': Row(2, 2048, 64, 64, num_gqa_groups=8, window_size=(128, 0), attn_mask_type='padding_causal', softmax_type='learnable'),
    },
    'mla': {
        'mla_1_0': Row(8, 128, 16, 64, head_dim_v=128),
        'mla_1_1': Row(4, 128, 16, 64, max_seqlen_kv=256, head_dim_v=128),
        'mla_1_2': Row(4, 128, 16, 192, max_seqlen_kv=256, head_dim_v=128),
        'mla_2_0': Row(2, 2048, 24, 128, attn_mask_type='causal', head_dim_v=64),
        'mla_2_1': Row(1, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal', head_dim_v=64),
        'mla_2_2': Row(1, 2048, 24, 192, max_seqlen_kv=4096, attn_mask_type='causal', head_dim_v=128),
        'mla_3_0': Row(8, 1, 16, 128, max_seqlen_kv=2048, head_dim_v=64),
        'mla_3_1': Row(8, 1, 16, 256, max_seqlen_kv=2048, head_dim_v=128),
        'mla_3_2': Row(8, 1, 16, 192, max_seqlen_kv=2048, head_dim_v=128),
        'mla_3_3': Row(8, 1, 16, 160, max_seqlen_kv=2048, head_dim_v=128),
        'mla_3_4': Row(8, 1, 16, 160, max_seqlen_kv=2048, head_dim_v=160),
    },
    'mask': {
        'mask_1_0': Row(2, 2048, 16, 64, attn_mask_type='causal'),
        'mask_1_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='causal'),
        'mask_1_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal'),
        'mask_2_0': Row(2, 2048, 16, 64, attn_mask_type='causal_bottom_right'),
        'mask_2_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='causal_bottom_right'),
        'mask_2_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal_bottom_right'),
        'mask_3_0': Row(2, 2048, 16, 64, attn_mask_type='padding'),
        'mask_3_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding'),
        'mask_3_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding'),
        'mask_4_0': Row(2, 2048, 16, 64, attn_mask_type='padding_causal'),
        'mask_4_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding_causal'),
        'mask_4_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal'),
        'mask_5_0': Row(2, 2048, 16, 64, attn_mask_type='padding_causal_bottom_right'),
        'mask_5_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding_causal_bottom_right'),
        'mask_5_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal_bottom_right'),
        'mask_6_0': Row(2, 1, 16, 128, max_seqlen_kv=2048, attn_mask_type='causal'),
        'mask_6_1': Row(2, 1, 16, 256, max_seqlen_kv=2048, attn_mask_type='causal'),
        'mask_7_0': Row(2, 1, 16, 128, max_seqlen_kv=2048, attn_mask_type='causal_bottom_right'),
        'mask_7_1': Row(2, 1, 16, 256, max_seqlen_kv=2048, attn_mask_type='causal_bottom_right'),
        'mask_8_0': Row(2, 1, 24, 128, max_seqlen_kv=2048, attn_mask_type='padding'),
        'mask_8_1': Row(2, 1, 16, 256, max_seqlen_kv=2048, attn_mask_type='padding'),
        'mask_9_0': Row(2, 1, 24, 128, max_seqlen_kv=2048, attn_mask_type='padding_causal'),
        'mask_9_1': Row(2, 1, 16, 256, max_seqlen_kv=2048, attn_mask_type='padding_causal'),
        'mask_10_0': Row(2, 1, 24, 128, max_seqlen_kv=2048, attn_mask_type='padding_causal_bottom_right'),
        'mask_10_1': Row(2, 1, 16, 256, max_seqlen_kv=2048, attn_mask_type='padding_causal_bottom_right'),
    },
    'bias': {
        'bias_1_0': Row(4, 128, 16, 64, attn_bias_type='post_scale_bias'),
        'bias_1_1': Row(2, 128, 16, 64, max_seqlen_kv=256, attn_bias_type='post_scale_bias'),
        'bias_1_2': Row(4, 2048, 24, 128, attn_bias_type='post_scale_bias'),
        'bias_1_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_bias_type='post_scale_bias'),
        'bias_1_4': Row(4, 2048, 24, 128, attn_bias_type='alibi'),
        'bias_1_5': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_bias_type='alibi'),
        'bias_2_0': Row(4, 128, 16, 64, attn_mask_type='padding', attn_bias_type='post_scale_bias'),
        'bias_2_1': Row(2, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='padding', attn_bias_type='post_scale_bias'),
        'bias_2_2': Row(4, 2048, 24, 128, attn_mask_type='padding', attn_bias_type='post_scale_bias'),
        'bias_2_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding', attn_bias_type='post_scale_bias'),
        'bias_2_4': Row(4, 2048, 24, 128, attn_mask_type='padding', attn_bias_type='alibi'),
        'bias_2_5': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding', attn_bias_type='alibi'),
        'bias_3_0': Row(4, 128, 16, 64, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
        'bias_3_1': Row(2, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
        'bias_3_2': Row(4, 2048, 24, 128, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
        'bias_3_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
        'bias_3_4': Row(4, 2048, 24, 128, attn_mask_type='causal', attn_bias_type='alibi'),
        'bias_3_5': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal', attn_bias_type='alibi'),
        'bias_4_0': Row(4, 128, 16, 64, attn_mask_type='padding_causal', attn_bias_type='post_scale_bias'),
        'bias_4_1': Row(2, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='padding_causal', attn_bias_type='post_scale_bias'),
        'bias_4_2': Row(4, 2048, 24, 128, attn_mask_type='padding_causal', attn_bias_type='post_scale_bias'),
        'bias_4_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal', attn_bias_type='post_scale_bias'),
        'bias_4_4': Row(4, 2048, 24, 128, attn_mask_type='padding_causal', attn_bias_type='alibi'),
        'bias_4_5': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal', attn_bias_type='alibi'),
    },
    'bias_shapes': {
        'bias_1_0': Row(4, 128, 16, 64, attn_bias_type='post_scale_bias', bias_shape='11ss'),
        'bias_1_1': Row(2, 128, 16, 64, attn_bias_type='post_scale_bias', bias_shape='1hss'),
        'bias_1_2': Row(4, 2048, 24, 128, attn_bias_type='post_scale_bias', bias_shape='b1ss'),
        'bias_1_3': Row(2, 2048, 24, 128, attn_bias_type='post_scale_bias', bias_shape='bhss'),
        'bias_1_4': Row(2, 2048, 24, 128, attn_bias_type='post_scale_bias', bias_shape='111s'),
        'bias_1_5': Row(4, 2048, 24, 128, attn_mask_type='causal', attn_bias_type='alibi', bias_shape='1hss', alibi_type='custom'),
        'bias_1_6': Row(2, 2048, 24, 128, attn_mask_type='causal', attn_bias_type='alibi', bias_shape='bhss', alibi_type='custom'),
    },
    'swa': {
        'swa_1_1': Row(2, 2048, 16, 64),
        'swa_1_2': Row(2, 2048, 24, 128, num_gqa_groups=4),
        'swa_1_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096),
        'swa_2_1': Row(2, 2048, 16, 64, attn_mask_type='causal'),
        'swa_2_2': Row(2, 2048, 24, 128, num_gqa_groups=4, attn_mask_type='causal'),
        'swa_2_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal'),
        'swa_3_1': Row(2, 2048, 16, 64, attn_mask_type='causal_bottom_right'),
        'swa_3_2': Row(2, 2048, 24, 128, num_gqa_groups=4, attn_mask_type='causal_bottom_right'),
        'swa_3_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='causal_bottom_right'),
        'swa_4_1': Row(2, 2048, 16, 64, attn_mask_type='padding'),
        'swa_4_2': Row(2, 2048, 24, 128, num_gqa_groups=4, attn_mask_type='padding'),
        'swa_4_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding'),
        'swa_5_1': Row(2, 2048, 16, 64, attn_mask_type='padding_causal'),
        'swa_5_2': Row(2, 2048, 24, 128, num_gqa_groups=4, attn_mask_type='padding_causal'),
        'swa_5_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal'),
        'swa_6_1': Row(2, 2048, 16, 64, attn_mask_type='padding_causal_bottom_right'),
        'swa_6_2': Row(2, 2048, 24, 128, num_gqa_groups=4, attn_mask_type='padding_causal_bottom_right'),
        'swa_6_3': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal_bottom_right'),
    },
    'alibi_slopes': {
        'alibi_1_0': Row(2, 128, 16, 64, attn_mask_type='causal', attn_bias_type='alibi', alibi_type='vanilla'),
        'alibi_1_1': Row(1, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='causal', attn_bias_type='alibi', alibi_type='vanilla'),
        'alibi_2_0': Row(2, 1024, 24, 128, attn_mask_type='causal', attn_bias_type='alibi', alibi_type='custom'),
        'alibi_2_1': Row(1, 1024, 24, 128, max_seqlen_kv=2048, attn_mask_type='causal', attn_bias_type='alibi', alibi_type='custom'),
    },
    'layout': {
        'layout_0_0': Row(2, 128, 16, 64),
        'layout_0_1': Row(2, 128, 16, 64, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
        'layout_0_2': Row(1, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='padding'),
        'layout_0_3': Row(1, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='padding_causal', attn_bias_type='post_scale_bias'),
        'layout_1_0': Row(2, 2048, 24, 128),
        'layout_1_1': Row(2, 2048, 24, 128, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
        'layout_1_2': Row(1, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding'),
        'layout_1_3': Row(1, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal', attn_bias_type='post_scale_bias'),
        'layout_2_0': Row(2, 1, 16, 256, max_seqlen_kv=2048),
        'layout_2_1': Row(2, 2048, 24, 256, attn_mask_type='causal', attn_bias_type='post_scale_bias'),
    },
    'layout_thd': {
        'layout_0_0': Row(2, 2048, 16, 64, attn_mask_type='padding'),
        'layout_0_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding'),
        'layout_0_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding'),
        'layout_1_0': Row(2, 2048, 16, 64, attn_mask_type='padding_causal'),
        'layout_1_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding_causal'),
        'layout_1_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal'),
        'layout_2_0': Row(2, 2048, 16, 64, attn_mask_type='padding_causal_bottom_right'),
        'layout_2_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding_causal_bottom_right'),
        'layout_2_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal_bottom_right'),
        'layout_3_0': Row(2, 2048, 16, 64, attn_mask_type='padding', window_size=(4, 4)),
        'layout_3_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding', window_size=(4, 4)),
        'layout_3_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding', window_size=(4, 4)),
        'layout_4_0': Row(2, 2048, 16, 64, attn_mask_type='padding_causal', window_size=(4, 0)),
        'layout_4_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding_causal', window_size=(4, 0)),
        'layout_4_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal', window_size=(4, 0)),
        'layout_5_0': Row(2, 2048, 16, 64, attn_mask_type='padding_causal_bottom_right', window_size=(4, 0)),
        'layout_5_1': Row(2, 2048, 24, 128, num_gqa_groups=1, attn_mask_type='padding_causal_bottom_right', window_size=(4, 0)),
        'layout_5_2': Row(2, 2048, 24, 128, max_seqlen_kv=4096, attn_mask_type='padding_causal_bottom_right', window_size=(4, 0)),
    },
    'fa4_base': {
        'fa4_base_1': Row(4, 128, 16, 64),
        'fa4_base_2': Row(2, 2048, 24, 128, attn_mask_type='causal'),
        'fa4_base_3': Row(2, 1024, 8, 96, attn_mask_type='causal'),
        'fa4_gqa_1': Row(2, 1024, 32, 128, num_gqa_groups=8, attn_mask_type='causal'),
        'fa4_gqa_2': Row(2, 1024, 16, 128, num_gqa_groups=1, attn_mask_type='causal'),
        'fa4_splits_1': Row(2, 2048, 24, 128, num_splits=2),
        'fa4_splits_2': Row(1, 2048, 24, 128, max_seqlen_kv=4096, num_splits=4),
    },
    'fa4_hdim256': {
        'fa4_hdim256': Row(2, 1024, 8, 256, attn_mask_type='causal'),
    },
    'fa4_mla': {
        'fa4_mla_1': Row(4, 128, 16, 128, head_dim_v=64),
        'fa4_mla_2': Row(2, 128, 16, 64, max_seqlen_kv=256, head_dim_v=128),
        'fa4_mla_3': Row(2, 1024, 16, 96, head_dim_v=64, attn_mask_type='causal'),
        'fa4_mla_4': Row(2, 1024, 16, 128, head_dim_v=96, attn_mask_type='causal'),
        'fa4_mla_deepseek': Row(2, 1024, 16, 192, head_dim_v=128, attn_mask_type='causal'),
    },
    'fa4_swa': {
        'fa4_swa_1': Row(2, 2048, 16, 128, attn_mask_type='causal', window_size=(128, 0)),
        'fa4_swa_2': Row(2, 2048, 24, 64, attn_mask_type='causal', window_size=(64, 0)),
        'fa4_swa_3': Row(2, 2048, 16, 128, num_gqa_groups=4, attn_mask_type='causal', window_size=(256, 0)),
        'fa4_swa_4': Row(2, 2048, 16, 128, attn_mask_type='padding_causal', window_size=(128, 0)),
    },
    'fa4_varlen': {
        'fa4_varlen_1': Row(4, 128, 16, 64, attn_mask_type='padding'),
        'fa4_varlen_2': Row(2, 2048, 24, 128, attn_mask_type='padding_causal'),
        'fa4_varlen_3': Row(2, 2048, 24, 128, num_gqa_groups=4, attn_mask_type='padding_causal'),
        'fa4_varlen_4': Row(2, 128, 16, 64, max_seqlen_kv=256, attn_mask_type='padding'),
    },
    'fa4_mask': {
        'fa4_mask_no_mask': Row(2, 1024, 16, 128),
        'fa4_mask_causal': Row(2, 1024, 16, 128, attn_mask_type='causal'),
        'fa4_mask_causal_br': Row(2, 1024, 16, 128, attn_mask_type='causal_bottom_right'),
        'fa4_mask_padding': Row(2, 1024, 16, 128, attn_mask_type='padding'),
        'fa4_mask_padding_causal': Row(2, 1024, 16, 128, attn_mask_type='padding_causal'),
        'fa4_mask_padding_causal_br': Row(2, 1024, 16, 128, attn_mask_type='padding_causal_bottom_right'),
    },
}

QKV_LAYOUTS = ["sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
               "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd"]
QKV_LAYOUTS_THD = ["t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd"]

# table: (dtypes, qkv_layouts (None: the row's default), pad_between_seqs values, swa), as the test
# functions over each table parametrize them. bf16 is added where the tests use fp16 only: the GPU
# here runs both, and bf16 is what training uses.
_TESTS = {
    "base": (("float16", "bfloat16"), (None,), (False,), False),
    "max_logit": (("float16",), ("sbhd_sbhd_sbhd", "thd_thd_thd"), (False,), False),
    "num_splits": (("float16",), (None,), (False,), False),
    "d256": (("float16", "bfloat16"), ("bshd_bs2hd", "thd_t2hd"), (False,), False),
    "softmax": (("bfloat16",), ("bshd_bshd_bshd", "thd_thd_thd"), (False,), False),
    "mla": (("float16", "bfloat16"), (None,), (False,), False),
    "mask": (("bfloat16",), (None,), (False,), False),
    "bias": (("bfloat16",), (None,), (False,), False),
    "bias_shapes": (("bfloat16",), (None,), (False,), False),
    "swa": (("bfloat16",), ("thd_thd_thd", "sbhd_sbhd_sbhd"), (False,), True),
    "alibi_slopes": (("bfloat16",), (None,), (False,), False),
    "layout": (("bfloat16",), tuple(QKV_LAYOUTS), (False,), False),
    "layout_thd": (("bfloat16",), tuple(QKV_LAYOUTS_THD), (True, False), False),
    "fa4_base": (("bfloat16",), (None,), (False,), False),
    "fa4_hdim256": (("bfloat16",), (None,), (False,), False),
    "fa4_mla": (("bfloat16",), ("bshd_bshd_bshd",), (False,), False),
    "fa4_swa": (("bfloat16",), ("sbhd_sbhd_sbhd", "bshd_bshd_bshd"), (False,), True),
    "fa4_varlen": (("bfloat16",), ("thd_thd_thd", "bshd_bshd_bshd"), (False,), False),
    "fa4_mask": (("bfloat16",), (None,), (False,), False),
}


# Row fields a test sets before it runs a table's rows.
_ROW_OVERRIDES = {"max_logit": dict(return_max_logit=True)}


@dataclass(frozen=True)
class Case:
    table: str
    row_name: str
    dtype: str
    qkv_layout: str
    pad_between_seqs: bool
    swa: bool
    row: Row = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        pad = "-pad" if self.pad_between_seqs else ""
        return f"{self.table}/{self.row_name}/{self.dtype}/{self.qkv_layout}{pad}"


def default_layout(row: Row) -> str:
    """The layout a test uses when it passes none: packed self attention, kv-packed cross attention,
    separate tensors for GQA or d_qk != d_v."""
    separate = row.head_dim_qk != row.dim_v or row.num_heads != row.heads_kv
    if not row.is_cross:
        return "sbhd_sbhd_sbhd" if separate else "sb3hd"
    return "bshd_bshd_bshd" if separate else "bshd_bs2hd"


def cases(tables=None) -> Iterator[Case]:
    """Every case of ``tables`` (default: all), skipping what the tests skip (qkv-packed layouts for
    cross attention or GQA, pad_between_seqs outside thd)."""
    for table in tables or _TESTS:
        dtypes, layouts, pads, swa = _TESTS[table]
        for row_name, row in TABLES[table].items():
            row = replace(row, **_ROW_OVERRIDES.get(table, {}))
            for dtype in dtypes:
                for layout in layouts:
                    layout = layout or default_layout(row)
                    if "3" in layout and (row.is_cross or row.num_heads != row.heads_kv):
                        continue
                    for pad in pads:
                        if pad and not layout.startswith("t"):
                            continue
                        yield Case(table, row_name, dtype, layout, pad, swa, row)
