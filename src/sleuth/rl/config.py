"""Recipe schema: one YAML file describes a whole training run.

Recipes are data: loaded with `yaml.safe_load`, validated by pydantic with
`extra="forbid"`, so a typo or an invalid value fails at load with a message
that names the field. Any loop x reward x algorithm combination is valid; only
combinations that cannot run (e.g. GAE without a critic) are refused.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sleuth.agent.registry import find_method, load_plugins, loop_names
from sleuth.errors import ConfigError
from sleuth.retrieval.backends import parse_location
from sleuth.retrieval.tools import HTTPSearchConfig, MCPToolConfig
from sleuth.rl.advantages import ADVANTAGE_ESTIMATORS, needs_critic, needs_groups
from sleuth.rl.guard_config import GuardConfig, default_guards
from sleuth.rl.losses import POLICY_LOSSES
from sleuth.rl.recipe_hints import unknown_key_hint
from sleuth.utils import RetryPolicy, atomic_write_text, read_yaml, validation_message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraConfig(_Strict):
    enabled: bool = False
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str = "all-linear"


class ModelConfig(_Strict):
    policy: str = "smollm2-135m-instruct"  # alias, hub name or local directory
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"  # float64: numerical checks
    lora: LoraConfig = Field(default_factory=LoraConfig)
    # activation checkpointing: True = "full", False = "off"; "selective" checkpoints half the layers; "auto"
    # picks off/selective/full from the measured free memory and the micro-batch's tokens (sleuth.rl.memory_plan)
    gradient_checkpointing: bool | Literal["auto", "off", "selective", "full"] = False
    # the update's forward: "packed" (padding-free rows with per-row position ids), "padded", or "auto" (packed
    # where attention runs packed rows without a dense mask: flash or flex attention; sleuth.rl.batch)
    packing: Literal["auto", "packed", "padded"] = "auto"
    device: str | None = None  # None: cuda if available else cpu (under torchrun: this rank's GPU)
    # Under torchrun: "ddp" keeps a full replica per rank (LoRA on a 7B model fits an 80 GB card);
    # "fsdp" shards parameters, gradients and optimizer state over ranks (FSDP2 fully_shard).
    parallel: Literal["ddp", "fsdp"] = "ddp"
    offload_reference: bool = False  # keep the frozen reference on the CPU between uses
    # rollout decoding: "auto" = a static KV cache with a compiled decode step on CUDA when the rollout
    # weights are bf16 and not FSDP-sharded, else HF's dynamic cache; compile None = on with a static cache on CUDA
    generation_cache: Literal["auto", "dynamic", "static", "engine"] = "auto"
    compile_generation: bool | None = None
    # what rollouts decode with: "auto" = a bf16 copy of a fully fine-tuned fp32 policy on CUDA
    # (synced after every update; not with FSDP), else the policy itself
    generation_weights: Literal["auto", "policy", "bf16-copy"] = "auto"
    # Start from a trained checkpoint (an SFT run, or another RL run): a checkpoint or run directory.
    # With LoRA its adapters keep training; the KL reference stays the base model (`model.policy`).
    init_from: str | None = None


class DataConfig(_Strict):
    train: str  # FlashRAG jsonl or Search-R1 parquet
    dev: str | None = None
    drop_yes_no: bool = False
    hard_from: str | None = None  # score cache: keep questions the baseline gets wrong
    # leave out the first N questions of data.train (e.g. those an SFT cold start saw), before any filter
    skip_train_examples: int = Field(0, ge=0)
    max_train_examples: int | None = Field(None, ge=1)
    shuffle: bool = True


class RetrieverConfig(_Strict):
    index: str | None = None  # a `sleuth index` directory
    url: str | list[str] | None = None  # a Search-R1-compatible server
    corpus: str | None = None  # optional: check the index was built from this corpus
    mcp: MCPToolConfig | None = None  # an MCP server's search tool (sleuth.retrieval.tools)
    http: HTTPSearchConfig | None = None  # an HTTP search API (sleuth.retrieval.tools)
    cache: str | None = (
        None  # a directory recording every search, replayed next time (sleuth.retrieval.cache)
    )
    # any retriever location: bm25:DIR, hybrid:DIR1,DIR2, milvus:URI?collection=C, a plugin backend's NAME:...
    # (sleuth.retrieval.backends; the recipe's plugins are loaded before this is read)
    location: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> RetrieverConfig:
        if sum(x is not None for x in (self.index, self.url, self.mcp, self.http, self.location)) != 1:
            raise ValueError(
                "set exactly one of retriever.index, retriever.url, retriever.mcp, retriever.http "
                "or retriever.location"
            )
        if self.location is not None:
            try:
                parse_location(self.location)
            except ConfigError as err:
                raise ValueError(f"retriever.location: {err}") from None
        return self


class AgentConfig(_Strict):
    loop: str = "search_r1"  # a registered method (sleuth.agent.registry; plugins add theirs)
    max_turns: int | None = Field(None, ge=1)  # None: the loop's paper default
    top_k: int | None = Field(None, ge=1)
    max_new_tokens_per_turn: int = Field(256, ge=1)
    max_obs_tokens: int = Field(512, ge=1)
    max_response_tokens: int = Field(2048, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)  # loop-specific switches


class RewardConfig(_Strict):
    name: str = "search_r1_em"
    options: dict[str, Any] = Field(default_factory=dict)  # the reward's own options (see sleuth.rewards)
    # Frozen models a reward uses: any `load_generator` spec. "policy-base" reuses the policy's base
    # weights with LoRA adapters disabled, which costs no extra memory.
    generator: str | None = None
    judge: str | None = None
    encoder: str | None = None  # sentence encoder for query-diversity rewards
    baseline_cache: str | None = None  # s3: per-question naive-RAG accuracy cache


class KLConfig(_Strict):
    coef: float = Field(0.001, ge=0.0)
    mode: Literal["penalty", "loss"] = "loss"
    estimator: Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"] = "low_var_kl"
    # verl's algorithm.kl_ctrl: "fixed" keeps coef; "adaptive" moves the reward penalty's coefficient
    # toward target_kl after every step (AdaptiveKLController; sleuth.rl.losses.adaptive_kl_coef)
    type: Literal["fixed", "adaptive"] = "fixed"
    target_kl: float = Field(0.1, gt=0.0)
    horizon: int = Field(10000, ge=1)

    @model_validator(mode="after")
    def _adaptive_needs_penalty(self) -> KLConfig:
        if self.type == "adaptive" and (self.mode != "penalty" or self.coef <= 0):
            raise ValueError(
                "algorithm.kl.type: adaptive adapts the KL reward penalty, as verl's kl_ctrl does: "
                "set algorithm.kl.mode: penalty and algorithm.kl.coef > 0 (its starting value)"
            )
        return self


class AlgorithmConfig(_Strict):
    name: Literal["ppo", "grpo", "dapo", "rloo", "drgrpo"] = "grpo"
    advantage: str | None = None  # a registered estimator (sleuth.rl.advantages); None: from name
    policy_loss: str = "ppo_clip"  # a registered policy loss (sleuth.rl.losses.POLICY_LOSSES)
    n: int = Field(5, ge=1)  # samples per prompt
    prompts_per_step: int = Field(8, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    minibatch_size: int = Field(16, ge=1)  # trajectories per optimizer step
    micro_batch_size: int = Field(4, ge=1)  # trajectories per forward/backward
    # tokens per forward/backward (prompt + response of every row, or rows x longest when padded); None: rows
    # only. A row longer than the budget goes alone
    micro_batch_tokens: int | None = Field(None, ge=1)
    clip_low: float = Field(0.2, gt=0.0)
    clip_high: float = Field(0.2, gt=0.0)
    # Dual-clip PPO (verl's `clip_ratio_c`): a negative-advantage token's loss is capped at -A * c.
    # None turns it off; verl always applies it with c = 3.0 (docs/compatibility.md).
    clip_ratio_c: float | None = Field(None, gt=1.0)
    value_clip: float = Field(0.2, gt=0.0)
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    value_coef: float = Field(1.0, ge=0.0)
    kl: KLConfig = Field(default_factory=KLConfig)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = Field(3, ge=1)
    overlong_filter: bool = False

    @model_validator(mode="after")
    def _defaults_from_name(self) -> AlgorithmConfig:
        if self.advantage is None:
            self.advantage = {
                "ppo": "gae",
                "grpo": "grpo",
                "dapo": "grpo",
                "rloo": "rloo",
                "drgrpo": "drgrpo",
            }[self.name]
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
            raise ValueError(f"algorithm.advantage: unknown estimator {self.advantage!r}; known: {known}")
        if self.policy_loss not in POLICY_LOSSES:
            known = ", ".join(sorted(POLICY_LOSSES))
            raise ValueError(
                f"algorithm.policy_loss: unknown policy loss {self.policy_loss!r}; known: {known}"
            )
        if needs_groups(self.advantage) and self.n < 2:
            raise ValueError(
                f"algorithm.advantage={self.advantage} compares samples of one prompt: set algorithm.n >= 2"
            )
        if self.minibatch_size % self.micro_batch_size:
            raise ValueError("algorithm.minibatch_size must be a multiple of algorithm.micro_batch_size")
        return self

    @property
    def uses_critic(self) -> bool:
        return needs_critic(self.advantage)


class OptimConfig(_Strict):
    lr: float = Field(1e-6, gt=0.0)
    critic_lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class WandbConfig(_Strict):
    project: str = "sleuth"
    entity: str | None = None
    name: str | None = None  # None: the recipe name
    group: str | None = None
    tags: list[str] | None = None
    # None: offline unless WANDB_MODE / WANDB_API_KEY is set or `wandb login` saved a key (sleuth.rl.loggers)
    mode: Literal["online", "offline", "disabled"] | None = None


class MlflowConfig(_Strict):
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else a file store in <run dir>/mlruns
    experiment: str = "sleuth"
    run_name: str | None = None  # None: the recipe name


class TrainerConfig(_Strict):
    total_steps: int = Field(20, ge=1)
    # 0 = no checkpoints at all (benchmarks); otherwise every N steps and after the last step
    save_every: int = Field(5, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    out_dir: str = "runs/train"
    tensorboard: bool = False  # same as listing tensorboard in loggers
    # jsonl (metrics.jsonl, which sleuth report and resume read) is always written
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl"]
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    # validation on data.dev (the method's reward, greedy decoding, the same questions every time):
    # before the first step, after every `eval_every` steps (None: only those two) and after the last
    eval_every: int | None = Field(None, ge=1)
    eval_examples: int = Field(64, ge=1)  # the first N questions of data.dev
    # stop after the step that passes this wall time (minutes since this process started training),
    # with a checkpoint; a resumed run continues towards total_steps
    time_limit_minutes: float | None = Field(None, gt=0)
    # conditions over the health metrics or validation, each with an action (sleuth.rl.guard_config)
    guards: list[GuardConfig] = Field(default_factory=default_guards)
    # one_step: step k+1's rollouts are made from the weights step k started with, before step k's update (one
    # step stale; the generator's recorded log-probs are the ratio's old side); sleuth.rl.overlap.
    # one_step_async: the same rollouts, made while step k updates (a background thread decoding a frozen
    # snapshot of the pre-update weights; on CUDA its own stream), as verl's one_step_off_policy recipe and SkyRL's
    # one-step off-policy pipelining run them: the same trajectories, losses and weights as one_step, a step of
    # ~max(rollout, update) instead of their sum; the decode engine's KV pool then stays while the update runs
    overlap: Literal["off", "one_step", "one_step_async"] = "off"

    @field_validator("overlap", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _unique_guard_names(self) -> TrainerConfig:
        names = [g.name for g in self.guards]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"trainer.guards: each guard needs its own name; repeated: {', '.join(repeated)}"
            )
        return self


class SFTConfig(_Strict):
    """Supervised fine-tuning on trajectory records (`sleuth trajectories`), run before RL."""

    data: str  # trajectory jsonl
    limit: int | None = Field(None, ge=1)  # use at most this many training trajectories (a small warm-up)
    epochs: int = Field(2, ge=1)
    lr: float = Field(1e-4, gt=0.0)
    batch_size: int = Field(16, ge=1)  # trajectories per optimizer step
    micro_batch_size: int = Field(4, ge=1)
    max_length: int = Field(4096, ge=8)  # prompt + response tokens; longer rows are cut
    held_out: float = Field(0.05, ge=0.0, lt=1.0)  # fraction of questions kept out for the held-out loss
    save_every: int = Field(0, ge=0)  # 0: only after the last step
    out_dir: str | None = None  # default: <trainer.out_dir>/sft


class RetryConfig(_Strict):
    """Backoff for calls to the retriever server and remote judge/generator models. The default
    waits out a 2-minute outage (a 60 s one with room to spare); past it the trainer writes a
    checkpoint and exits naming the service."""

    max_attempts: int = Field(1000, ge=1)
    initial_delay_s: float = Field(0.5, ge=0.0)
    max_delay_s: float = Field(8.0, ge=0.0)
    budget_s: float = Field(120.0, ge=0.0)  # since the first failed attempt of one call
    jitter: float = Field(0.5, ge=0.0, le=1.0)

    def policy(self) -> RetryPolicy:
        return RetryPolicy(**self.model_dump())


class ServicesConfig(_Strict):
    retry: RetryConfig = Field(default_factory=RetryConfig)


class Recipe(_Strict):
    name: str
    description: str = ""
    seed: int = 0
    # plugin modules to import first, so the methods (register_method), readers and rewards
    # (@register_reward) they register can be named in this recipe
    plugins: list[str] = Field(default_factory=list)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    retriever: RetrieverConfig
    agent: AgentConfig = Field(default_factory=AgentConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)  # no section: the method's default_reward
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig | None = None  # when set, `sleuth train` first fine-tunes on it, then starts RL from it

    services: ServicesConfig = Field(default_factory=ServicesConfig)

    @model_validator(mode="after")
    def _validation_needs_questions(self) -> Recipe:
        if self.trainer.eval_every is not None and self.data.dev is None:
            raise ValueError(
                f"trainer.eval_every={self.trainer.eval_every} validates on data.dev, which is not set; "
                "name a question file there (the same formats as data.train), or drop eval_every"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _plugins_then_defaults(cls, data: Any) -> Any:
        """Before any section is validated: read `reward.plugins` (before issue 29) as the top-level
        `plugins:` (with a warning), import the plugins, so an estimator, loss, reward, loop, reader or
        retriever backend they register can be named anywhere in the recipe, then fill a missing `reward:`
        section with the method's `default_reward` (a plugin method's included)."""
        if not isinstance(data, dict):
            return data
        data = _moved_reward_plugins(data)
        plugins = data.get("plugins") or []
        if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
            raise ValueError(f"plugins: a list of module names, got {plugins!r}")
        load_plugins(plugins)
        agent = data.get("agent")
        loop = (
            agent.get("loop", AgentConfig.model_fields["loop"].default) if isinstance(agent, dict) else None
        )
        method = find_method(loop) if isinstance(loop, str) else None
        if data.get("reward") is None and method is not None:
            data = {**data, "reward": copy.deepcopy(dict(method.default_reward))}
        return data

    @model_validator(mode="after")
    def _known_loop(self) -> Recipe:
        if find_method(self.agent.loop) is None:
            raise ValueError(
                f"agent.loop: unknown loop {self.agent.loop!r}; choose one of: {', '.join(loop_names())}"
            )
        return self


def _moved_reward_plugins(data: dict[str, Any]) -> dict[str, Any]:
    """`reward.plugins` (before issue 29) is read as the top-level `plugins:` section, with a warning."""
    reward = data.get("reward")
    if not (isinstance(reward, dict) and "plugins" in reward):
        return data
    reward = dict(reward)
    old = reward.pop("plugins") or []
    if not isinstance(old, list):
        raise ValueError(
            f"reward.plugins (now the top-level `plugins:`) must be a list of module names, got {old!r}"
        )
    if old:
        warnings.warn(
            f"recipe: reward.plugins is read as the top-level `plugins:` section ({old}); "
            "move the list there",
            DeprecationWarning,
            stacklevel=3,
        )
    return {**data, "reward": reward, "plugins": list(dict.fromkeys([*(data.get("plugins") or []), *old]))}


def parse_override(text: str) -> tuple[list[str], Any]:
    """`algorithm.n=4` -> (["algorithm", "n"], 4). The value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, _, raw = text.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r} has an empty key")
    return path, yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def recipe_from_dict(data: dict, source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            validation_message(source, "recipe", err, hint=lambda e: unknown_key_hint(Recipe, e))
        ) from None


def write_recipe(data: dict, path: str | Path) -> Recipe:
    """Save a recipe built in code as YAML at `path` (re-runnable with `sleuth train` / `sleuth sft`), then
    validate it, naming that file in any error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))
    return recipe_from_dict(data, source=str(path))


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe YAML (safe_load), apply `key.path=value` overrides, validate.

    Relative data/index paths stay relative to the current directory, like any CLI path.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"recipe {path} does not exist")
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping")
    data = apply_overrides(data, overrides or [])
    return recipe_from_dict(data, source=str(path))
