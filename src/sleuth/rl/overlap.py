"""`trainer.overlap: one_step`: step k+1's rollouts are made from the weights step k started with, while (here:
before) step k updates; step k+1 then trains on them one step stale, with the generator's recorded per-token
log-probs as the old side of the importance ratio (the behaviour policy's), and logs `rollout/staleness`.

On one process the two run in a deterministic interleaving: step k draws and rolls out step k+1's prompts before
its own update, so the engine's copy is exactly the pre-update weights, and a later engine could run that
collection on another stream or GPU without changing what is computed. The first step, and the first step after a
resume or a guard's rollback, rolls out synchronously (staleness 0: the synchronous trainer's on-policy path).

A checkpoint saves the data cursor from before the pending rollouts' draw; the pending rollouts are not saved, so a
resumed run rolls those prompts out again from the checkpoint's weights (staleness 0, fresh samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.rl.config import Recipe
from sleuth.rl.dist import DistContext
from sleuth.rl.models import release_rollout_memory
from sleuth.rl.rollouts import Collected, collect_or_stop
from sleuth.rl.run import Run

# tests: roll the next step out after the update (from the updated weights, staleness 0) instead of before it
WAIT_FOR_UPDATE = False


@dataclass
class Pending:
    """The next step's rollouts, made during this step."""

    collected: Collected
    stage: int
    cursor_before: dict[str, int]  # the data cursor before they drew their prompts (what a checkpoint saves)
    staleness: int  # updates between the weights that rolled them out and the weights they train


def check_overlap(recipe: Recipe, ctx: DistContext) -> None:
    """One line where one-step overlap cannot apply."""
    if recipe.trainer.overlap == "off":
        return
    algo, why = recipe.algorithm, None
    if algo.dynamic_sampling:
        why = "algorithm.dynamic_sampling (DAPO refills groups from the policy mid-step)"
    elif algo.ppo_epochs != 1:
        why = f"algorithm.ppo_epochs {algo.ppo_epochs} (one update epoch only)"
    elif ctx.enabled:
        why = f"{ctx.world_size} ranks (one process only for now)"
    if why is not None:
        raise ConfigError(f"trainer.overlap: one_step cannot apply with {why}; set trainer.overlap: off")


def collect_next(run: Run, step: int, cursor_now: dict[str, int], staleness: int) -> Pending | None:
    """Roll out step+1 from the weights the generator holds now (None after the last step). A service failure
    here saves step `step`'s start (its prompts drawn from `cursor_now`) when nothing newer is saved."""
    nxt = step + 1
    if nxt >= run.recipe.trainer.total_steps:
        return None
    cursor_before = run.cursor.state()
    run.reward_fn.set_step(nxt)  # scored with the reward of the step that trains on them
    stage = run.reward_fn.current_stage
    run.policy.eval()
    try:
        collected = collect_or_stop(run, nxt, stage, resume_at=(step, cursor_now))
    finally:
        run.reward_fn.set_step(step)
    release_rollout_memory(run)
    return Pending(collected, stage, cursor_before, staleness)


def behaviour_logprobs(trajs: list[Trajectory], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The generator's per-token log-probs in the token batch's response coordinates ([rows, response])."""
    out = torch.zeros(shape, dtype=dtype)
    for i, t in enumerate(trajs):
        if t.logprobs_missing or len(t.logprobs) != len(t.response_ids):
            raise RuntimeError(
                "trainer.overlap: one_step needs the rollout backend's per-token log-probs (the "
                "behaviour policy's); this backend did not report them: set trainer.overlap: off"
            )
        n = min(len(t.logprobs), shape[1])
        out[i, :n] = torch.tensor(t.logprobs[:n], dtype=torch.float64).to(dtype)
    return out
