"""Attention for decode steps on a CPU, registered with transformers' attention interface.

``load_model`` picks it for bf16 weights without a GPU.
"""

from __future__ import annotations

from typing import Any

# The name under which transformers finds ``decode_attention`` (``attn_implementation``).
DECODE_ATTENTION = "trace_decode"


def decode_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention interface: SDPA, except for a decode step (one query per row).

    The CPU's flash-attention kernel is built for long queries; for one query token in bf16
    it took 60% of a decode step (torch profiler, batch 16, 1,500 cached positions). Two
    batched matmuls did that step in two thirds of the time (in float32 they do not win):
    grouped-query heads attend as one ``(kv_heads, group)`` block against their shared keys,
    without copying the keys per head, and the softmax runs in float32.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    if length != 1 or (dropout and module.training):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale
    if attention_mask is not None:  # (batch, 1, 1, positions): True, or 0.0, where a row may attend
        mask = attention_mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    return out.reshape(batch, 1, heads, dim), None


def register_decode_attention() -> str:
    """Make ``decode_attention`` available as ``attn_implementation``; returns its name.

    Its mask is SDPA's (a boolean mask, or none where every position is visible).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    return DECODE_ATTENTION
