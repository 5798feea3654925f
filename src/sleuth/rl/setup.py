"""Recipe -> the pieces of a run: retriever, loop, data, reward services, optimizers (each written once)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sleuth.agent.engine import RolloutBudget
from sleuth.agent.registry import get_loop, load_plugins, method_plugins
from sleuth.data.filters import drop_yes_no, keep_hard
from sleuth.data.formats import QAExample, load_qa
from sleuth.data.score_cache import ScoreCache
from sleuth.errors import ConfigError
from sleuth.llm.registry import check_model_spec, open_generator
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.sources import open_retriever
from sleuth.retrieval.tools import ToolRetrieverConfig
from sleuth.rewards.base import RewardServices, get_reward
from sleuth.rl.batch import PolicyScorer
from sleuth.rl.config import Recipe
from sleuth.rl.guard_metrics import check_guard_metrics
from sleuth.rl.models import FrozenBaseGenerator
from sleuth.run_layout import POLICY_DIR, SearcherInfo, resolve_checkpoint


@dataclass
class DataCursor:
    """Where we are in the seeded, epoch-shuffled training order (saved in checkpoints)."""

    seed: int
    num_examples: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _order(self) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        taken: list[int] = []
        order = self._order()
        while len(taken) < count:
            if self.position >= self.num_examples:
                self.epoch += 1
                self.position = 0
                order = self._order()
            taken.append(order[self.position])
            self.position += 1
        return taken

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        """Back to a `state()` taken earlier (a draw undone)."""
        self.epoch, self.position = state["epoch"], state["position"]


def build_retriever(recipe: Recipe) -> Retriever:
    """The recipe's retriever; a /retrieve server is called with the recipe's service retry policy."""
    section = recipe.retriever
    tool = (
        ToolRetrieverConfig(mcp=section.mcp, http=section.http)
        if section.mcp is not None or section.http is not None
        else None
    )
    return open_retriever(
        index=section.index,
        url=section.url,
        tool=tool,
        location=section.location,
        corpus=section.corpus,
        retry=recipe.services.retry.policy(),
        cache=section.cache,
    )


def loop_options(recipe: Recipe) -> dict[str, Any]:
    cfg = dict(recipe.agent.options)
    if recipe.agent.max_turns is not None:
        cfg["max_turns"] = recipe.agent.max_turns
    if recipe.agent.top_k is not None:
        cfg["top_k"] = recipe.agent.top_k
    return cfg


def rollout_budget(recipe: Recipe) -> RolloutBudget:
    """The recipe's observation and response limits (turns stay the loop's own)."""
    return RolloutBudget(
        max_obs_tokens=recipe.agent.max_obs_tokens, max_response_tokens=recipe.agent.max_response_tokens
    )


def build_loop(recipe: Recipe):

    return get_loop(recipe.agent.loop, **loop_options(recipe))


def searcher_info(recipe: Recipe) -> SearcherInfo:
    """The searcher.json of a checkpoint trained from `recipe`."""
    return SearcherInfo(
        recipe=recipe.name,
        loop=recipe.agent.loop,
        loop_options=loop_options(recipe),
        base_model=recipe.model.policy,
        lora=recipe.model.lora.enabled,
        max_new_tokens_per_turn=recipe.agent.max_new_tokens_per_turn,
        max_obs_tokens=recipe.agent.max_obs_tokens,
        max_response_tokens=recipe.agent.max_response_tokens,
        plugins=method_plugins(recipe.agent.loop, recipe.plugins),
    )


def load_validation_examples(recipe: Recipe) -> list[QAExample]:
    """The first `trainer.eval_examples` questions of data.dev (none without data.dev)."""
    if recipe.data.dev is None:
        return []
    examples = load_qa(recipe.data.dev)[: recipe.trainer.eval_examples]
    if not examples:
        raise ConfigError(f"data.dev={recipe.data.dev}: no questions to validate on; name a non-empty file")
    return examples


def load_examples(recipe: Recipe) -> list[QAExample]:

    examples = load_qa(recipe.data.train)[recipe.data.skip_train_examples :]
    if recipe.data.drop_yes_no:
        examples = drop_yes_no(examples)
    if recipe.data.hard_from:
        examples = keep_hard(examples, ScoreCache(recipe.data.hard_from))
    if recipe.data.max_train_examples:
        examples = examples[: recipe.data.max_train_examples]
    if not examples:
        raise ConfigError(f"data.train={recipe.data.train}: no training examples left after filtering")
    return examples


def build_reward_services(recipe: Recipe, policy_gen: Any, policy: nn.Module, retriever: Any):

    def policy_base() -> FrozenBaseGenerator:
        if not hasattr(policy, "disable_adapter"):
            raise ConfigError("reward generator 'policy-base' needs model.lora.enabled=true")
        return FrozenBaseGenerator(policy_gen, policy)

    def service_model(spec: str | None, role: str):
        return open_generator(
            spec,
            retry=recipe.services.retry.policy(),
            service=f"reward {role}",
            named={"policy-base": policy_base},
        )

    encoder = None
    if recipe.reward.encoder:
        encoder = Encoder(EncoderConfig(name=recipe.reward.encoder))
    cache = None
    if recipe.reward.baseline_cache:
        cache = ScoreCache(recipe.reward.baseline_cache)
    return RewardServices(
        generator=service_model(recipe.reward.generator, "generator"),
        judge=service_model(recipe.reward.judge, "judge"),
        encoder=encoder,
        baseline_cache=cache,
        retriever=retriever,
        # scoring with the policy itself (teacher-forced log-probs); none where no policy is trained
        policy=PolicyScorer(
            policy,
            policy_gen.tokenizer,
            recipe.algorithm.micro_batch_size,
            sharded=recipe.model.parallel == "fsdp",
        )
        if policy is not None
        else None,
    )


def build_optimizer(params, lr: float, recipe: Recipe):
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=lr, betas=recipe.optim.betas, eps=recipe.optim.eps, weight_decay=recipe.optim.weight_decay
    )
    warmup = recipe.optim.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return opt, sched


def apply_optim_recipe(optimizers: dict[str, torch.optim.Optimizer], schedulers: dict[str, Any], recipe: Recipe,
                       lr_scale: float = 1.0) -> None:  # fmt: skip
    """Set the optimizers' hyperparameters to the recipe's, the learning rate times `lr_scale` (a guard's
    rollbacks), at the schedule's position. Needed after loading a checkpoint's states: an optimizer's state dict
    brings back its param groups (lr, betas, eps, weight decay) and LambdaLR's its base rates, so a changed
    `optim.*` would otherwise be printed on resume and not used. The warm-up is the recipe's lambda (lambdas are
    not saved), read at the step reached."""
    optim = recipe.optim
    bases = {"policy": optim.lr, "critic": optim.critic_lr}
    for name, opt in optimizers.items():
        sched = schedulers[name]
        base = bases[name] * lr_scale
        sched.base_lrs = [base] * len(opt.param_groups)
        for group, factor in zip(opt.param_groups, sched.lr_lambdas, strict=True):
            group.update(
                initial_lr=base,
                lr=base * factor(sched.last_epoch),
                betas=tuple(optim.betas),
                eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
        sched._last_lr = [g["lr"] for g in opt.param_groups]  # what get_last_lr() (the logged lr) returns


def initial_weights(recipe: Recipe) -> Path | None:
    """The policy directory of `model.init_from` (a checkpoint or run directory), if set."""
    if recipe.model.init_from is None:
        return None

    return resolve_checkpoint(recipe.model.init_from) / POLICY_DIR


def check_pieces(recipe: Recipe) -> None:
    """The loop and the reward built with the recipe's options, as the trainer builds them after loading
    the policy, and every guard's metric one the run logs: checked before any model loads (`sleuth check-recipe`
    too), so `reward.options.answer_source=upstrem` costs a second, not a model load."""
    load_plugins(recipe.plugins)
    build_loop(recipe)
    get_reward(recipe.reward.name, **recipe.reward.options)
    check_guard_metrics(recipe, f"recipe {recipe.name!r}")  # a guard on a metric no step logs never fires


def check_input_paths(recipe: Recipe) -> None:
    """The recipe's pieces (`check_pieces`), and every file and directory it names must exist: checked
    before any model loads, so a typo costs a second, not a model load and a traceback."""
    check_pieces(recipe)

    named = [
        ("data.train", recipe.data.train),
        ("data.dev", recipe.data.dev),
        ("data.hard_from", recipe.data.hard_from),
        ("retriever.index", recipe.retriever.index),
        ("retriever.corpus", recipe.retriever.corpus),
        ("model.init_from", recipe.model.init_from),
        ("sft.data", recipe.sft.data if recipe.sft is not None else None),
    ]
    missing = [
        f"{field}: {value} does not exist" for field, value in named if value and not Path(value).exists()
    ]
    try:
        check_model_spec(recipe.model.policy)
    except ConfigError as err:
        missing.append(f"model.policy: {err}")
    if missing:
        raise ConfigError(
            f"recipe {recipe.name!r} names inputs that are not there:\n  " + "\n  ".join(missing)
        )
