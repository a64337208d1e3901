"""Adapters between :class:`transformer_engine.pytorch.DotProductAttention` and other libraries.

Each adapter imports its library only when used: ``transformer_engine.pytorch.integrations.huggingface``
needs ``transformers`` (``pip install "deterministic-attention[hf]"``); ``...integrations.megatron`` imports
megatron-core only in :func:`~transformer_engine.pytorch.integrations.megatron.install`.
"""
