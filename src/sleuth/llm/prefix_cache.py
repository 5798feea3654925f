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

Forked trajectories (`sleuth.agent.engine.rollout_tree`: a branch continues a trajectory from one of its earlier
turn boundaries) share their parent's prefix through the `hold` mode (`DecodeEngine.holding`): every remembered
row stays in the pool across later starts (moved behind the new rows, not computed again) until the hold ends,
and a prompt reuses the longest prefix it has in common with any held row, not only a row it continues whole.
A row that a newer row continues whole is dropped (the newer one holds its keys), so the held rows are at most
one per trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
        self.hold = False  # keep rows across starts and match common prefixes (forked trajectories)
        self._rows: list[tuple[tuple[int, ...], int]] = []  # every stored (sequence, start), in hold mode
        self._arrays: dict[tuple[int, ...], np.ndarray] = {}  # a held row's tokens, compared at once

    def __bool__(self) -> bool:
        return bool(self._by_length)

    def clear(self) -> None:
        self._by_length = {}
        self._rows = []
        self._arrays = {}

    def rows(self) -> list[tuple[tuple[int, ...], int]]:
        """The held (sequence, pool start) rows (empty unless `hold`); their first len - 1 keys are in the pool."""
        return list(self._rows)

    def remember(self, sequences: list[list[int]], starts: list[int]) -> None:
        """Row i's `sequences[i]` (its prompt and every generated token) starts at pool slot `starts[i]`; the
        keys/values of all but its last token are in the pool (the last was sampled, never fed)."""
        if len(sequences) != len(starts):
            raise ValueError(f"remember: {len(sequences)} sequences for {len(starts)} rows of the last start")
        for seq, start in zip(sequences, starts, strict=True):
            if len(seq) >= 2:
                if self.hold:
                    self._drop_prefixes_of(seq)
                    self._rows.append((tuple(seq), start))
                    self._arrays[tuple(seq)] = np.asarray(seq, dtype=np.int64)
                by_last = self._by_length.setdefault(len(seq), {})
                by_last.setdefault(int(seq[-1]), []).append((tuple(seq), start))  # ids are ints already

    def _drop_prefixes_of(self, seq: list[int]) -> None:
        """Forget held rows that `seq` continues whole: its keys cover theirs, and holding both would double
        the pool a tree of forks needs."""
        for length in [n for n in self._by_length if n <= len(seq)]:
            candidates = self._by_length[length].get(int(seq[length - 1]), [])
            head = tuple(seq[:length])
            gone = [c for c in candidates if c[0] == head]
            if gone:
                self._by_length[length][int(seq[length - 1])] = [c for c in candidates if c[0] != head]
                self._rows = [r for r in self._rows if r not in gone]

    def match(self, prompt: list[int]) -> Prefix | None:
        """The longest remembered sequence the prompt starts with (in hold mode: the longest prefix the prompt
        has in common with any held row); at least the prompt's last token is left to prefill (its logits
        sample the next token)."""
        whole = self._whole_row(prompt)
        # a row continued whole (a trajectory's next turn) is taken without scanning the held rows: another row could
        # share at most a few more tokens (an identical sibling's), and the scan is for a branch's first turn
        if whole is not None or not self.hold:
            return whole
        return self._common_prefix(prompt)  # a branch's first turn: a prefix of a held row

    def _whole_row(self, prompt: list[int]) -> Prefix | None:
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

    def _common_prefix(self, prompt: list[int]) -> Prefix | None:
        best: Prefix | None = None
        want = np.asarray(prompt, dtype=np.int64)
        for seq, start in self._rows:
            n = min(len(seq) - 1, len(prompt) - 1)  # keys of a row's last token were never written
            if n < 1 or seq[0] != prompt[0] or (best is not None and n <= best.tokens):
                continue
            differ = np.flatnonzero(self._arrays[seq][:n] != want[:n])
            common = int(differ[0]) if differ.size else n
            if common >= 1 and (best is None or common > best.tokens):
                best = Prefix(start=start, tokens=common)
        return best


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


def prefix_attention_index(
    starts: list[int], offsets: list[int], lengths: list[int], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows whose first `offsets[r]` tokens are already in the pool and whose next `lengths[r]` tokens are
    being prefilled (padded to `width`): the pool slots of each row's keys, (rows, keys), and the causal mask
    of its queries over them, (rows, 1, width, keys). Built once per prefill, used by every layer."""
    totals = [o + n for o, n in zip(offsets, lengths, strict=True)]
    keys = max(totals)
    cols = torch.arange(keys)
    last = torch.tensor(totals)[:, None] - 1
    slots = torch.tensor(starts)[:, None] + torch.minimum(
        cols[None, :], last
    )  # padding keys repeat the last one
    query_pos = torch.tensor(offsets)[:, None] + torch.arange(width)[None, :]
    mask = cols[None, None, :] <= query_pos[:, :, None]  # key 0 is always visible: padded queries stay finite
    return slots.to(device), mask[:, None].to(device)


def attend_over_prefix(
    q: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of the new tokens' queries (rows, width, heads, head_dim) over each row's stored and new keys
    (`prefix_attention_index`); the new keys/values must already be in the pool. Returns q's shape."""
    heads, kv_heads = q.shape[2], layer_k.shape[1]
    k, v = layer_k[slots], layer_v[slots]  # (rows, keys, kv_heads, head_dim)
    if heads != kv_heads:  # repeated per query head, as the plain prefill does (keeps SDPA off the math path)
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    a = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
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
