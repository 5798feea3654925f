"""Step 1 of a training step: this rank's rollouts, scored, with DAPO's dynamic sampling refilling groups that
carry no signal; a service past its retry budget stops the run with every finished step kept. A method with its
own rollout (`Method.rollout`, e.g. Tree-GRPO's tree rollouts in plugins/sleuth_tree_grpo.py) is rolled out with
it; its groups may hold any number of trajectories."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sleuth.agent.engine import rollout
from sleuth.agent.registry import get_method
from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError, ServiceError
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
    trajs_all: list[Trajectory] = field(
        default_factory=list
    )  # every rollout of the step, before DAPO's filter
    rounds: int = 0
    t_rollout: float = 0.0
    t_reward: float = 0.0


def collect_rollouts(run: Run) -> Collected:
    """Roll out this rank's prompts and score them. With DAPO dynamic sampling, groups whose
    rewards are all equal carry no signal: they are dropped and new prompts are drawn until every
    rank holds its share of groups, or `max_sampling_rounds` is reached (ranks agree on when to stop)."""
    recipe, ctx, algo = run.recipe, run.ctx, run.recipe.algorithm
    target = run.local_prompts.stop - run.local_prompts.start  # groups (prompts) this rank trains on
    roll = method_rollout(run)
    out = Collected()
    last_round: tuple[list[Trajectory], list[float]] = ([], [])
    while out.rounds < algo.max_sampling_rounds:
        out.rounds += 1
        indices = run.cursor.take(algo.prompts_per_step)[
            run.local_prompts
        ]  # the same global draw on every rank
        t0 = time.perf_counter()
        with autocast(ctx.device):
            trajs = roll(
                run.loop,
                run.generator,
                run.retriever,
                [run.examples[i] for i in indices],
                run.sampling,
                n=algo.n,
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
        short = torch.tensor([float(_groups(out.trajs) < target)])
        if ctx.all_reduce_sum(short).item() == 0:
            break
    if not out.trajs:
        # every group stayed uniform: train on the last round (zero group advantages) so all ranks step
        out.trajs, out.scores = last_round
    keep_rows = _rows_of_first_groups(out.trajs, target)
    out.trajs, out.scores = out.trajs[:keep_rows], out.scores[:keep_rows]
    return out


def method_rollout(run: Run) -> Callable[..., list[Trajectory]]:
    """The training rollout of the run's method: its own (`Method.rollout`) or the engine's `rollout`."""
    own = get_method(run.recipe.agent.loop).rollout
    if own is not None and run.ctx.enabled:
        # its groups may differ in size between ranks, and so would the ranks' minibatches and collectives
        raise ConfigError(
            f"method {run.recipe.agent.loop!r} rolls out with its own rollout (trajectories per "
            f"question vary), which trains on one process only for now; got {run.ctx.world_size} ranks"
        )
    return own or rollout


def _groups(trajs: list[Trajectory]) -> int:
    return len(set(dense_group_ids(trajs)))


def _rows_of_first_groups(trajs: list[Trajectory], groups: int) -> int:
    """How many leading trajectories make up the first `groups` groups (a group's trajectories are adjacent)."""
    seen: set[int] = set()
    for i, g in enumerate(dense_group_ids(trajs)):
        if g not in seen and len(seen) == groups:
            return i
        seen.add(g)
    return len(trajs)


def collect_or_stop(run: Run, step: int, stage: int, resume_at: tuple[int, dict] | None = None) -> Collected:
    """Rollouts of this step; a service past its retry budget keeps every finished step, then stops naming it.
    `resume_at`: (steps done, data cursor) to checkpoint then, when not (step, the cursor now) (overlap's next step)."""
    done, cursor_before = resume_at or (step, run.cursor.state())
    try:
        return collect_rollouts(run)
    except ServiceError as err:
        raise service_stop(run, err, done, cursor_before, stage) from err


def service_stop(
    run: Run, err: ServiceError, done: int, cursor_before: dict[str, int], stage: int
) -> ServiceError:
    """A service past its retry budget: checkpoint `done` steps with `cursor_before` (unless nothing was done since
    the last checkpoint) and return the error that stops the run, naming what was kept."""
    where = "no new checkpoint (nothing done since the last one)"
    if done > run.last_saved and not run.ctx.enabled:  # a lone rank cannot run the collective save
        save(run, done, cursor_before, stage)
        run.last_saved = done
        where = f"checkpoint of step {done} written"
    return ServiceError(
        f"{err}\nstopped at step {done + 1} of {run.recipe.trainer.total_steps}: {where} under {run.out_dir}; "
        f"when the service is back, rerun with --resume (or raise services.retry.budget_s)"
    )
