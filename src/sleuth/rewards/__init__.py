"""Answer metrics and RL rewards for search agents.

`get_reward(name, **config)` builds a reward by name; rewards are called on a batch of
trajectories with the frozen models they need in `RewardServices`.
"""

from sleuth.rewards import qagent, r_search, s3, search_r1, staged  # noqa: F401  (register rewards)
from sleuth.rewards.base import (
    Reward,
    RewardResult,
    RewardServices,
    available_rewards,
    get_reward,
    register_reward,
    score_batch,
)
from sleuth.rewards.metrics import (
    aggregate,
    cover_exact_match,
    exact_match,
    extract_answer,
    extract_tag,
    f1_score,
    normalize_answer,
    span_check,
)

__all__ = [
    "Reward",
    "RewardResult",
    "RewardServices",
    "aggregate",
    "available_rewards",
    "cover_exact_match",
    "exact_match",
    "extract_answer",
    "extract_tag",
    "f1_score",
    "get_reward",
    "normalize_answer",
    "register_reward",
    "score_batch",
    "span_check",
]
