"""What the trainer does when a guard fires: warn, stop with a checkpoint, or roll back to a healthy checkpoint.

Under torchrun the main rank evaluates the guards (it holds the logged metrics, which are already averaged over
ranks) and sends its decision to every rank in one all-reduce, so all ranks stop, roll back or go on alike.
A rollback restores the policy (and critic), optimizer and scheduler states of the newest intact checkpoint the
guard considers healthy, multiplies the learning rate by the guard's `lr_factor`, drops the logged rows and
checkpoints of the abandoned steps, and goes on from there. The data cursor and the random state are not
restored: the redone steps draw new questions and new samples instead of replaying the ones that went wrong.
Each guard rolls back at most `max_rollbacks` times; past that, or with no healthy checkpoint left, it stops.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sleuth.rl.checkpoint import load_optimizer_states, load_training_state, verify_checkpoint
from sleuth.rl.guards import GuardEvent, GuardMonitor, decide, read_validation
from sleuth.rl.loggers import JsonlLogger
from sleuth.rl.models import load_policy, sync_rollout_weights
from sleuth.rl.run import Run, resume_cursor, save
from sleuth.rl.setup import apply_optim_recipe
from sleuth.run_layout import (
    CRITIC,
    GUARDS,
    LATEST,
    POLICY_DIR,
    VALIDATION,
    checkpoint_dir,
    checkpoints_dir,
    validation_records,
)
from sleuth.utils import atomic_write_text

_ACTIONS = {"go on": 0.0, "rollback": 1.0, "stop": 2.0}


@dataclass
class GuardState:
    monitor: GuardMonitor | None  # the main rank's; None on the others
    stopped: str | None = None  # the message of a guard stop
    rewound_to: int | None = None  # set by a rollback: the step training continues from
    rollbacks: list[str] = field(default_factory=list)  # one line per rollback, for the final message


def start_guards(run: Run) -> GuardState:
    """The guards of a (possibly resumed) run: the monitor rebuilt from the run directory, and the learning
    rate of the rollbacks done before the resume."""
    monitor = None
    scale = torch.zeros(1, dtype=torch.float64)
    if run.ctx.is_main:
        monitor = GuardMonitor.from_run_dir(run.recipe.trainer.guards, run.out_dir, run.start_step)
        _write_events(run.out_dir, monitor.events)  # warnings of steps a resume redoes are dropped
        scale[0] = monitor.lr_scale()
    scale = float(run.ctx.all_reduce_sum(scale).item())
    if scale != 1.0:
        apply_lr_scale(run, scale)
    return GuardState(monitor)


def record_step(run: Run, done: int, metrics: dict[str, float]) -> None:
    """Main rank, before the step's row is logged: the row joins the monitor, its trend metrics the row."""
    if run.guards is not None and run.guards.monitor is not None:
        metrics.update(run.guards.monitor.record(done, metrics))


def act_on_guards(run: Run, done: int, validated: bool) -> None:
    """After the step that makes `done` updates (and its validation, if one ran): check, decide, act
    (a collective: every rank calls it; the main rank decides)."""
    state: GuardState = run.guards
    decision = torch.zeros(3, dtype=torch.float64)  # action, rollback target step, lr factor
    events: list[GuardEvent] = []
    chosen: GuardEvent | None = None
    if state.monitor is not None:
        events, chosen, target = _decide(run, state.monitor, done, validated)
        if chosen is not None:
            decision[:] = torch.tensor(
                [_ACTIONS[chosen.action], target, _guard(run, chosen.guard).lr_factor], dtype=torch.float64
            )
    action, target_step, factor = run.ctx.all_reduce_sum(decision).tolist()
    outcome = ""
    if action == _ACTIONS["stop"]:
        outcome = _stop(run, done, chosen)
    elif action == _ACTIONS["rollback"]:
        outcome = _rollback(run, int(target_step), factor)
    if chosen is not None:
        chosen.outcome = outcome
        chosen.values["lr_factor"] = factor
        if action == _ACTIONS["stop"]:
            state.stopped = f"stopped by guard {chosen.guard} after step {done}: {chosen.message}; {outcome}"
        else:
            state.rollbacks.append(f"rolled back at step {done} because {chosen.guard}: {chosen.message}")
            run.console.print(
                f"[bold red]guard {chosen.guard} after step {done}[/]: {chosen.message}; {outcome}"
            )
    if state.monitor is not None and events:
        state.monitor.events += events
        _write_events(run.out_dir, state.monitor.events)


def _decide(run: Run, monitor: GuardMonitor, done: int, validated: bool):
    """Main rank: the events of this step, the one acted on (a rollback that cannot happen becomes a stop),
    and the rollback's target step."""
    if validated and validation_records(run.out_dir, done).exists():
        stage = float(run.reward_fn.current_stage)
        monitor.add_validation(read_validation(validation_records(run.out_dir, done), done, stage))
    events = monitor.check(done, validated=validated)
    chosen = decide(events)
    target = -1
    if chosen is not None and chosen.action == "rollback":
        ckpt = _rollback_target(run.out_dir, chosen.healthy_until)
        done_before = monitor.rollbacks(chosen.guard)
        if ckpt is None:
            chosen.action = "stop"
            chosen.message += (
                f"; no intact checkpoint at or before step {chosen.healthy_until} is left to roll "
                "back to (raise trainer.keep_checkpoints or lower trainer.save_every)"
            )
        elif done_before >= _guard(run, chosen.guard).max_rollbacks:
            chosen.action = "stop"
            chosen.message += (
                f"; not rolled back again: it already rolled back {done_before} time(s) (max_rollbacks)"
            )
        else:
            target = int(ckpt.name.removeprefix("step_"))
    for e in events:
        if e.action == "warn":
            e.outcome = "warned"
            run.console.print(f"[yellow]guard {e.guard} after step {done}[/]: {e.message}")
        elif e is not chosen:
            e.outcome = f"superseded by {chosen.guard}"
    return events, chosen, target


def _guard(run: Run, name: str):
    return next(g for g in run.recipe.trainer.guards if g.name == name)


def _rollback_target(out_dir: Path, healthy_until: int | None) -> Path | None:
    """The newest intact checkpoint at or before `healthy_until` updates."""
    if healthy_until is None or healthy_until < 1:
        return None
    found = sorted((p for p in checkpoints_dir(out_dir).glob("step_*") if p.is_dir()), reverse=True)
    for ckpt in found:
        if int(ckpt.name.removeprefix("step_")) > healthy_until:
            continue
        try:
            verify_checkpoint(ckpt)
        except Exception:  # noqa: BLE001 - a damaged checkpoint is skipped, as resume does
            continue
        return ckpt
    return None


def _stop(run: Run, done: int, chosen: GuardEvent | None) -> str:
    """Checkpoint the current state (collective), so the run can be inspected or resumed."""
    where = "no checkpoint written (trainer.save_every is 0)"
    if run.recipe.trainer.save_every:
        if run.last_saved != done:
            save(run, done, resume_cursor(run), run.reward_fn.current_stage)
            run.last_saved = done
        where = f"checkpoint {checkpoint_dir(run.out_dir, done)}"
    if chosen is not None and chosen.healthy_until is not None:
        healthy = _rollback_target(run.out_dir, chosen.healthy_until)
        if healthy is not None:
            where += f"; the last one it considers healthy: {healthy}"
    run.guards.stopped = where
    return f"stopped: {where}"


def _rollback(run: Run, target: int, factor: float) -> str:
    """Every rank: restore checkpoint `target`, lower the learning rate, forget the abandoned steps."""
    ckpt = checkpoint_dir(run.out_dir, target)
    scale = factor * _current_scale(run)
    restore_weights_and_optimizers(run, ckpt, scale)
    if run.ctx.is_main:
        JsonlLogger(run.out_dir, target)  # drops metrics.jsonl rows after `target` (they are redone)
        JsonlLogger(run.out_dir, target, VALIDATION)
        root = checkpoints_dir(run.out_dir)
        for newer in root.glob("step_*"):  # the abandoned steps' checkpoints: resume must not pick them
            if newer.is_dir() and int(newer.name.removeprefix("step_")) > target:
                shutil.rmtree(newer, ignore_errors=True)
        atomic_write_text(root / LATEST, ckpt.name + "\n")
        run.guards.monitor.rewind(target)
    run.ctx.barrier()
    run.last_saved = target
    run.guards.rewound_to = target
    return f"rolled back to {ckpt} (learning rate x{factor:g}, now {run.recipe.optim.lr * scale:.3g})"


def _current_scale(run: Run) -> float:
    sched = run.schedulers["policy"]
    return sched.base_lrs[0] / run.recipe.optim.lr


def restore_weights_and_optimizers(run: Run, ckpt: Path, lr_scale: float) -> None:
    """Load a checkpoint's policy (and critic), optimizer and scheduler states into the running models, in
    place (DDP or FSDP: through the full-state-dict API; every rank reads the checkpoint)."""
    # deferred: a heavy torch submodule only checkpoints need
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _, tensor_state = load_training_state(ckpt)
    _, fresh, _ = load_policy(run.recipe, torch.device("cpu"), ckpt / POLICY_DIR)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(run.policy, fresh.state_dict(), options=options)
    del fresh
    if run.critic is not None:
        critic_state = torch.load(ckpt / CRITIC, map_location="cpu", weights_only=True)
        set_model_state_dict(run.critic, critic_state, options=options)
    load_optimizer_states(run.models, run.optimizers, tensor_state["optimizers"])
    for name, sched in run.schedulers.items():
        sched.load_state_dict(tensor_state["schedulers"][name])
    apply_lr_scale(run, lr_scale)
    sync_rollout_weights(run)


def apply_lr_scale(run: Run, scale: float) -> None:
    """Set every optimizer's learning rate to the recipe's times `scale`, keeping the schedule's position."""
    apply_optim_recipe(run.optimizers, run.schedulers, run.recipe, scale)


def _write_events(out_dir: Path, events: list[GuardEvent]) -> None:
    path = out_dir / GUARDS
    if events or path.exists():
        atomic_write_text(path, "".join(json.dumps(e.to_json()) + "\n" for e in events))


def final_message(state: Any) -> str | None:
    """One line on what the guards did, for the end of a run (None: nothing to say)."""
    if state is None:
        return None
    parts = [*state.rollbacks, *([state.stopped] if state.stopped else [])]
    return "; ".join(parts) if parts else None
