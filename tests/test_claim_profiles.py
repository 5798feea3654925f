"""Every claim profile's sizes make recipes the trainer accepts, for every method: a GPU profile is only run on a
lent GPU, so a recipe it cannot build must fail here, not at a lease's first RL step (2026-11-29: staged's 8 prompts x
16 samples with GRPO passes of 10 were refused there)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import sleuth.claims  # noqa: F401  (registers the built-in claims)
from sleuth.agent.registry import methods
from sleuth.claims.registry import CLAIMS
from sleuth.demo import GPU, demo_recipe, rl_micro_batch
from sleuth.rl.config import recipe_from_dict

PROFILES = sorted({(name, profile) for name, spec in CLAIMS.items() for profile in spec.profiles})


@pytest.mark.parametrize(("claim", "profile"), PROFILES)
def test_every_claim_profile_makes_valid_recipes_for_every_method(
    claim: str, profile: str, tmp_path: Path
) -> None:
    pipeline = CLAIMS[claim].profile(profile).pipeline
    for method in methods():
        recipe = recipe_from_dict(demo_recipe(tmp_path / method.name, pipeline, method.name))
        algo = recipe.algorithm
        assert algo.minibatch_size % algo.micro_batch_size == 0, (claim, profile, method.name)
        assert algo.micro_batch_size <= (pipeline.rl_micro or pipeline.n), (claim, profile, method.name)


def test_a_pass_is_the_largest_divisor_of_the_minibatch_within_the_asked_size() -> None:
    assert rl_micro_batch(replace(GPU, n=16, prompts_per_step=8, rl_micro=10)) == 8  # 128 rollouts
    assert rl_micro_batch(replace(GPU, n=5, prompts_per_step=16, rl_micro=10)) == 10  # 80
    assert rl_micro_batch(replace(GPU, n=5, prompts_per_step=3, rl_micro=0)) == 5  # one group
    assert (
        rl_micro_batch(replace(GPU, n=7, prompts_per_step=1, rl_micro=10)) == 7
    )  # asked more than the minibatch
    assert rl_micro_batch(replace(GPU, n=7, prompts_per_step=2, rl_micro=6)) == 2  # 14 = 2 x 7
    assert rl_micro_batch(GPU) == GPU.rl_micro
