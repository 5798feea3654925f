"""`trainer.overlap`: step k+1's rollouts are made from the weights step k started with, while step k updates; step
k+1 then trains on them one step stale, with the generator's recorded per-token log-probs as the old side of the
importance ratio (the behaviour policy's), and logs `rollout/staleness`.

Two schedules compute the same thing:
- `one_step`, a deterministic interleaving on one thread: step k draws and rolls out step k+1's prompts before its
  own update, so the generator decodes exactly the pre-update weights;
- `one_step_async`, concurrent: the same rollout runs in a background thread while the main thread runs step k's
  update, and step k joins it before the rollout weights are refreshed. It decodes a frozen snapshot
  (`WeightSnapshot`): the policy's trainable parameters copied at the fork (under LoRA the adapters; the frozen
  base is shared, not copied), so the update's in-place optimizer step cannot reach it. The decode engine's own
  bf16 copy is refreshed only after the join, so it too holds the pre-update weights for the whole rollout. On
  CUDA the thread decodes on its own stream (kernels of one stream run in order, so on the default stream the
  rollout would only queue behind the update).

Both sample the next step's tokens from their own seeded streams (`SeededGenerator`: one seed drawn from torch's
global generator at the fork, then one stream per generate call), never from the global generator the update's
shuffles and dropout draw from: what a thread samples cannot depend on how the two threads' draws interleave, and
the two schedules give the same trajectories, rewards, losses and weights (tests/test_rl_overlap_async.py).

The first step, and the first step after a resume or a guard's rollback, rolls out synchronously (staleness 0: the
synchronous trainer's on-policy path). A checkpoint saves the data cursor from before the pending rollouts' draw;
the pending rollouts are not saved, so a resumed run rolls those prompts out again from the checkpoint's weights
(staleness 0, fresh samples).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError, ServiceError
from sleuth.llm.base import Generation, Prompt, SamplingParams
from sleuth.rl import rollouts
from sleuth.rl.batch import PolicyScorer
from sleuth.rl.config import Recipe
from sleuth.rl.dist import DistContext, unwrap
from sleuth.rl.models import FrozenBaseGenerator, release_rollout_memory
from sleuth.rl.rollouts import Collected, collect_or_stop, service_stop
from sleuth.rl.run import Run

# tests: roll the next step out after the update (from the updated weights, staleness 0) instead of before it; it
# then samples from the global generator, as the synchronous trainer does, so the two can be compared bit for bit
WAIT_FOR_UPDATE = False
# apart from each other: the seeds of successive generate calls, and of the rollout's and the rewards' generators
_CALL_STRIDE = 1_000_003
_SEED_RANGE = 2**62


@dataclass
class Pending:
    """The next step's rollouts, made during this step."""

    collected: Collected
    stage: int
    cursor_before: dict[str, int]  # the data cursor before they drew their prompts (what a checkpoint saves)
    staleness: int  # updates between the weights that rolled them out and the weights they train


def check_overlap(recipe: Recipe, ctx: DistContext) -> None:
    """One line where one-step overlap cannot apply."""
    mode = recipe.trainer.overlap
    if mode == "off":
        return
    algo, why = recipe.algorithm, None
    if algo.dynamic_sampling:
        why = "algorithm.dynamic_sampling (DAPO refills groups from the policy mid-step)"
    elif algo.ppo_epochs != 1:
        why = f"algorithm.ppo_epochs {algo.ppo_epochs} (one update epoch only)"
    elif ctx.enabled:
        why = f"{ctx.world_size} ranks (one process only for now)"
    elif mode == "one_step_async" and recipe.model.parallel == "fsdp":
        # a sharded forward is a collective: the rollout's and the update's would interleave by thread timing
        why = "model.parallel fsdp (the rollout's all-gathers would race the update's)"
    if why is not None:
        raise ConfigError(f"trainer.overlap: {mode} cannot apply with {why}; set trainer.overlap: off")


class SeededGenerator:
    """A generator whose every `generate` call samples from its own stream, `seed + k * stride` for the k-th call
    (each turn of a rollout a fresh one), instead of torch's global generator; everything else is the wrapped one's."""

    def __init__(self, inner: Any, seed: int) -> None:
        self.inner, self.seed, self.calls = inner, seed, 0

    def generate(
        self, batch: list[Prompt], stop: Any = None, params: SamplingParams | None = None
    ) -> list[Generation]:
        seed = (self.seed + _CALL_STRIDE * self.calls) % _SEED_RANGE
        self.calls += 1
        return self.inner.generate(batch, stop, dataclasses.replace(params or SamplingParams(), seed=seed))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class WeightSnapshot:
    """A second module of the policy's architecture for the background rollout: its trainable parameters are
    copies, refreshed from the policy at each fork (`refresh`) and never touched by the optimizer; its frozen
    parameters (a LoRA policy's base) are the policy's own tensors, shared, since nothing writes them. Costs one
    copy of the trainable parameters (LoRA: the adapters; full fine-tuning: the whole model in its master dtype)."""

    def __init__(self, policy: nn.Module) -> None:
        live = unwrap(policy)
        memo: dict[int, Any] = {
            id(p): nn.Parameter(p.detach().clone(), requires_grad=False) if p.requires_grad else p
            for p in live.parameters()
        }
        self.model = copy.deepcopy(live, memo).eval()
        mine = dict(self.model.named_parameters())
        self._pairs = [(mine[name], p) for name, p in live.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def refresh(self) -> None:
        for dst, src in self._pairs:
            dst.copy_(src)

    @property
    def copied_bytes(self) -> int:
        return sum(dst.numel() * dst.element_size() for dst, _ in self._pairs)


def _rollout_generator(run: Run, model: nn.Module | None) -> Any:
    """The generator the next step's rollout decodes with: the run's, or (concurrent, when it decodes the live
    policy) a shallow copy of it over `model`, the snapshot. The copy shares the decode engine (whose bf16 copy is
    refreshed only after the join) but not a compiled decode step, which is bound to the live model."""
    gen = run.generator
    if model is None or getattr(gen, "model", None) is not unwrap(run.policy):
        return gen
    gen = copy.copy(gen)
    gen.model = model
    if hasattr(gen, "_compiled_step"):
        gen._compiled_step, gen._static_caches = None, {}
    return gen


def rollout_view(run: Run, seed: int | None, model: nn.Module | None = None) -> Run:
    """The run as the next step's rollout sees it: its generator (over `model`, the snapshot, when given), the
    rollout's and the reward generators' sampling seeded from `seed` (None: the global generator), and the rewards
    that consult the policy given `model` instead."""
    gen = _rollout_generator(run, model)
    services = run.services
    if model is not None:
        swap = (
            {"policy": PolicyScorer(model, services.policy.tokenizer, services.policy.micro)}
            if services.policy
            else {}
        )
        for role in ("generator", "judge"):
            service = getattr(services, role)
            if isinstance(service, FrozenBaseGenerator):  # the policy's base, adapters off: the snapshot's
                swap[role] = FrozenBaseGenerator(gen, model)
        services = dataclasses.replace(services, **swap)
    if seed is not None:
        gen = SeededGenerator(gen, seed)
        seeded = {
            r: SeededGenerator(getattr(services, r), seed + 1 + i)
            for i, r in enumerate(("generator", "judge"))
        }
        services = dataclasses.replace(services, **{r: g for r, g in seeded.items() if g.inner is not None})
    return dataclasses.replace(run, generator=gen, services=services)


def fork_seed() -> int:
    """The next rollout's sampling seed: one draw from torch's global generator on the main thread, before the
    update, so it is the same in both schedules and restored with the checkpoint's RNG state on resume."""
    return int(torch.randint(0, _SEED_RANGE, (1,)).item())


def collect_next(run: Run, step: int, cursor_now: dict[str, int], staleness: int) -> Pending | None:
    """Roll out step+1 now, from the weights the generator holds now (None after the last step). A service failure
    here saves step `step`'s start (its prompts drawn from `cursor_now`) when nothing newer is saved."""
    nxt = step + 1
    if nxt >= run.recipe.trainer.total_steps:
        return None
    view = run if WAIT_FOR_UPDATE else rollout_view(run, fork_seed())
    cursor_before = run.cursor.state()
    run.reward_fn.set_step(nxt)  # scored with the reward of the step that trains on them
    stage = run.reward_fn.current_stage
    run.policy.eval()
    try:
        collected = collect_or_stop(view, nxt, stage, resume_at=(step, cursor_now))
    finally:
        run.reward_fn.set_step(step)
    release_rollout_memory(run)
    return Pending(collected, stage, cursor_before, staleness)


class BackgroundRollout:
    """The next step's rollout on a thread of its own (`one_step_async`), started before this step's update and
    joined after it. `join` returns its `Pending`; an exception in the thread is raised there, in the main thread,
    except a service past its retry budget, which `join` keeps (`service_error`) so the step can finish, log and
    checkpoint before the run stops."""

    def __init__(self, run: Run, step: int, body: Callable[[Run], Collected] | None = None) -> None:
        if run.snapshot is None:
            run.snapshot = WeightSnapshot(run.policy)
        run.snapshot.refresh()  # the weights this step starts with
        self.run, self.step = run, step
        self.body = body or rollouts.collect_rollouts  # looked up now: tests replace it
        self.view = rollout_view(run, fork_seed(), run.snapshot.model)
        self.cursor_before = run.cursor.state()
        # scored with the reward of the step that trains on them (reset at join)
        run.reward_fn.set_step(step + 1)
        self.stage = run.reward_fn.current_stage
        self.result: Collected | None = None
        self.error: BaseException | None = None
        self.service_error: ServiceError | None = None
        self.waited = 0.0
        device = run.ctx.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:  # the thread's stream sees what the main stream queued so far (a refresh)
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.thread = threading.Thread(target=self._run, name=f"sleuth-rollout-step{step + 2}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.stream is None:
                self.result = self.body(self.view)
                return
            torch.cuda.set_device(self.run.ctx.device)  # the current device is per thread
            with torch.cuda.stream(self.stream):
                self.result = self.body(self.view)
            self.stream.synchronize()
        except BaseException as err:  # handed to the main thread by join
            self.error = err

    def _wait(self) -> None:
        started = time.perf_counter()
        self.thread.join()
        self.waited = time.perf_counter() - started
        self.run.reward_fn.set_step(self.step)
        if self.stream is not None:
            torch.cuda.current_stream(self.run.ctx.device).wait_stream(self.stream)

    def join(self) -> Pending | None:
        """Wait for the rollout; its `Pending` (None when a service failed: `service_error`, the data cursor put
        back to before its draw)."""
        self._wait()
        if isinstance(self.error, ServiceError):
            self.service_error = self.error
            self.run.cursor.restore(self.cursor_before)
            return None
        if self.error is not None:
            raise RuntimeError(
                f"trainer.overlap: one_step_async: the background rollout of step {self.step + 2} failed "
                f"({type(self.error).__name__}: {self.error}); step {self.step + 1}'s update finished but was not "
                f"saved. Its traceback is below; trainer.overlap: one_step runs the same rollout on the main thread"
            ) from self.error
        assert self.result is not None
        return Pending(self.result, self.stage, self.cursor_before, staleness=1)

    def abandon(self) -> None:
        """The main thread failed: wait for the thread (it still decodes from the run's objects), drop its result."""
        self._wait()

    def stop_for_service(self, done: int) -> ServiceError:
        """After the step's checkpoint: the error that stops the run, `done` steps checkpointed with the cursor
        from before the failed draw."""
        assert self.service_error is not None
        return service_stop(self.run, self.service_error, done, self.cursor_before, self.stage)


def start_next(run: Run, step: int) -> BackgroundRollout | None:
    """`one_step_async`: step+1's rollout on a background thread (None after the last step)."""
    if step + 1 >= run.recipe.trainer.total_steps:
        return None
    return BackgroundRollout(run, step)


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
