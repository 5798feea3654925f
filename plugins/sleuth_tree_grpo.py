"""Tree-GRPO (Ji et al. 2025, arXiv 2509.21240) as a sleuth plugin: tree rollouts and the intra + inter-tree
advantage, trained by `sleuth train` with no edit to sleuth (CPU-tested; not GPU-measured: no docs/results.md run).

- sampling (`tree_rollout`, the method's own training rollout, `Method.rollout`): `algorithm.n` = M chains per
  question, then `agent.options.tree_expansions` = L rounds that each fork `agent.options.tree_branches` = N turn
  boundaries (after an inserted observation) of every tree and continue them as new trajectories
  (`sleuth.agent.engine.rollout_tree`, `fork`). On the decode engine a branch continues from its parent's
  keys/values (held in the pool while the tree is rolled out); on the HF dynamic cache / CPU its prefix is
  prefilled again, same tokens. A question gets M (1 + L N) trajectories at most (fewer when a tree has fewer
  turn boundaries than N), adjacent, `extra["tree"]` naming the tree.
- advantage (`algorithm.advantage: tree_grpo`, the public code's `tree` estimator, AMAP-ML/Tree-GRPO
  ray_trainer_ts.py): the sum of two GRPO advantages of the same outcome reward, one normalised over the
  question's trajectories (inter-tree), one over the trajectory's own tree (intra-tree): `tree_grpo_advantages`.
  The registered estimator reads the trees from the batch's trajectories (`tree_ids`).
- evaluation and serving roll out one chain per question (Search-R1's protocol, `tree-search`); the cold start
  is Search-R1's oracle (`oracle_format`), and `run_sections` gives a generated run (bench/learning.py) its tree.
- the paper's claim (more trajectories and fewer tool calls for the same tokens) as a measure:
  `bench/tree_grpo_budget.py` counts trajectories and tool calls per 1k generated tokens of tree rollouts against
  plain GRPO rollouts at an equal generated-token budget (tiny model on CPU, or `--model` on a GPU).
Limits: one process (a question's trajectory count varies, so ranks' batches would differ); the node draw is
uniform over a tree's turn boundaries, without the paper's budget-matched M, L, N schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import RolloutBudget, TreeSpec, rollout_tree
from sleuth.agent.registry import Method, RunShape, register_method
from sleuth.agent.search_r1 import SearchR1Loop
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.retrieval.base import Retriever
from sleuth.rl.advantages import GroupIds, grpo_advantages, register_advantage


@dataclass
class TreeSearchLoop(SearchR1Loop):
    """Search-R1's protocol; the tree is in how it is rolled out (`tree_rollout`), not in the loop. Its two
    options shape the tree: expansion rounds (L) and nodes forked per tree and round (N)."""

    name: ClassVar[str] = "tree_search"
    tree_expansions: int = 1
    tree_branches: int = 2


def tree_rollout(loop: AgentLoop, generator: Generator, retriever: Retriever, examples: Sequence[QAExample],
                 params: SamplingParams | None, n: int = 1, *, budget: RolloutBudget | None = None,
                 tokenizer: Any = None) -> list[Trajectory]:  # fmt: skip
    """The trainer's rollout for this method: `n` trees per question, grown by the loop's tree options. The
    node draw's seed comes from torch's generator, which the trainer seeds: a run is reproducible and each
    step draws other nodes."""
    expansions = getattr(loop, "tree_expansions", 1)
    branches = getattr(loop, "tree_branches", 2)
    if branches < 1 or expansions < 0:
        raise ConfigError(
            f"agent.options: tree_branches must be >= 1 and tree_expansions >= 0; got {branches}, "
            f"{expansions}"
        )
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    spec = TreeSpec(trees=n, expansions=expansions, branches=branches, seed=seed)
    return rollout_tree(
        loop, generator, retriever, examples, params, spec, budget=budget, tokenizer=tokenizer
    )


TREES, EXPANSIONS, BRANCHES = 2, 1, 2  # M, L, N of `recipe` and of a generated run (`run_sections`)


def run_sections(shape: RunShape) -> dict[str, Any]:
    """A generated run's Tree-GRPO sections (`Method.recipe_sections`, bench/learning.py): the tree advantage, M
    trees per question of L rounds of N forks, and one optimizer step over a step's M (1 + L N) trajectories per
    question at most, as GRPO's minibatch holds all of its n per question."""
    return {
        "algorithm": {
            "advantage": "tree_grpo",
            "n": TREES,
            "minibatch_size": shape.prompts_per_step * TREES * (1 + EXPANSIONS * BRANCHES),
        },
        "agent": {"options": {"tree_expansions": EXPANSIONS, "tree_branches": BRANCHES}},
    }


register_method(
    Method(
        loop=TreeSearchLoop,
        title="Tree-GRPO: tree rollouts of a Search-R1 agent, intra + inter-tree advantages",
        eval_name="tree-search",
        default_reward={"name": "search_r1_em"},
        new_tokens_factor=2,
        rollout=tree_rollout,
        oracle_format="search_r1",
        recipe_sections=run_sections,
    )
)


def tree_ids(trajs: Sequence[Trajectory]) -> list[tuple[int, int, int]]:
    """Which tree each trajectory of a `rollout_tree` call belongs to: (sampling round, question, tree)."""
    return [(t.sampling_round, t.group, int(t.extra.get("tree", t.sample))) for t in trajs]


@torch.no_grad()
def tree_grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    tree_ids: GroupIds,
    response_mask: torch.Tensor,
    *,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A = GRPO over the question's group + GRPO over the trajectory's tree (each (r - mean) / (std + eps),
    unbiased std, 0 for a group of one or of equal rewards). Returns (A, A)."""
    inter, _ = grpo_advantages(scores, group_ids, response_mask, epsilon=epsilon)
    intra, _ = grpo_advantages(scores, tree_ids, response_mask, epsilon=epsilon)
    adv = inter + intra
    return adv, adv


@register_advantage("tree_grpo")
@torch.no_grad()
def tree_grpo(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    trajectories: Sequence[Trajectory],
    *,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`algorithm.advantage: tree_grpo`: `tree_grpo_advantages` with the trees read from the batch's
    trajectories (the trainer passes them, one per row, to an estimator that declares `trajectories`)."""
    if len(trajectories) != len(scores):
        raise ValueError(f"tree_grpo: {len(trajectories)} trajectories for {len(scores)} rows")
    trees = [(g, tree[2]) for g, tree in zip(list(group_ids), tree_ids(trajectories), strict=True)]
    return tree_grpo_advantages(scores, group_ids, trees, response_mask, epsilon=epsilon)


def budget_counts(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """What a rollout cost and gave (Tree-GRPO's claim is counted this way): `trajectories`; `generated_tokens`,
    the policy tokens actually decoded (a branch's tokens before its fork are its parent's, decoded once:
    `extra["shared_policy_tokens"]`); `tool_calls`, the policy's searches actually run (a branch's before its fork
    ran once, `extra["shared_retrievals"]`; a loop's initial searches are not the policy's); and both per 1,000
    generated tokens, and tool calls per trajectory."""
    tokens = calls = 0
    for t in trajs:
        forked = "forked_at_turn" in t.extra
        tokens += sum(t.loss_mask) - (int(t.extra["shared_policy_tokens"]) if forked else 0)
        calls += t.retrieval_count - (int(t.extra["shared_retrievals"]) if forked else t.initial_queries)
    per_k = 1000.0 / tokens if tokens else float("nan")
    return {
        "trajectories": float(len(trajs)),
        "generated_tokens": float(tokens),
        "tool_calls": float(calls),
        "trajectories_per_1k_tokens": len(trajs) * per_k,
        "tool_calls_per_1k_tokens": calls * per_k,
        "tool_calls_per_trajectory": calls / len(trajs) if trajs else float("nan"),
    }


def recipe(train: str, **overrides: Any) -> dict[str, Any]:
    """Tree-GRPO on the Search-R1 loop: `algorithm.n` trees per question (M = 2), one expansion round (L) of
    two nodes per tree (N)."""
    base: dict[str, Any] = {
        "name": "tree_grpo",
        "plugins": ["sleuth_tree_grpo"],
        "data": {"train": train},
        "agent": {
            "loop": "tree_search",
            "max_turns": 4,
            "top_k": 3,
            "options": {"tree_expansions": EXPANSIONS, "tree_branches": BRANCHES},
        },
        "reward": {"name": "search_r1_em"},
        "algorithm": {"name": "grpo", "n": TREES, "advantage": "tree_grpo"},
    }
    return {**base, **overrides}
