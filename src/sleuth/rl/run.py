"""Setup: a recipe -> one `Run` holding policy, reference, critic, optimizers, retriever, loop, reward
services, data and loggers, restored from a checkpoint on resume; and `save`, its checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sleuth.agent.base import AgentLoop
from sleuth.agent.registry import load_plugins
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.llm.hf import HFGenerator
from sleuth.retrieval.base import Retriever, StepStamped, wants_context
from sleuth.retrieval.timed import TimedRetriever
from sleuth.rewards.base import Reward, RewardServices, get_reward
from sleuth.rl.checkpoint import (
    TrainingStates,
    full_states,
    load_optimizer_states,
    load_training_state,
    resumable_checkpoint,
    save_checkpoint,
    set_rng_state,
    write_run_info,
)
from sleuth.rl.checkpoint_compat import (
    FINGERPRINT,
    check_init_from,
    check_resume,
    recipe_fingerprint,
    resumed_kl_coef,
)
from sleuth.rl.config import Recipe
from sleuth.rl.dist import DistContext, shard_range, unwrap, wrap_model
from sleuth.rl.loggers import open_recipe_loggers
from sleuth.rl.models import (
    load_critic,
    load_policy,
    load_reference,
    master_dtype,
    rollout_copy,
    rollout_decoding,
)
from sleuth.rl.run_dir import no_usable_checkpoint
from sleuth.rl.setup import (
    DataCursor,
    apply_optim_recipe,
    build_loop,
    build_optimizer,
    build_retriever,
    build_reward_services,
    initial_weights,
    load_examples,
    load_validation_examples,
    searcher_info,
)
from sleuth.run_layout import POLICY_DIR, resolve_checkpoint
from sleuth.utils import seed_everything


@dataclass
class Run:
    """Everything a training step uses, built once from the recipe by `setup`."""

    recipe: Recipe
    ctx: DistContext
    out_dir: Path
    console: Any
    tokenizer: Any
    policy: nn.Module
    reference: nn.Module | None  # None: no KL, or LoRA (the base model with adapters off is the reference)
    critic: nn.Module | None  # only for estimators that need one (GAE)
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    rollout_model: nn.Module | None  # a bf16 copy synced after each update, or None: the policy decodes
    generator: Generator
    retriever: TimedRetriever
    loop: AgentLoop
    reward_fn: Reward
    services: RewardServices
    sampling: SamplingParams
    examples: list[QAExample]
    cursor: DataCursor
    local_prompts: slice  # this rank's share of each step's prompts
    local_minibatch: int
    log: Any  # the recipe's loggers (main rank only)
    start_step: int = 0
    last_saved: int = 0
    compile_seconds_logged: float = 0.0
    retrieval_logged: tuple[float, int] = (0.0, 0)  # the retriever's (seconds, queries) when last logged
    val_examples: list[QAExample] = field(default_factory=list)  # data.dev's first trainer.eval_examples
    guards: Any = None  # sleuth.rl.guard_actions.GuardState, set by the trainer
    kl_coef: float = 0.0  # the KL coefficient of the next step (moves under algorithm.kl.type: adaptive)
    pending: Any = (
        None  # trainer.overlap: the next step's rollouts (sleuth.rl.overlap.Pending), made during this one
    )
    # trainer.overlap: one_step_async: the frozen copy of the pre-update weights the background rollout decodes
    # (sleuth.rl.overlap.WeightSnapshot), made at the first fork
    snapshot: Any = None

    @property
    def models(self) -> dict[str, nn.Module]:
        return {"policy": self.policy, **({"critic": self.critic} if self.critic is not None else {})}


@dataclass
class ResumePoint:
    """Where a run starts: the checkpoint it resumes from (None: fresh) and what that checkpoint holds."""

    checkpoint: Path | None = None
    trainer_state: dict[str, Any] = field(default_factory=dict)  # step, data cursor, stage, kl_coef
    tensor_state: dict[str, Any] = field(default_factory=dict)  # optimizers, schedulers, RNG


@dataclass
class LoadedModels:
    """The models of a run and their optimizers, wrapped for DDP/FSDP, loaded by `_load_models`."""

    tokenizer: Any
    policy: nn.Module
    model_path: str  # the weights the policy (and the reference) started from
    reference: nn.Module | None
    critic: nn.Module | None
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]


def _resume_point(recipe: Recipe, out_dir: Path, resume: bool, console: Any) -> ResumePoint:
    ckpt = None
    if resume:
        ckpt, skipped = resumable_checkpoint(out_dir)
        for path, reason in skipped:
            console.print(f"[yellow]skipping damaged checkpoint {path}[/]: {reason}")
    if ckpt is not None:
        check_resume(
            recipe, ckpt, console
        )  # another loop, reward, algorithm, model: refused, naming the field
        trainer_state, tensor_state = load_training_state(ckpt)
        console.print(f"[bold]resuming[/] from {ckpt} (step {trainer_state['step']})")
        return ResumePoint(ckpt, trainer_state, tensor_state)
    if resume:
        refusal = no_usable_checkpoint(out_dir, skipped)
        if refusal is not None:
            raise refusal
        console.print(f"[yellow]--resume: no checkpoint under {out_dir}, starting fresh[/]")
    return ResumePoint()


def _load_models(recipe: Recipe, ctx: DistContext, point: ResumePoint) -> LoadedModels:
    """Policy, reference, critic (wrapped for DDP/FSDP), their optimizers and schedulers, restored on resume."""
    device, ckpt = ctx.device, point.checkpoint
    tokenizer, policy, model_path = load_policy(
        recipe, device, ckpt / POLICY_DIR if ckpt else initial_weights(recipe)
    )
    reference = None
    if recipe.algorithm.kl.coef > 0 and not hasattr(policy, "disable_adapter"):
        # the reference is the starting model, also when resuming (the policy then holds trained weights)
        reference = load_reference(model_path, policy, device)
        if recipe.model.offload_reference:
            reference.to("cpu")
    critic = load_critic(model_path, device, master_dtype(recipe)) if recipe.algorithm.uses_critic else None
    if critic is not None and ckpt is not None:
        critic.load_state_dict(torch.load(ckpt / "critic.pt", map_location=device, weights_only=True))
    # DDP broadcasts rank 0's weights, so every rank starts from the same (LoRA) initialisation
    policy = wrap_model(policy, ctx, recipe.model.parallel)
    if critic is not None:
        critic = wrap_model(critic, ctx, recipe.model.parallel)
    opt, sched = build_optimizer(policy.parameters(), recipe.optim.lr, recipe)
    optimizers, schedulers = {"policy": opt}, {"policy": sched}
    if critic is not None:
        optimizers["critic"], schedulers["critic"] = build_optimizer(
            critic.parameters(), recipe.optim.critic_lr, recipe
        )
    if point.tensor_state:
        models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
        load_optimizer_states(models, optimizers, point.tensor_state["optimizers"])
        for k, s in schedulers.items():
            s.load_state_dict(point.tensor_state["schedulers"][k])
        set_rng_state(point.tensor_state["rng"])
        # the loaded states hold the checkpoint's lr, betas, ...: the recipe's apply (a guard's rollback
        # factor is applied on top by sleuth.rl.guard_actions.start_guards)
        apply_optim_recipe(optimizers, schedulers, recipe)
    return LoadedModels(tokenizer, policy, model_path, reference, critic, optimizers, schedulers)


def _rollout_generator(recipe: Recipe, ctx: DistContext, models: LoadedModels,
                       console: Any) -> tuple[nn.Module | None, HFGenerator]:  # fmt: skip
    """The rollout model (a bf16 copy, or None: the policy or the decode engine's own copy decodes) and
    the generator the rollouts call."""
    policy = models.policy
    cache, compiled, why = rollout_decoding(recipe, unwrap(policy), ctx.device)
    # the decode engine keeps its own bf16 copy (refreshed after every update): no second rollout model
    rollout_model = rollout_copy(recipe, policy, ctx.device) if cache != "engine" else None
    rollout_weights = rollout_model if rollout_model is not None else unwrap(policy)
    if rollout_model is not None:
        cache, compiled, why = rollout_decoding(recipe, rollout_weights, ctx.device)
    # the engine takes a whole step's rows at once (HFGenerator's default for it: its KV pool follows the tokens)
    generator = HFGenerator(rollout_weights, tokenizer=models.tokenizer, cache=cache, compile=compiled)
    if ctx.is_main:
        console.print(
            f"rollout decoding: {cache} KV cache{', compiled decode step' if compiled else ''} ({why})"
        )
    return rollout_model, generator


def _stepped(retriever: Retriever, reward_fn: Reward) -> Retriever:
    """A retriever that wants context (question, answers, turn) hears the training step through the reward's
    `set_step`, the step signal the trainer sends (sleuth.retrieval.base.StepStamped)."""
    if not wants_context(retriever):
        return retriever
    stamped = StepStamped(retriever)
    reward_fn.on_step(stamped.set_step)
    return stamped


def setup(recipe: Recipe, ctx: DistContext, console: Any, resume: bool) -> Run:
    """Recipe -> one Run: models (restored on resume), environment, data, reward, loggers."""
    out_dir = Path(recipe.trainer.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(recipe.seed)
    point = _resume_point(recipe, out_dir, resume, console)
    if point.checkpoint is None and recipe.model.init_from is not None:
        check_init_from(recipe, resolve_checkpoint(recipe.model.init_from), console)
    start_step = int(point.trainer_state.get("step", 0))
    models = _load_models(recipe, ctx, point)
    if ctx.enabled:  # ranks sample different trajectories
        seed_everything(recipe.seed * 1_000_003 + start_step * 1_009 + ctx.rank)
    rollout_model, generator = _rollout_generator(recipe, ctx, models, console)
    load_plugins(recipe.plugins)
    reward_fn = get_reward(recipe.reward.name, **recipe.reward.options)
    retriever = TimedRetriever(
        _stepped(build_retriever(recipe), reward_fn)
    )  # time/retrieval: its share of the rollout
    loop = build_loop(recipe)
    examples = load_examples(recipe)
    cursor = DataCursor(
        recipe.seed, len(examples), recipe.data.shuffle, **point.trainer_state.get("cursor", {})
    )
    services = build_reward_services(recipe, generator, unwrap(models.policy), retriever)
    sampling = SamplingParams(
        max_new_tokens=recipe.agent.max_new_tokens_per_turn,
        temperature=recipe.sampling.temperature,
        top_p=recipe.sampling.top_p,
    )
    algo = recipe.algorithm
    local_prompts = shard_range(algo.prompts_per_step, ctx, "algorithm.prompts_per_step")
    if algo.minibatch_size % ctx.world_size:
        raise ConfigError(
            f"algorithm.minibatch_size must be divisible by the number of ranks ({ctx.world_size})"
        )
    log = open_recipe_loggers(recipe, out_dir, start_step) if ctx.is_main else None
    if ctx.is_main:
        run_info = {
            "recipe": recipe.model_dump(),
            "model_path": models.model_path,
            "device": str(ctx.device),
            "ranks": ctx.world_size,
        }
        write_run_info(out_dir, run_info)
        log.log_config(run_info)
    return Run(
        recipe=recipe,
        ctx=ctx,
        out_dir=out_dir,
        console=console,
        tokenizer=models.tokenizer,
        policy=models.policy,
        reference=models.reference,
        critic=models.critic,
        optimizers=models.optimizers,
        schedulers=models.schedulers,
        rollout_model=rollout_model,
        generator=generator,
        retriever=retriever,
        loop=loop,
        reward_fn=reward_fn,
        services=services,
        sampling=sampling,
        examples=examples,
        cursor=cursor,
        local_prompts=local_prompts,
        local_minibatch=algo.minibatch_size // ctx.world_size,
        log=log,
        start_step=start_step,
        last_saved=start_step,
        val_examples=load_validation_examples(recipe),
        kl_coef=resumed_kl_coef(recipe, point.trainer_state),
    )


def resume_cursor(run: Run) -> dict[str, int]:
    """The data cursor a checkpoint saves: with overlap, from before the pending rollouts drew their prompts (a
    resumed run draws them again, rolling them out from the checkpoint's weights)."""
    return run.pending.cursor_before if run.pending is not None else run.cursor.state()


def save(run: Run, done: int, cursor_state: dict[str, int], stage: int) -> None:
    """A checkpoint of `done` steps (collective: every rank calls it; rank 0 writes)."""
    model_states, optim_states = full_states(run.models, run.optimizers)
    if run.ctx.is_main:
        states = TrainingStates(
            unwrap(run.policy),
            run.tokenizer,
            run.optimizers,
            run.schedulers,
            critic=unwrap(run.critic) if run.critic is not None else None,
            policy_state=model_states["policy"],
            critic_state=model_states.get("critic"),
            optimizer_states=optim_states,
        )
        save_checkpoint(
            run.out_dir,
            done,
            states,
            trainer_state={
                "cursor": cursor_state,
                "stage": stage,
                "recipe": run.recipe.name,
                FINGERPRINT: recipe_fingerprint(run.recipe),
                "kl_coef": run.kl_coef,
            },
            searcher=searcher_info(run.recipe),
            keep=run.recipe.trainer.keep_checkpoints,
        )
    run.ctx.barrier()
