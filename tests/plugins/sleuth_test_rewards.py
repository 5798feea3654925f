"""A reward plugin for the trainer tests (loaded through `plugins:` in a recipe)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sleuth.agent.trajectory import Trajectory
from sleuth.rewards.base import Reward, RewardResult, RewardServices, register_reward


@register_reward("test_token_fraction")
@dataclass
class TokenFractionReward(Reward):
    """Fraction of the policy's own tokens whose id is divisible by `modulus`.

    About 1/modulus of a random model's tokens qualify, so every group has reward variance
    from the first step, and a policy can raise it quickly: a learnable task in seconds.
    Inserted (masked) tokens never count, which also checks that the trainer sees the mask.
    """

    modulus: int = 4
    # "fraction": share of tokens with id % modulus == 0; "residue": mean (id % modulus) / (modulus - 1),
    # which also separates greedy trajectories (a random model's greedy text repeats one token)
    mode: str = "fraction"

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        out = []
        for t in trajs:
            ids = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
            if self.mode == "residue":
                value = sum((i % self.modulus) / (self.modulus - 1) for i in ids) / max(1, len(ids))
            else:
                value = sum(1 for i in ids if i % self.modulus == 0) / max(1, len(ids))
            out.append(RewardResult(total=value, components={self.mode: value}))
        return out
