"""Tree-GRPO (Ji et al. 2025, arXiv 2509.21240) as a sleuth plugin, in part: its tree sampling and its
advantage. CPU parts only, not GPU-measured (no docs/results.md run), and not yet trainable by `sleuth train`.

- sampling: `sleuth.agent.engine.rollout_tree(loop, generator, retriever, examples, params, TreeSpec(trees=M,
  expansions=L, branches=N))`: M chains per question, then L rounds that each fork N turn boundaries of every
  tree and continue them (the branches share the chain's prefix);
- advantage (the public code's `tree` estimator, AMAP-ML/Tree-GRPO ray_trainer_ts.py): the sum of two GRPO
  advantages of the same outcome reward, one normalised over the question's trajectories (inter-tree), one over
  the trajectory's own tree (intra-tree): `tree_grpo_advantages`.
What is missing for `sleuth train`: the trainer rolls out with `rollout` and passes estimators only `group_ids`;
it would call `rollout_tree` for a loop that asks for trees and pass `tree_ids(trajs)` (rl/trainer.py, owned by
another issue this turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sleuth.agent.engine import TreeSpec
from sleuth.agent.registry import Method, register_method
from sleuth.agent.search_r1 import SearchR1Loop
from sleuth.agent.trajectory import Trajectory
from sleuth.rl.advantages import GroupIds, grpo_advantages


@dataclass
class TreeSearchLoop(SearchR1Loop):
    """Search-R1's protocol; the tree is in how it is rolled out (`TREE`), not in the loop."""

    name: ClassVar[str] = "tree_search"


register_method(Method(loop=TreeSearchLoop, title="a Search-R1 agent for Tree-GRPO's tree rollouts (not yet "
                       "trainable by sleuth train)", eval_name="tree-search", default_reward={"name": "search_r1_em"},
                       new_tokens_factor=2))

TREE = TreeSpec(trees=2, expansions=1, branches=2)  # a small tree; the paper's M, L, N vary with the budget


def tree_ids(trajs: Sequence[Trajectory]) -> list[tuple[int, int, int]]:
    """Which tree each trajectory of a `rollout_tree` call belongs to: (sampling round, question, tree)."""
    return [(t.sampling_round, t.group, int(t.extra.get("tree", t.sample))) for t in trajs]


@torch.no_grad()
def tree_grpo_advantages(scores: torch.Tensor, group_ids: GroupIds, tree_ids: GroupIds,
                         response_mask: torch.Tensor, *, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """A = GRPO over the question's group + GRPO over the trajectory's tree (each (r - mean) / (std + eps),
    unbiased std, 0 for a group of one or of equal rewards). Returns (A, A)."""
    inter, _ = grpo_advantages(scores, group_ids, response_mask, epsilon=epsilon)
    intra, _ = grpo_advantages(scores, tree_ids, response_mask, epsilon=epsilon)
    adv = inter + intra
    return adv, adv


def recipe(train: str, **overrides: Any) -> dict[str, Any]:
    """GRPO on the Search-R1 loop; `algorithm.n` is the number of trees per question (TREE.trees)."""
    base: dict[str, Any] = {
        "name": "tree_grpo",
        "plugins": ["sleuth_tree_grpo"],
        "data": {"train": train},
        "agent": {"loop": "tree_search", "max_turns": 4, "top_k": 3},
        "reward": {"name": "search_r1_em"},
        "algorithm": {"name": "grpo", "n": TREE.trees},
    }
    return {**base, **overrides}
