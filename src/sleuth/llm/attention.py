"""Decode-step attention that reads every key/value head once under grouped-query attention (GQA).

transformers' SDPA path expands the key/value cache to one copy per query head (`repeat_kv`) whenever
an attention mask is passed, which a padded batch always does; under `torch.compile` its one-token
shortcut is off as well. For a 0.5B Qwen2 shape (14 query heads over 2 key/value heads) that copy is
7x the cache, written and read again in every layer of every decode step: the profile of compiled
decoding on an H100 showed it, with the attention it feeds, as most of the step's device time.

Here a one-token query is regrouped instead: the query heads that share a key/value head become that
head's rows, (B, H, 1, D) -> (B, H_kv, H / H_kv, D), and one SDPA call attends them to the unexpanded
cache with the (B, 1, 1, L) mask broadcast over rows. The arithmetic is the same attention; prefill and
training forwards (more than one query token) go to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

GROUPED_DECODE = "sleuth_grouped_decode_sdpa"


def grouped_decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,  # is_causal and the rest of transformers' attention keywords: passed on where SDPA runs
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # deferred: heavy import

    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q_len, dim = query.shape
    plain = (
        q_len != 1
        or groups == 1
        or dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions")
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows = query.reshape(batch, heads // groups, groups, dim)  # query head h reads key/value head h // groups
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
        if mask.dim() == 4 and mask.shape[1] != 1:  # a per-head mask: regroup it like the query
            mask = mask.reshape(batch, heads // groups, groups, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling, is_causal=False
    )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_grouped_decode_attention(model: torch.nn.Module) -> bool:
    """Switch a transformers model (PEFT-wrapped or not) that uses SDPA to the grouped decode attention;
    False (and nothing changed) where it does not apply: another attention implementation or no GQA."""
    from transformers import AttentionInterface  # deferred: heavy import
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", GROUPED_DECODE):
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads == kv_heads:
        return False
    AttentionInterface.register(GROUPED_DECODE, grouped_decode_sdpa)
    AttentionMaskInterface.register(GROUPED_DECODE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    for sub in (config, *(getattr(config, name) for name in ("text_config",) if hasattr(config, name))):
        sub._attn_implementation = GROUPED_DECODE
    return True
