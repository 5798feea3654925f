"""DAPO batch shaping: dynamic sampling (drop zero-variance groups, refill) and overlong handling.

- `filter_groups` keeps only groups (samples of one prompt) whose metric differs between
  samples. In a group where every sample has the same reward, GRPO-style advantages are all 0,
  so the group adds no gradient but still dilutes the batch.
  The trainer refills over several rounds itself (sleuth.rl.rollouts.collect_rollouts: ranks agree
  on when to stop).
- `overlong_mask` drops truncated responses from the loss (DAPO overlong filtering).
"""

from __future__ import annotations

from collections.abc import Sequence

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


__all__ = [
    "TRUNCATED_FINISH_REASONS",
    "filter_groups",
    "overlong_mask",
]
