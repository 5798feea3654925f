"""Hints for a recipe key the schema does not know: "did you mean" the closest field of that section, and
verl's names (a Search-R1 or verl config carried over) mapped to sleuth's."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel

# verl / Search-R1 config key -> the sleuth recipe key that does the same (a note after " : " says how it differs)
VERL_NAMES: dict[str, str] = {
    "data.train_files": "data.train",
    "data.val_files": "data.dev",
    "data.train_batch_size": "algorithm.prompts_per_step",
    "data.max_response_length": "agent.max_response_tokens",
    "data.max_obs_length": "agent.max_obs_tokens",
    "max_turns": "agent.max_turns",
    "retriever.topk": "agent.top_k",
    "trainer.logger": "trainer.loggers : a list of jsonl, tensorboard, wandb, mlflow; the console always prints",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.total_epochs": "trainer.total_steps : sleuth counts steps, not epochs",
    "trainer.save_freq": "trainer.save_every",
    "trainer.test_freq": "trainer.eval_every",
    "trainer.default_local_dir": "trainer.out_dir",
    "trainer.project_name": "trainer.wandb.project",
    "trainer.experiment_name": "name",
    "algorithm.adv_estimator": "algorithm.advantage : or algorithm.name (ppo, grpo, dapo, rloo, drgrpo) for its default",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_ctrl.type": "algorithm.kl.type",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl.target_kl",
    "algorithm.kl_ctrl.horizon": "algorithm.kl.horizon",
    "algorithm.use_kl_in_reward": "algorithm.kl.mode : penalty",
    "actor_rollout_ref.model.path": "model.policy",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "model.lora.r : with model.lora.enabled: true",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.rollout.n": "algorithm.n",
    "actor_rollout_ref.rollout.temperature": "sampling.temperature",
    "actor_rollout_ref.rollout.top_p": "sampling.top_p",
    "actor_rollout_ref.actor.optim.lr": "optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "optim.warmup_steps",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "algorithm.minibatch_size : in trajectories, not prompts",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "algorithm.micro_batch_size",
    "actor_rollout_ref.actor.ppo_epochs": "algorithm.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio": "algorithm.clip_low : and algorithm.clip_high",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coef",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl.mode : loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl.coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl.estimator",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg",
    "actor_rollout_ref.actor.grad_clip": "optim.grad_clip",
    "critic.optim.lr": "optim.critic_lr",
    "critic.cliprange_value": "algorithm.value_clip",
    "reward_model.reward_manager": "reward.name",
}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _fields_at(root: type[BaseModel], path: tuple[Any, ...]) -> set[str]:
    """The field names of the section at `path` (a pydantic error's loc without its last part); list indexes
    and union tags (a guard's `kind`) are stepped over. Empty when the path leads nowhere known."""
    models = [root]
    for part in path:
        if isinstance(part, int):
            continue
        inner = [
            m
            for model in models
            if part in model.model_fields
            for m in _models_in(model.model_fields[part].annotation)
        ]
        if inner:
            models = inner
        elif not any(part in model.model_fields for model in models):
            # a discriminated union's tag: keep the members whose `kind` accepts it
            tagged = (
                [m for m in models if part in typing.get_args(m.model_fields.get("kind").annotation)]
                if all("kind" in m.model_fields for m in models)
                else []
            )
            if not tagged:
                return set()
            models = tagged
        else:
            return set()  # a field that is not a section
    return {name for model in models for name in model.model_fields}


def _flat_keys(prefix: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return [prefix]
    return [key for k, v in value.items() for key in _flat_keys(f"{prefix}.{k}", v)] or [prefix]


def unknown_key_hint(root: type[BaseModel], error: dict[str, Any]) -> str | None:
    """The message for a pydantic `extra_forbidden` error of a `root` document (None for other errors):
    "unknown key; did you mean data.train?", or verl's name mapped ("verl's actor_rollout_ref.rollout.n is
    algorithm.n here")."""
    if error.get("type") != "extra_forbidden":
        return None
    loc = tuple(error["loc"])
    names = [str(p) for p in loc if not isinstance(p, int)]
    dotted = ".".join(names)
    mapped = []
    for key in _flat_keys(dotted, error.get("input")):
        if key in VERL_NAMES:
            target, _, note = VERL_NAMES[key].partition(" : ")
            mapped.append(f"verl's {key} is {target} here" + (f" ({note})" if note else ""))
    if mapped:
        return "unknown key; " + "; ".join(mapped)
    section = ".".join(str(p) for p in loc[:-1])  # as the error line spells it (list index, union tag)
    close = difflib.get_close_matches(names[-1], sorted(_fields_at(root, loc[:-1])), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {section + '.' if section else ''}{close[0]}?"
    known = sorted(_fields_at(root, loc[:-1]))
    return f"unknown key; {section or 'the top level'} has: {', '.join(known)}" if known else "unknown key"
