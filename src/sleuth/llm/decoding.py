"""The pure tensor steps every local decoding path shares (HFGenerator's dynamic and static caches, the
decode engine's eager sampling): left padding, positions from a mask, top-p filtering and the choice of the
next token with its log-probability."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into (input_ids, attention_mask), both int64 of shape (B, max_len)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens: 0 for the first real token of each row (pads get 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the smallest set whose probability mass reaches `top_p` to -inf.

    The most likely token is always kept, so the result is never all -inf.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before > top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def select_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from float logits (B, V); return (token ids (B,), their log-probs (B,))."""
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / temperature
        logprobs = scaled.log_softmax(dim=-1)
        probs = top_p_filter(scaled, top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
