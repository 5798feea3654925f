"""RL training for search agents.

Algorithm core (pure functions over (batch, tokens) tensors plus masks):
  - `sleuth.rl.advantages`: GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++ (registry by name).
  - `sleuth.rl.losses`: masked reductions, loss aggregation modes, PPO policy losses (registry by
    name) and the value loss, KL estimators, log-probs/entropy from logits.
  - `sleuth.rl.sampling`: DAPO dynamic-sampling group filter and overlong filtering.

The names below are re-exported lazily so that `import sleuth.rl` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "sleuth.rl.advantages": (
        "ADVANTAGE_ESTIMATORS",
        "compute_advantages",
        "drgrpo_advantages",
        "gae_advantages",
        "get_advantage_fn",
        "group_index",
        "grpo_advantages",
        "outcome_to_token_rewards",
        "register_advantage",
        "reinforce_plus_plus_advantages",
        "rloo_advantages",
    ),
    "sleuth.rl.losses": (
        "KL_ESTIMATORS",
        "LOSS_AGG_MODES",
        "agg_loss",
        "apply_kl_penalty",
        "entropy_from_logits",
        "kl_loss",
        "kl_penalty",
        "logprobs_from_logits",
        "masked_mean",
        "masked_sum",
        "masked_var",
        "masked_whiten",
        "POLICY_LOSSES",
        "get_policy_loss",
        "policy_loss",
        "register_policy_loss",
        "value_loss",
    ),
    "sleuth.rl.sampling": (
        "filter_groups",
        "overlong_mask",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'sleuth.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
