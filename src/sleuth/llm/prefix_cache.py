"""Keys and values kept across the turns of a rollout (the decode engine's prefix reuse).

A multi-turn agent sends each row back as `prompt + generated + observation`: without reuse every turn
prefills the whole context again, and at Search-R1's geometry (4 turns of 500 tokens plus 500-token
observations) those re-prefills were 20-30% of a rollout's time on an H100 (bench/rollout.py,
`prefill_share_of_generate`). After a decode the engine remembers each row's token sequence and where its
keys and values sit in the pool; a later prompt that starts with a remembered sequence has that prefix's
keys and values moved to its new slots (one gather and one scatter per layer, a few milliseconds) and
prefills only its new tokens, attending over the moved prefix.

What is reused was computed by the same weights: `DecodeEngine.refresh` (a policy update), `release` and a
pool reallocation forget everything, and any `start` forgets what it does not move (it reassigns the
pool's slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Prefix:
    """`tokens` keys/values of a remembered row, from pool slot `start` on."""

    start: int
    tokens: int


class PrefixStore:
    """The token sequences whose keys/values the pool holds, found by exact prefix match."""

    def __init__(self) -> None:
        # length -> token at position length-1 -> [(sequence, pool start)]: a candidate length is ruled out
        # by one lookup, and a tuple is built only for sequences that end like the prompt's prefix
        self._by_length: dict[int, dict[int, list[tuple[tuple[int, ...], int]]]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_length)

    def clear(self) -> None:
        self._by_length = {}

    def remember(self, sequences: list[list[int]], starts: list[int]) -> None:
        """Row i's `sequences[i]` (its prompt and every generated token) starts at pool slot `starts[i]`; the
        keys/values of all but its last token are in the pool (the last was sampled, never fed)."""
        if len(sequences) != len(starts):
            raise ValueError(f"remember: {len(sequences)} sequences for {len(starts)} rows of the last start")
        for seq, start in zip(sequences, starts, strict=True):
            if len(seq) >= 2:
                by_last = self._by_length.setdefault(len(seq), {})
                by_last.setdefault(int(seq[-1]), []).append((tuple(seq), start))  # ids are ints already

    def match(self, prompt: list[int]) -> Prefix | None:
        """The longest remembered sequence the prompt starts with; at least the prompt's last token is left
        to prefill (its logits sample the next token)."""
        for length in sorted(self._by_length, reverse=True):
            if length > len(prompt):
                continue
            candidates = self._by_length[length].get(int(prompt[length - 1]))
            if not candidates:
                continue
            head = tuple(prompt[:length])
            for seq, start in candidates:
                if seq == head:
                    return Prefix(start=start, tokens=min(length - 1, len(prompt) - 1))
        return None


def move_prefixes(pool_k: torch.Tensor, pool_v: torch.Tensor, moves: list[tuple[int, int, int]]) -> None:
    """Copy `n` slots from `src` to `dst` for each (src, dst, n), in every layer of the (layers, slots, ...)
    pools. All sources are read before any destination is written, so regions may overlap."""
    moves = [(s, d, n) for s, d, n in moves if n > 0 and s != d]
    if not moves:
        return
    src = torch.cat([torch.arange(s, s + n) for s, _, n in moves]).to(pool_k.device)
    dst = torch.cat([torch.arange(d, d + n) for _, d, n in moves]).to(pool_k.device)
    for pool in (pool_k, pool_v):
        for layer in pool:  # one layer at a time: the gathered copy is a layer's share, not the whole prefix
            layer.index_copy_(0, dst, layer.index_select(0, src))


def prefix_attention_index(starts: list[int], offsets: list[int], lengths: list[int], width: int,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows whose first `offsets[r]` tokens are already in the pool and whose next `lengths[r]` tokens are
    being prefilled (padded to `width`): the pool slots of each row's keys, (rows, keys), and the causal mask
    of its queries over them, (rows, 1, width, keys). Built once per prefill, used by every layer."""
    totals = [o + n for o, n in zip(offsets, lengths, strict=True)]
    keys = max(totals)
    cols = torch.arange(keys)
    last = torch.tensor(totals)[:, None] - 1
    slots = torch.tensor(starts)[:, None] + torch.minimum(cols[None, :], last)  # padding keys repeat the last one
    query_pos = torch.tensor(offsets)[:, None] + torch.arange(width)[None, :]
    mask = cols[None, None, :] <= query_pos[:, :, None]  # key 0 is always visible: padded queries stay finite
    return slots.to(device), mask[:, None].to(device)


def attend_over_prefix(q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, slots: torch.Tensor,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the new tokens' queries (rows, width, heads, head_dim) over each row's stored and new keys
    (`prefix_attention_index`); the new keys/values must already be in the pool. Returns q's shape."""
    heads, kv_heads = q.shape[2], layer_k.shape[1]
    k, v = layer_k[slots], layer_v[slots]  # (rows, keys, kv_heads, head_dim)
    if heads != kv_heads:  # repeated per query head, as the plain prefill does (keeps SDPA off the math path)
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale)
    return a.transpose(1, 2)


def prefill_chunks(lengths: list[int], offsets: list[int], budget: int) -> list[list[int]]:
    """Rows grouped for prefill: similar numbers of new tokens together (less padding), at most `budget` padded
    new tokens per group, and where prefixes are reused at most 8 x `budget` padded keys (each row's stored keys
    are gathered for its attention)."""
    new = [n - o for n, o in zip(lengths, offsets, strict=True)]
    order = sorted(range(len(lengths)), key=lambda r: (new[r], lengths[r]))
    reused = any(offsets)
    chunks: list[list[int]] = []
    chunk: list[int] = []
    widest = 0
    for r in order:
        rows = len(chunk) + 1
        fits = rows * new[r] <= budget and (not reused or rows * max(widest, lengths[r]) <= 8 * budget)
        if chunk and not fits:
            chunks.append(chunk)
            chunk, widest = [], 0
        chunk.append(r)
        widest = max(widest, lengths[r])
    if chunk:
        chunks.append(chunk)
    return chunks
