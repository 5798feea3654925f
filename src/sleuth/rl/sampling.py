"""DAPO batch shaping: dynamic sampling (drop zero-variance groups, refill) and overlong handling.

- `filter_groups` keeps only groups (samples of one prompt) whose metric differs between
  samples. In a group where every sample has the same reward, GRPO-style advantages are all 0,
  so the group adds no gradient but still dilutes the batch.
- `DynamicBatchFiller` gathers kept groups over several generation rounds until a target number
  of groups is reached (or a maximum number of rounds is spent).
- `overlong_mask` drops truncated responses from the loss (DAPO overlong filtering) and
  `overlong_penalty` is DAPO's soft overlong punishment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sleuth.rl.advantages import GroupIds, group_index


def filter_groups(
    values: torch.Tensor | Sequence[float], group_ids: GroupIds, *, tol: float = 0.0
) -> torch.Tensor:
    """Keep mask (B,) bool: True for samples whose group's `values` are not all equal.

    `values` is the per-sample metric that decides (DAPO uses the final reward or the accuracy;
    pass whichever the recipe names). A group is dropped when max - min <= `tol`; a group of a
    single sample is always dropped (it has no variance by definition).
    """
    vals = torch.as_tensor(values, dtype=torch.float64).flatten()
    index, num_groups = group_index(group_ids, vals.shape[0])
    if vals.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    if torch.isnan(vals).any():
        raise ValueError("values contain NaN; score every sample before filtering groups")
    group_max = torch.full((num_groups,), -torch.inf, dtype=vals.dtype).scatter_reduce(
        0, index, vals, reduce="amax"
    )
    group_min = torch.full((num_groups,), torch.inf, dtype=vals.dtype).scatter_reduce(
        0, index, vals, reduce="amin"
    )
    return (group_max - group_min > tol)[index]


@dataclass
class DynamicBatchFiller:
    """Accumulate informative groups across generation rounds (DAPO dynamic sampling).

    Usage:
        filler = DynamicBatchFiller(target_groups=8, max_rounds=3)
        while not filler.done:
            items, rewards, gids = generate_and_score(next_prompts)
            filler.add(items, rewards, gids)
        groups = filler.groups()          # list of groups, each a list of items, <= target
        log(filler.stats())               # rounds, groups_seen, groups_kept, reached_target ...

    `items` are whatever per-sample records the trainer uses (trajectories, indices); they are
    returned untouched, grouped, in the order their groups were first seen. Group ids are
    scoped to the round they came from, so a prompt drawn again in a later round forms a new
    group. When more groups are collected than the target, the surplus of the last round is
    discarded (counted in `groups_surplus`). When `max_rounds` are spent first, `done` is True
    with `reached_target` False and `groups()` returns the smaller set; the trainer decides
    whether to train on it or skip the step.
    """

    target_groups: int
    max_rounds: int
    tol: float = 0.0
    rounds: int = 0
    groups_seen: int = 0
    groups_dropped: int = 0
    groups_surplus: int = 0
    _kept: list[list[Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {self.target_groups}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")

    @property
    def reached_target(self) -> bool:
        return len(self._kept) >= self.target_groups

    @property
    def done(self) -> bool:
        return self.reached_target or self.rounds >= self.max_rounds

    @property
    def groups_needed(self) -> int:
        """Groups still missing; use it to size the next generation round."""
        return max(self.target_groups - len(self._kept), 0)

    def add(self, items: Sequence[Any], values: torch.Tensor | Sequence[float], group_ids: GroupIds) -> int:
        """Add one round of samples; returns the number of groups kept from it (after trimming)."""
        if self.done:
            raise RuntimeError(
                f"DynamicBatchFiller is done (rounds={self.rounds}, kept={len(self._kept)}); "
                "check `done` before generating another round"
            )
        items = list(items)
        vals = torch.as_tensor(values, dtype=torch.float64).flatten()
        if len(items) != vals.numel():
            raise ValueError(f"got {len(items)} items but {vals.numel()} values; one value per item")
        keep = filter_groups(vals, group_ids, tol=self.tol)
        index, num_groups = group_index(group_ids, len(items))
        self.rounds += 1
        self.groups_seen += num_groups
        by_group: list[list[Any]] = [[] for _ in range(num_groups)]
        kept_flags = [False] * num_groups
        for item, g, k in zip(items, index.tolist(), keep.tolist(), strict=True):
            by_group[g].append(item)
            kept_flags[g] = k
        fresh = [grp for grp, k in zip(by_group, kept_flags, strict=True) if k]
        self.groups_dropped += num_groups - len(fresh)
        room = self.groups_needed
        self.groups_surplus += max(len(fresh) - room, 0)
        taken = fresh[:room]
        self._kept.extend(taken)
        return len(taken)

    def groups(self) -> list[list[Any]]:
        """The kept groups (each a list of items), at most `target_groups` of them."""
        return [list(g) for g in self._kept]

    def items(self) -> list[Any]:
        """The kept items, flattened group after group."""
        return [item for g in self._kept for item in g]

    def stats(self) -> dict[str, float]:
        return {
            "rounds": float(self.rounds),
            "groups_seen": float(self.groups_seen),
            "groups_kept": float(len(self._kept)),
            "groups_dropped": float(self.groups_dropped),
            "groups_surplus": float(self.groups_surplus),
            "reached_target": float(self.reached_target),
            "kept_fraction": len(self._kept) / self.groups_seen if self.groups_seen else 0.0,
        }


TRUNCATED_FINISH_REASONS = frozenset({"length"})


def overlong_mask(truncated: Sequence[str] | Sequence[bool] | torch.Tensor) -> torch.Tensor:
    """Keep mask (B,) bool, False for truncated responses (DAPO overlong filtering).

    `truncated` is either per-sample finish reasons as in `sleuth.llm.base.Generation`
    ("stop", "eos", "length"; "length" = cut at the token budget) or per-sample bool flags
    (True = truncated). Multiply the response mask by `keep[:, None]` so truncated responses
    contribute nothing to the losses.
    """
    if isinstance(truncated, torch.Tensor):
        if truncated.dim() != 1:
            raise ValueError(
                f"truncated flags must be 1-D (one per sample), got shape {tuple(truncated.shape)}"
            )
        return ~truncated.bool()
    entries = list(truncated)
    if all(isinstance(e, (bool, int)) for e in entries):
        return torch.tensor([not bool(e) for e in entries], dtype=torch.bool)
    if all(isinstance(e, str) for e in entries):
        return torch.tensor([e not in TRUNCATED_FINISH_REASONS for e in entries], dtype=torch.bool)
    raise ValueError("truncated must be all finish-reason strings or all bool flags, not a mix")


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int], max_len: int, cache_len: int, *, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (B,), added to the reward; <= 0.

    With L = response length (policy tokens generated), L_max = `max_len`, L_cache = `cache_len`:
        0                                   if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (linear, 0 .. -1)
        -1                                  if L > L_max
    times `factor`. DAPO uses L_max = 20480 with L_cache = 4096 and generation budget L_max.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lens = torch.as_tensor(lengths, dtype=torch.float32)
    start = float(max_len - cache_len)
    linear = (start - lens) / cache_len
    penalty = torch.where(lens <= start, torch.zeros_like(lens), linear)
    penalty = torch.where(lens > max_len, torch.full_like(lens, -1.0), penalty)
    return penalty * factor


__all__ = [
    "TRUNCATED_FINISH_REASONS",
    "DynamicBatchFiller",
    "filter_groups",
    "overlong_mask",
    "overlong_penalty",
]
