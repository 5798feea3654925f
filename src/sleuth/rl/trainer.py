"""The RL trainer: setup (recipe -> one `Run`), then steps that read top to bottom like CleanRL's ppo.py:

    rollout -> score -> advantages -> update -> log (-> checkpoint) (-> validation on data.dev)

The pieces live one floor down: rollouts and scores (sleuth.rl.rollouts), models (sleuth.rl.models), token
batches, micro-batch plans, the policy-token forward and no-grad passes (sleuth.rl.batch), activation
checkpointing (sleuth.rl.memory_plan), recipe -> retriever/loop/data/reward services (sleuth.rl.setup), step
metrics (sleuth.rl.step_metrics, sleuth.rl.agreement), validation on data.dev (sleuth.rl.validate), the next step's
rollouts made before (`trainer.overlap: one_step`) or during (`one_step_async`) this step's update
(sleuth.rl.overlap), and the pure
numerics in the registries of sleuth.rl.advantages (estimators) and sleuth.rl.losses (policy losses).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from sleuth.agent.registry import get_method
from sleuth.agent.trajectory import Trajectory, write_trajectories
from sleuth.rewards.base import failed_trajectories
from sleuth.rl import advantages as adv_fns
from sleuth.rl import losses as loss_fns
from sleuth.rl import overlap
from sleuth.rl.agreement import rollout_agreement
from sleuth.rl.batch import (
    ForwardPlan,
    TokenBatch,
    adapter_free_logprobs,
    batched_logprobs,
    batched_values,
    chunks,
    collate,
    critic_values,
    forward_logprobs,
    forward_plan,
    reference_logprobs,
    to_device,
)
from sleuth.rl.batch import token_rewards as token_rewards_of
from sleuth.rl.config import Recipe
from sleuth.rl.dist import (
    DistContext,
    clip_grad_norm,
    dist_masked_whiten,
    init_distributed,
    unwrap,
)
from sleuth.rl.guard_actions import act_on_guards, final_message, record_step, start_guards
from sleuth.rl.health import health_metrics
from sleuth.rl.interrupts import sigterm_received, stop_reason
from sleuth.rl.memory_plan import update_plan_metrics
from sleuth.rl.models import autocast, dtype_of, release_rollout_memory, sync_rollout_weights
from sleuth.rl.overlap import behaviour_logprobs, check_overlap, collect_next, start_next
from sleuth.rl.rollouts import Collected, collect_or_stop
from sleuth.rl.run import Run, resume_cursor, save, setup
from sleuth.rl.run_dir import prepare_run_dir, write_failure
from sleuth.rl.run_metrics import machinery_metrics
from sleuth.rl.setup import check_input_paths
from sleuth.rl.sft import run_sft
from sleuth.rl.step_metrics import (
    acc_stat,
    add_stat,
    dense_group_ids,
    format_line,
    mean_over_ranks,
    step_metrics,
)
from sleuth.rl.validate import already_validated, validate, validation_due
from sleuth.run_layout import CHECKPOINTS, METRICS, SFT_DIR, checkpoint_dir, latest_checkpoint
from sleuth.utils import atomic_path, is_write_failure


def train(
    recipe: Recipe, *, resume: bool = False, overwrite: bool = False, console: Any = None
) -> dict[str, Any]:
    """Run the recipe. Inputs are checked first; a fresh run into another run's directory is refused
    (`overwrite` moves that run aside); a run that fails before logging a step removes the output
    directory it created, so a rerun does not find a half-made one."""
    check_input_paths(recipe)
    out_dir = Path(recipe.trainer.out_dir)
    prepare_run_dir(out_dir, resume=resume, overwrite=overwrite, console=console)
    created = not out_dir.exists()
    try:
        return _train(recipe, resume=resume, console=console)
    except BaseException as err:
        progress = any((out_dir / name).exists() for name in (METRICS, CHECKPOINTS, SFT_DIR))
        if created and not progress:
            shutil.rmtree(out_dir, ignore_errors=True)
        if is_write_failure(err):  # a full disk or read-only output: one line, not a traceback
            raise write_failure(err, out_dir) from None
        raise


@dataclass
class StepBatch:
    """One step's training data: token tensors and what the update needs per token."""

    trajs: list[Trajectory]
    scores: list[float]
    tokens: TokenBatch
    advantages: torch.Tensor
    returns: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # None: on-policy, the update's own forward gives them
    ref_logprobs: torch.Tensor | None = None
    # LoRA with a KL loss: (B,) True for the rows whose ref_logprobs (and kl) the update's micro-batches have
    # filled from the base model's forward; None: ref_logprobs came from a pass of their own in make_batch
    ref_rows: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    kl: torch.Tensor | None = None  # per-token KL(old || ref) for the log
    debug_path: Path | None = None
    plan: ForwardPlan = field(default_factory=lambda: ForwardPlan(1))  # micro-batches: rows, tokens, packed
    # the trainer's log-probs under the weights that rolled out (the old ones, or filled by the on-policy
    # update's own forward), set beside the rollout's for the agreement metric
    policy_logprobs: torch.Tensor | None = None
    staleness: int | None = (
        None  # trainer.overlap: updates between the weights that rolled out and these (else None)
    )


def _train(recipe: Recipe, *, resume: bool = False, console: Any = None) -> dict[str, Any]:
    console = console or Console()
    if recipe.sft is not None and recipe.model.init_from is None:
        # SFT first (resumable; a finished SFT run is reused), then RL from its final checkpoint
        sft = run_sft(recipe, resume=True, console=console)
        recipe = recipe.model_copy(
            update={"model": recipe.model.model_copy(update={"init_from": sft["checkpoint"]})}
        )
    ctx = init_distributed(recipe.model.device)
    check_overlap(recipe, ctx)
    if not ctx.is_main:
        console = Console(quiet=True)
    run = setup(recipe, ctx, console, resume)
    if (
        run.val_examples
        and validation_due(recipe, run.start_step)
        and not already_validated(run, run.start_step)
    ):
        validate(run, run.start_step)  # before training, or the one a stop right after a checkpoint missed
    run.guards = start_guards(run)
    started = time.monotonic()
    metrics: dict[str, float] = {}  # the last step's, for the final report
    done = step = run.start_step
    while step < recipe.trainer.total_steps:
        metrics = train_step(run, step)
        step = done = step + 1
        if run.guards.stopped:
            break
        if run.guards.rewound_to is not None:  # a guard rolled back: go on from its checkpoint
            step = done = run.guards.rewound_to
            run.guards.rewound_to = None
            run.pending = None  # rolled out by the abandoned weights
            continue
        stop = stop_reason(run, started) if done < recipe.trainer.total_steps else None
        if stop is not None:
            # a scheduler's wall-time limit or a preemption (SIGTERM): keep every finished step; `--resume` continues
            if recipe.trainer.save_every and run.last_saved != done:  # save_every 0: no checkpoints at all
                save(run, done, resume_cursor(run), run.reward_fn.current_stage)
                run.last_saved = done
            # close the validation series at the step reached, so a stopped run's curve has its end point
            if run.val_examples and not validation_due(recipe, done) and stop.validate:
                validate(run, done)
            console.print(
                f"{stop.message} after step {done} of {recipe.trainer.total_steps}; checkpoint saved, "
                "resume to continue"
            )
            break
    if run.services.baseline_cache is not None:
        run.services.baseline_cache.save()
    # the checkpoint this run wrote (or resumed from, when nothing was left to do): never an older run's;
    # a guard's rollback deletes the steps it abandoned, and then the run's last checkpoint is the one kept
    final = checkpoint_dir(run.out_dir, run.last_saved) if run.last_saved > 0 else None
    if final is not None and not final.exists():
        final = latest_checkpoint(run.out_dir)
    guarded = final_message(run.guards)
    result = {
        "out_dir": str(run.out_dir),
        "checkpoint": str(final) if final else None,
        "steps_done": done,
        "stopped_at_time_limit": done < recipe.trainer.total_steps
        and not run.guards.stopped
        and not sigterm_received(),
        "stopped_by_sigterm": done < recipe.trainer.total_steps and sigterm_received(),
        "stopped_by_guard": run.guards.stopped,
        "guards": guarded,
    }
    if guarded:
        console.print(f"[bold]guards[/]: {guarded}")
    if run.log is not None:
        run.log.finish({**result, "steps": recipe.trainer.total_steps, "final_metrics": metrics})
    return result


def train_step(run: Run, step: int) -> dict[str, float]:
    """rollout -> score -> advantages -> update -> log -> checkpoint -> validation (when due)."""
    recipe = run.recipe
    t_start = time.perf_counter()
    run.reward_fn.set_step(step)
    stage = (
        run.reward_fn.current_stage
    )  # a reward with a schedule (Reward.current_stage) switches on the step

    # 1. rollout and score (each rank its slice of the prompts); with trainer.overlap, step k-1 made them from the
    # weights it started with (sleuth.rl.overlap), and this step makes step k+1's now, before its own update
    staleness, cursor_now, pending = 0, run.cursor.state(), run.pending
    if pending is not None:
        collected, staleness, cursor_now, run.pending = (
            pending.collected,
            pending.staleness,
            pending.cursor_before,
            None,
        )
    else:
        run.policy.eval()
        collected = collect_or_stop(run, step, stage)
    mode = recipe.trainer.overlap
    overlapped, background = mode != "off", None
    if mode == "one_step" and not overlap.WAIT_FOR_UPDATE:
        run.pending = collect_next(run, step, cursor_now, staleness=1)
    elif mode == "one_step_async":
        # the same rollout on a thread, decoding a snapshot, while we update
        background = start_next(run, step)
    if background is None:  # (a background rollout still decodes: its KV pool goes after the join)
        release_rollout_memory(run)  # before the log-prob passes and the update, which need the memory

    # 2. tensors, old/ref log-probs, values, advantages; 3. K epochs of minibatch updates
    t2 = time.perf_counter()
    try:
        batch, stats, t3 = _batch_and_update(run, step, collected, staleness)
    except BaseException:
        if background is not None:  # it still reads the run's objects: let it end before the error unwinds
            background.abandon()
        raise
    batch.staleness = staleness if overlapped else None
    waited = 0.0
    if background is not None:
        run.pending = background.join()  # before the refresh: the engine's copy is what it decodes
        release_rollout_memory(run)
        # the update's wait for the next step's rollout: apart from time/update, so a step is ~ update + wait
        stats["time/overlap_wait"], waited = [background.waited], background.waited
    t4 = time.perf_counter()
    sync_rollout_weights(run)
    t_update = time.perf_counter() - t2 - waited
    stats["time/make_batch"], stats["time/weight_sync"] = (
        [t3 - t2],
        [time.perf_counter() - t4],
    )  # parts of update
    if mode == "one_step" and overlap.WAIT_FOR_UPDATE:  # tests: the overlapped path at staleness 0
        run.pending = collect_next(run, step, cursor_now, staleness=0)

    # 4. log (metrics averaged over ranks; every rank holds an equal share of the batch)
    metrics = _log_step(run, step, stage, collected, batch, stats, {"update": t_update, "start": t_start})

    # 5. checkpoint (the data cursor is global, so a run resumes on any number of ranks)
    done = step + 1
    every = recipe.trainer.save_every
    if every and (done % every == 0 or done == recipe.trainer.total_steps):
        save(run, done, resume_cursor(run), stage)
        run.last_saved = done
    if background is not None and background.service_error is not None:
        # this step is kept (logged, checkpointed); the next one's rollout found a service down
        raise background.stop_for_service(done)

    # 6. validation on data.dev (after the checkpoint: a failure here loses no training)
    validated = bool(run.val_examples) and validation_due(recipe, done)
    if validated:
        validate(run, done)

    # 7. guards (sleuth.rl.guard_actions): warn, stop with a checkpoint, or roll back
    act_on_guards(run, done, validated)
    return metrics


def _batch_and_update(run: Run, step: int, collected: Collected,
                      staleness: int) -> tuple[StepBatch, dict[str, list[float]], float]:  # fmt: skip
    """The step's tensors and no-grad passes, then its update and scheduler step: (batch, update stats, the time
    the update began)."""
    batch = make_batch(run, collected.trajs, collected.scores, behaviour=staleness > 0)
    batch.debug_path = run.out_dir / "debug" / f"nonfinite_step_{step + 1:06d}_rank{run.ctx.rank}.pt"
    t3 = time.perf_counter()
    run.policy.train()
    stats = update(run, batch)
    for s in run.schedulers.values():
        s.step()
    return batch, stats, t3


def make_batch(run: Run, trajs: list[Trajectory], scores: list[float], behaviour: bool = False) -> StepBatch:
    """Token tensors, the no-grad passes the update needs, token rewards (KL penalty) and advantages.
    `behaviour`: rolled out by older weights (overlap): the generator's recorded log-probs are the old ones."""
    recipe, algo, device = run.recipe, run.recipe.algorithm, run.ctx.device
    tokens = collate(trajs, run.tokenizer.pad_token_id, drop_truncated=algo.overlong_filter)
    plan, temperature, kl_coef = forward_plan(recipe, run.policy), recipe.sampling.temperature, algo.kl.coef
    # One update over the whole batch is on-policy: the old log-probs are the ones the update's own
    # forward computes, so the extra no-grad pass is skipped (unless a KL reward penalty needs them).
    on_policy = algo.ppo_epochs == 1 and run.local_minibatch >= len(trajs)
    needs_old = not on_policy or (kl_coef > 0 and algo.kl.mode == "penalty")
    if behaviour:
        old_logprobs = behaviour_logprobs(trajs, tokens.action_mask.shape, dtype_of(run.policy))
    else:
        old_logprobs = batched_logprobs(run.policy, tokens, temperature, plan, device) if needs_old else None
    mask, float_t = tokens.action_mask, torch.promote_types(dtype_of(run.policy), torch.float32)
    ref_logprobs = ref_rows = kl = None
    if kl_coef > 0:
        if run.reference is not None:
            ref_logprobs = reference_logprobs(run.reference, tokens, temperature, plan, device)
        elif algo.kl.mode == "penalty":
            # LoRA: the base model (adapters off) is the reference. A reward penalty shapes the advantages, which
            # the update needs from its first micro-batch on: its log-probs take a pass of their own, here
            with unwrap(run.policy).disable_adapter():
                ref_logprobs = batched_logprobs(run.policy, tokens, temperature, plan, device)
        else:  # LoRA, KL loss: each update micro-batch runs the base model over its own tokens (_micro_step)
            ref_logprobs, kl = torch.zeros(mask.shape, dtype=float_t), torch.zeros(mask.shape, dtype=float_t)
            ref_rows = torch.zeros(len(trajs), dtype=torch.bool)
    score_t = torch.tensor(scores, dtype=float_t)
    token_rewards = token_rewards_of(trajs, score_t, mask)
    if ref_logprobs is not None and ref_rows is None:
        if old_logprobs is not None:
            kl = loss_fns.kl_penalty(old_logprobs, ref_logprobs, algo.kl.estimator)
        if algo.kl.mode == "penalty":
            token_rewards = loss_fns.apply_kl_penalty(token_rewards, kl, run.kl_coef, mask)
            _adapt_kl_coef(run, kl, mask)
    old_values = None
    if run.critic is not None:
        run.critic.eval()
        old_values = batched_values(run.critic, tokens, algo.micro_batch_size, device)
    advantages, returns = estimate_advantages(run, token_rewards, mask, old_values, trajs)
    # the agreement metric needs the trainer's forward of the rollout's weights: not kept under overlap
    policy_logprobs = (
        None if behaviour else old_logprobs if old_logprobs is not None else torch.zeros(mask.shape)
    )
    return StepBatch(
        trajs,
        scores,
        tokens,
        advantages,
        returns,
        old_logprobs,
        ref_logprobs,
        ref_rows,
        old_values,
        kl,
        plan=plan,
        policy_logprobs=policy_logprobs,
    )


def _adapt_kl_coef(run: Run, kl: torch.Tensor, mask: torch.Tensor) -> None:
    """verl's kl_ctrl after a penalised batch: the global batch's mean sequence KL sets the next coef."""
    kl_cfg = run.recipe.algorithm.kl
    if kl_cfg.type != "adaptive":
        return
    per_seq = loss_fns.sequence_mean_kl(kl.float(), mask)
    total = run.ctx.all_reduce_sum(
        torch.stack([per_seq.sum(), torch.tensor(float(len(per_seq)))]).to(kl.device)
    )
    current_kl, n = total[0].item() / max(total[1].item(), 1.0), int(total[1].item())
    run.kl_coef = loss_fns.adaptive_kl_coef(run.kl_coef, current_kl, kl_cfg.target_kl, kl_cfg.horizon, n)


def estimate_advantages(run: Run, token_rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None,
                        trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recipe's estimator through the registry. Groups never span ranks; an estimator that can
    whiten is asked not to, and is whitened here with global statistics."""
    algo = run.recipe.algorithm
    inputs = adv_fns.estimator_inputs(algo.advantage)
    options: dict[str, Any] = {k: getattr(algo, k) for k in ("gamma", "lam") if k in inputs}
    if "trajectories" in inputs:  # an estimator that reads the rollouts' structure (Tree-GRPO's trees)
        options["trajectories"] = trajs
    if "whiten" in inputs:
        options["whiten"] = False
    advantages, returns = adv_fns.compute_advantages(
        algo.advantage,
        token_rewards=token_rewards,
        response_mask=mask,
        values=values,
        group_ids=dense_group_ids(trajs) if "group_ids" in inputs else None,
        **options,
    )
    if "whiten" in inputs:
        advantages = dist_masked_whiten(advantages, mask, run.ctx)
    return advantages, returns


def _log_step(run: Run, step: int, stage: int, collected: Collected, batch: StepBatch,
              stats: dict[str, list[float]], times: dict[str, float]) -> dict[str, float]:  # fmt: skip
    ctx, recipe, mask = run.ctx, run.recipe, batch.tokens.action_mask
    answers = get_method(recipe.agent.loop).answers
    metrics = step_metrics(
        batch.trajs, batch.scores, collected.all_rewards, mask, batch.kl, stats, answers=answers
    )
    metrics.update(
        {
            "stage": float(stage),
            "sampling_rounds": float(collected.rounds),
            "time/rollout": collected.t_rollout,
            "time/reward": collected.t_reward,
            "time/update": times["update"],
            "time/step": time.perf_counter() - times["start"],
            "tokens/policy_per_s": float(mask.sum()) / max(collected.t_rollout, 1e-9),
            **machinery_metrics(run),
            **rollout_agreement(
                batch.trajs, mask, batch.policy_logprobs
            ),  # LoRA weights that never reached rollouts
            **update_plan_metrics(run.policy, batch.plan),
        }
    )
    if batch.staleness is not None:
        metrics["rollout/staleness"] = float(batch.staleness)
    failed = failed_trajectories(collected.trajs_all)
    metrics["rollout/errors"] = float(len(failed))
    metrics = mean_over_ranks(metrics, ctx)
    metrics.update(health_metrics(collected.trajs_all, collected.all_rewards, stats, ctx))  # global ratios
    metrics["lr"] = run.schedulers["policy"].get_last_lr()[0]
    if ctx.enabled:
        metrics["tokens/policy_per_s"] *= ctx.world_size
    if ctx.is_main:
        record_step(run, step + 1, metrics)  # the guards' history; adds the trend metrics
        run.log.write(step + 1, metrics)
        run.console.print(format_line(step + 1, recipe.trainer.total_steps, metrics))
        kept = batch.trajs
        write_trajectories(
            run.out_dir / "rollouts" / f"step_{step + 1:06d}.jsonl", kept[: min(len(kept), 32)]
        )
    if failed:  # one example per step is enough to debug; the count is in the metrics
        write_trajectories(
            run.out_dir / "debug" / f"failed_step_{step + 1:06d}_rank{ctx.rank}.jsonl", failed[:1]
        )
    return metrics


def update(run: Run, batch: StepBatch) -> dict[str, list[float]]:
    """PPO-style epochs over minibatches, micro-batched for memory. Loss normalisers are the
    minibatch's global totals divided by the number of ranks, so DDP's gradient mean equals the
    gradient of one process's loss over the whole minibatch."""
    algo, ctx, mask = run.recipe.algorithm, run.ctx, batch.tokens.action_mask
    stats: dict[str, list[float]] = {
        "update/tokens": [float(batch.tokens.row_lengths().sum())]
    }  # prompt + response
    n_traj = batch.tokens.input_ids.shape[0]
    for _epoch in range(algo.ppo_epochs):
        perm = torch.randperm(n_traj)
        for mb_slice in chunks(n_traj, run.local_minibatch):
            mb_idx = perm[mb_slice]
            counts = ctx.all_reduce_sum(torch.tensor([float(mask[mb_idx].sum()), float(len(mb_idx))]))
            totals = {
                "num_tokens": max(counts[0].item(), 1.0) / ctx.world_size,
                "num_seqs": counts[1].item() / ctx.world_size,
            }
            for o in run.optimizers.values():
                o.zero_grad(set_to_none=True)
            # micro-batches by rows and tokens (ForwardPlan): positions within the minibatch
            micro_slices = batch.plan.split(batch.tokens.index(mb_idx))
            add_stat(stats, "update/micro_batches", float(len(micro_slices)))
            # losses are summed over micro-batches: each is normalised by the minibatch totals, so the
            # sum is this rank's share of the minibatch loss (averaged over ranks when logged)
            mb_losses: dict[str, float] = {}
            seconds = []
            for i, mi_slice in enumerate(micro_slices):
                # DDP: all-reduce gradients once per minibatch, on its last micro-batch
                sync = i == len(micro_slices) - 1
                t_micro = time.perf_counter()
                _micro_step(run, batch, mb_idx[mi_slice], totals, sync, stats, mb_losses)
                # wall time is device time here: the micro-step ends reading its losses (.item() waits for them)
                seconds.append(time.perf_counter() - t_micro)
            for k, v in mb_losses.items():
                add_stat(stats, k, v)
            t_optimizer = time.perf_counter()
            _optimizer_steps(run, batch, mb_idx, stats)
            # where an update's time goes beyond its forward/backward passes (issue 43's profile): the first
            # micro-batch of a shape pays kernel plans and allocator growth, the slowest one the widest rows
            add_stat(stats, "time/micro_batch", sum(seconds) / len(seconds))
            add_stat(stats, "time/micro_batch_first", seconds[0])
            add_stat(stats, "time/micro_batch_max", max(seconds))
            add_stat(stats, "time/micro_batches", sum(seconds))
            add_stat(stats, "time/optimizer", time.perf_counter() - t_optimizer)
    return stats


def _micro_step(run: Run, batch: StepBatch, idx: torch.Tensor, totals: dict[str, float], sync: bool,
                stats: dict[str, list[float]], mb_losses: dict[str, float]) -> None:  # fmt: skip
    """Forward and backward of one micro-batch: policy loss (+ entropy bonus, + KL loss), then the critic's."""
    algo, device = run.recipe.algorithm, run.ctx.device
    mi = to_device(batch.tokens.index(idx, batch.plan.width_multiple), device)
    m = mi.action_mask
    # LoRA with a KL loss: the reference log-probs of these rows, once (later epochs reuse them), from the base
    # model over this same micro-batch; before the policy's forward, so its activations are not held meanwhile
    fresh_ref = batch.ref_rows is not None and not bool(batch.ref_rows[idx].all())
    with _maybe_no_sync(run.policy, sync), autocast(device):
        if fresh_ref:
            batch.ref_logprobs[idx] = adapter_free_logprobs(
                run.policy, mi, run.recipe.sampling.temperature, batch.plan.packed
            ).to(batch.ref_logprobs)
            batch.ref_rows[idx] = True
        logprobs, entropy = forward_logprobs(
            run.policy, mi, run.recipe.sampling.temperature, with_entropy=True, packed=batch.plan.packed
        )
        if batch.old_logprobs is None:  # one on-policy epoch: the ratio's old side is this forward, detached
            old = logprobs.detach()
            if batch.policy_logprobs is not None:
                batch.policy_logprobs[idx] = old.to(batch.policy_logprobs)
        else:
            old = batch.old_logprobs[idx].to(device)
        agg = loss_fns.LossAgg(algo.loss_agg, **totals)
        clip = loss_fns.PolicyClip(algo.clip_low, algo.clip_high, algo.clip_ratio_c)
        pg_loss, pg_stats = loss_fns.get_policy_loss(algo.policy_loss)(
            old,
            logprobs,
            batch.advantages[idx].to(device),
            m,
            clip=clip,
            agg=agg,
        )
        loss = pg_loss
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * agg(entropy, m)
        if batch.ref_logprobs is not None and algo.kl.mode == "loss":
            ref = batch.ref_logprobs[idx].to(device)
            if fresh_ref:  # KL(old || ref) for the log, as make_batch's separate passes give it
                batch.kl[idx] = loss_fns.kl_penalty(old, ref, algo.kl.estimator).to(batch.kl)
            kl_term = loss_fns.kl_loss(logprobs, ref, m, kind=algo.kl.estimator, agg=agg)
            loss = loss + algo.kl.coef * kl_term
            acc_stat(mb_losses, "actor/kl_loss", kl_term.item())
        loss.backward()
    acc_stat(mb_losses, "actor/pg_loss", pg_loss.item())
    add_stat(stats, "actor/entropy", loss_fns.agg_loss(entropy.detach(), m, algo.loss_agg).item())
    for k, v in pg_stats.items():
        add_stat(stats, f"actor/{k}", float(v))
    if run.critic is not None:
        with _maybe_no_sync(run.critic, sync), autocast(device):
            values = critic_values(run.critic, mi)
            v_loss, v_stats = loss_fns.value_loss(
                values,
                batch.old_values[idx].to(device),
                batch.returns[idx].to(device),
                m,
                clip=algo.value_clip,
                agg=agg,
            )
            (algo.value_coef * v_loss).backward()
        acc_stat(mb_losses, "critic/value_loss", v_loss.item())
        add_stat(stats, "critic/clipfrac", float(v_stats["vf_clipfrac"]))


def _optimizer_steps(run: Run, batch: StepBatch, mb_idx: torch.Tensor, stats: dict[str, list[float]]) -> None:
    policy, ctx, grad_clip = run.policy, run.ctx, run.recipe.optim.grad_clip
    grad_norm = _step_if_finite(
        run.optimizers["policy"], [p for p in policy.parameters() if p.requires_grad], grad_clip, ctx
    )
    add_stat(stats, "actor/skipped_nonfinite_grad", float(not math.isfinite(grad_norm)))
    if math.isfinite(grad_norm):
        add_stat(stats, "actor/grad_norm", grad_norm)
    else:
        _report_nonfinite(
            policy,
            grad_norm,
            batch.debug_path,
            {
                "batch": {k: v[mb_idx] for k, v in vars(batch.tokens).items()},
                "advantages": batch.advantages[mb_idx],
                "ref_logprobs": None if batch.ref_logprobs is None else batch.ref_logprobs[mb_idx],
                "micro_batch_size": run.recipe.algorithm.micro_batch_size,
            },
        )
    if run.critic is not None:
        critic_norm = _step_if_finite(run.optimizers["critic"], list(run.critic.parameters()), grad_clip, ctx)
        add_stat(stats, "critic/skipped_nonfinite_grad", float(not math.isfinite(critic_norm)))


def _step_if_finite(
    optimizer: torch.optim.Optimizer, params: list, max_norm: float, ctx: DistContext
) -> float:
    """Clip to the global gradient norm and step; returns the norm. A non-finite norm (global, so
    every rank agrees) would turn the weights into NaN for good: that step is skipped, as verl does."""
    norm = clip_grad_norm(params, max_norm, ctx)
    if math.isfinite(norm):
        optimizer.step()
    return norm


def _report_nonfinite(
    policy: nn.Module, norm: float, debug_path: Path | None, minibatch: dict[str, Any]
) -> None:
    """Name the parameters with non-finite gradients and save the minibatch to reproduce it offline."""
    bad = [n for n, p in policy.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    if debug_path is not None:
        with atomic_path(debug_path) as tmp:
            torch.save({**minibatch, "nonfinite_parameters": bad}, tmp)
    logging.getLogger(__name__).warning(
        "non-finite gradient (norm %s) in %d parameter(s), e.g. %s; optimizer step skipped%s",
        norm,
        len(bad),
        ", ".join(bad[:3]),
        f"; minibatch saved to {debug_path}" if debug_path is not None else "",
    )


def _maybe_no_sync(model: nn.Module, sync: bool):
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
