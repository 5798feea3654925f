"""Step 1 of a training step: this rank's rollouts, scored, with DAPO's dynamic sampling refilling groups that
carry no signal; a service past its retry budget stops the run with every finished step kept."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sleuth.agent.engine import rollout
from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ServiceError
from sleuth.rewards.base import guarded_rewards
from sleuth.rl.models import autocast
from sleuth.rl.run import Run, save
from sleuth.rl.sampling import filter_groups
from sleuth.rl.setup import rollout_budget
from sleuth.rl.step_metrics import dense_group_ids


@dataclass
class Collected:
    trajs: list[Trajectory] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    all_rewards: list[float] = field(default_factory=list)  # before DAPO's filter
    trajs_all: list[Trajectory] = field(default_factory=list)  # every rollout of the step, before DAPO's filter
    rounds: int = 0
    t_rollout: float = 0.0
    t_reward: float = 0.0


def collect_rollouts(run: Run) -> Collected:
    """Roll out this rank's prompts and score them. With DAPO dynamic sampling, groups whose
    rewards are all equal carry no signal: they are dropped and new prompts are drawn until every
    rank holds its share of groups, or `max_sampling_rounds` is reached (ranks agree on when to stop)."""
    recipe, ctx, algo = run.recipe, run.ctx, run.recipe.algorithm
    target = (run.local_prompts.stop - run.local_prompts.start) * algo.n
    out = Collected()
    last_round: tuple[list[Trajectory], list[float]] = ([], [])
    while out.rounds < algo.max_sampling_rounds:
        out.rounds += 1
        indices = run.cursor.take(algo.prompts_per_step)[run.local_prompts]  # the same global draw on every rank
        t0 = time.perf_counter()
        with autocast(ctx.device):
            trajs = rollout(
                run.loop, run.generator, run.retriever, [run.examples[i] for i in indices], run.sampling, n=algo.n,
                budget=rollout_budget(recipe),
            )
        t1 = time.perf_counter()
        results = guarded_rewards(run.reward_fn, trajs, run.services)
        out.t_rollout += t1 - t0
        out.t_reward += time.perf_counter() - t1
        for t, r in zip(trajs, results, strict=True):
            t.rewards = {"total": r.total, **r.components}
            t.sampling_round = out.rounds
        round_scores = torch.tensor([r.total for r in results], dtype=torch.float32)
        out.trajs_all += trajs
        out.all_rewards += round_scores.tolist()
        last_round = (list(trajs), round_scores.tolist())
        if algo.dynamic_sampling:
            keep = filter_groups(round_scores, dense_group_ids(trajs))
            trajs = [t for t, k in zip(trajs, keep.tolist(), strict=True) if k]
            round_scores = round_scores[keep]
        out.trajs += trajs
        out.scores += round_scores.tolist()
        if not algo.dynamic_sampling:
            break
        short = torch.tensor([float(len(out.trajs) < target)])
        if ctx.all_reduce_sum(short).item() == 0:
            break
    if not out.trajs:
        # every group stayed uniform: train on the last round (zero group advantages) so all ranks step
        out.trajs, out.scores = last_round
    out.trajs, out.scores = out.trajs[:target], out.scores[:target]
    return out


def collect_or_stop(run: Run, step: int, stage: int, resume_at: tuple[int, dict] | None = None) -> Collected:
    """Rollouts of this step; a service past its retry budget keeps every finished step, then stops naming it.
    `resume_at`: (steps done, data cursor) to checkpoint then, when not (step, the cursor now) (overlap's next step)."""
    done, cursor_before = resume_at or (step, run.cursor.state())
    try:
        return collect_rollouts(run)
    except ServiceError as err:
        where = "no new checkpoint (nothing done since the last one)"
        if done > run.last_saved and not run.ctx.enabled:  # a lone rank cannot run the collective save
            save(run, done, cursor_before, stage)
            where = f"checkpoint of step {done} written"
        raise ServiceError(
            f"{err}\nstopped at step {done + 1} of {run.recipe.trainer.total_steps}: {where} under {run.out_dir}; "
            f"when the service is back, rerun with --resume (or raise services.retry.budget_s)"
        ) from err
