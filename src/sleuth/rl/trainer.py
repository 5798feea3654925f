"""The RL trainer: rollout -> rewards -> advantages -> K epochs of minibatch updates.

Read `train()` top to bottom; everything it calls is either a small helper in
this file or a pure function in `sleuth.rl.advantages` / `sleuth.rl.losses`.

Token layout. A trajectory is `prompt_ids + response_ids`; the response mixes
policy tokens (loss_mask 1) and tokens the environment inserted (documents,
feedback; loss_mask 0). Batches left-pad prompts so every response starts at
the same column, and all per-token tensors here are (B, R) over response
positions only: entry j scores response token j given everything before it.
`action_mask` is 1 exactly on policy tokens, so inserted tokens never
contribute to the policy, value or KL terms.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sleuth.agent.registry import get_method
from sleuth.agent.trajectory import Trajectory, write_trajectories
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError, ServiceError
from sleuth.llm.base import SamplingParams
from sleuth.rl import advantages as adv_fns
from sleuth.rl import losses as loss_fns
from sleuth.rl.checkpoint import (
    full_states,
    latest_checkpoint,
    load_optimizer_states,
    load_training_state,
    resumable_checkpoint,
    save_checkpoint,
    set_rng_state,
    write_run_info,
)
from sleuth.rl.config import Recipe
from sleuth.rl.dist import (
    DistContext,
    clip_grad_norm,
    dist_masked_whiten,
    init_distributed,
    shard_range,
    unwrap,
    wrap_model,
)
from sleuth.rl.loggers import open_recipe_loggers
from sleuth.utils import atomic_path, seed_everything

# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------


class ValueModel(nn.Module):
    """Critic: a transformer backbone plus a scalar head over every position."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        # the head runs in its own (at least fp32) precision, whatever the backbone's dtype
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def load_policy(recipe: Recipe, device: torch.device, adapter_dir: Path | None = None):
    """Load tokenizer + policy (optionally LoRA-wrapped) from the recipe's model spec."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.llm.registry import resolve_model_path

    path = resolve_model_path(recipe.model.policy)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # dtype "bfloat16" with LoRA gives a bf16 frozen base (half the memory, and one dtype in a static
    # KV cache) while peft keeps the trained adapters in fp32.
    dtype = master_dtype(recipe)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if recipe.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if recipe.model.lora.enabled:
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
        else:
            lora = recipe.model.lora
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=lora.target_modules,
                    task_type="CAUSAL_LM",
                ),
            )
    elif adapter_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(adapter_dir, dtype=dtype).to(device)
    return tokenizer, model, path


def master_dtype(recipe: Recipe) -> torch.dtype:
    """Dtype of the trained weights: "auto" keeps fp32 masters; bf16 comes from autocast on GPU."""
    return {
        "auto": torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float64": torch.float64,
    }[recipe.model.dtype]


def rollout_copy(recipe: Recipe, policy: nn.Module, device: torch.device) -> nn.Module | None:
    """A bf16 copy of a fully fine-tuned fp32 policy for rollouts on GPU, or None to generate
    with the policy itself. Decoding fp32 weights under autocast re-casts every weight matrix at
    every decode step, and its KV cache receives fp32 keys (after RoPE) with bf16 values, which a
    static cache cannot hold. The copy costs 2 bytes per parameter and is refreshed after every
    optimizer step (`sync_rollout_copy`), like an inference engine's weight sync."""
    choice = recipe.model.generation_weights
    if choice == "policy":
        return None
    model = unwrap(policy)
    eligible = (
        device.type == "cuda"
        and not recipe.model.lora.enabled
        and recipe.model.parallel != "fsdp"
        and next(model.parameters()).dtype == torch.float32
    )
    if not eligible:
        if choice == "bf16-copy":
            raise ConfigError(
                "model.generation_weights=bf16-copy needs full fine-tuning of fp32 weights on CUDA without FSDP; "
                "use generation_weights=auto or policy"
            )
        return None
    import copy

    # Each parameter goes straight to a bf16 clone through deepcopy's memo (no transient fp32 copy of
    # the model; tied weights stay tied). Buffers such as RoPE's inv_freq stay fp32.
    memo: dict[int, Any] = {
        id(p): nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False) for p in model.parameters()
    }
    return copy.deepcopy(model, memo).eval()


def check_rollout_cache(recipe: Recipe, generator_model: nn.Module, device: torch.device) -> None:
    """fp32 weights decoding under bf16 autocast feed a static KV cache fp32 keys (after RoPE) and
    bf16 values, which transformers' StaticCache cannot hold: fail at start with the fix."""
    if (
        device.type == "cuda"
        and recipe.model.generation_cache == "static"
        and next(generator_model.parameters()).dtype == torch.float32
    ):
        raise ConfigError(
            "model.generation_cache=static on GPU needs bf16 rollout weights: with LoRA set model.dtype=bfloat16 "
            "(a bf16 frozen base; the adapters stay fp32), with FSDP use generation_cache=dynamic"
        )


@torch.no_grad()
def sync_rollout_copy(rollout: nn.Module, policy: nn.Module) -> None:
    for dst, src in zip(rollout.parameters(), unwrap(policy).parameters(), strict=True):
        dst.copy_(src)


def load_reference(model_path: str, policy: nn.Module, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = next(policy.parameters()).dtype
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    return ref.eval().requires_grad_(False)


def load_critic(model_path: str, device: torch.device, dtype: torch.dtype) -> ValueModel:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_path)
    backbone = AutoModel.from_pretrained(model_path, dtype=dtype)
    critic = ValueModel(backbone, config.hidden_size)
    critic.value_head.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return critic.to(device)


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class FrozenBaseGenerator:
    """A frozen generator that is the policy's own base model with LoRA adapters disabled."""

    def __init__(self, policy_generator: Any, peft_model: Any):
        self._gen = policy_generator
        self._model = peft_model
        self.tokenizer = policy_generator.tokenizer

    def generate(self, batch, stop=None, params=None):
        with self._model.disable_adapter():
            return self._gen.generate(batch, stop=stop, params=params)


# ----------------------------------------------------------------------------
# Data cursor
# ----------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------
# Tensors from trajectories
# ----------------------------------------------------------------------------


@dataclass
class TokenBatch:
    """Each row is prompt + response packed to the left and right-padded, so the training forward
    needs no attention mask at all: causal attention alone keeps real tokens from seeing the padding
    after them. (Left padding needs a mask whose pad rows attend to nothing; CUDA's
    memory-efficient attention backward has produced NaN gradients for such masks while the forward
    stayed finite.) Without a mask SDPA can pick its flash kernel. Per-token tensors cover only
    response positions: column j of `action_mask` is response token j of that row."""

    input_ids: torch.Tensor  # (B, L), L = longest prompt + R
    response_start: torch.Tensor  # (B,) long: the column where each row's response begins
    action_mask: torch.Tensor  # (B, R) float: 1 where response token j is a policy token

    @property
    def response_width(self) -> int:
        return self.action_mask.shape[1]

    def index(self, idx: torch.Tensor) -> TokenBatch:
        """The rows `idx`, cut to the columns they use (their longest prompt + R)."""
        starts = self.response_start[idx]
        width = int(starts.max()) + self.response_width if len(starts) else 0
        return TokenBatch(self.input_ids[idx, :width], starts, self.action_mask[idx])


def collate(trajs: list[Trajectory], pad_id: int, drop_truncated: bool = False) -> TokenBatch:
    S = max(len(t.prompt_ids) for t in trajs)
    R = max(1, max(len(t.response_ids) for t in trajs))
    B = len(trajs)
    input_ids = torch.full((B, S + R), pad_id, dtype=torch.long)
    starts = torch.zeros(B, dtype=torch.long)
    action = torch.zeros((B, R), dtype=torch.float32)
    for i, t in enumerate(trajs):
        P, n = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : P + n] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        starts[i] = P
        if drop_truncated and t.finish_reason == "length":
            continue  # DAPO overlong filtering: a truncated response teaches nothing reliable
        if n:
            action[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return TokenBatch(input_ids, starts, action)


def _response_columns(batch: TokenBatch, first: int) -> torch.Tensor:
    """(B, R) index of the position predicting response token j of each row, counted from `first`."""
    R = batch.response_width
    offsets = torch.arange(R, device=batch.input_ids.device)
    return (batch.response_start.to(batch.input_ids.device) - 1 - first)[:, None] + offsets[None, :]


def forward_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (B, R) of each response token under `model`, logits scaled by the sampling
    temperature. Only positions from the earliest response start on go through the LM head: prompt
    positions never materialise (B, L, V) logits, which dominate memory and time at a 150k vocabulary."""
    first = int(batch.response_start.min()) - 1  # the position predicting the earliest response token
    L = batch.input_ids.shape[1]
    out = model(input_ids=batch.input_ids, logits_to_keep=L - first, use_cache=False)
    logits = loss_fns.at_least_fp32(out.logits[:, :-1])  # positions first .. L-2
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    cols = _response_columns(batch, first)
    per_position = loss_fns.logprobs_from_logits(logits, batch.input_ids[:, first + 1 :])
    logprobs = per_position.gather(1, cols)
    entropy = loss_fns.entropy_from_logits(logits).gather(1, cols) if with_entropy else None
    return logprobs, entropy


def critic_values(critic: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Values (B, R): entry j is the value of the state just before response token j."""
    values = critic(batch.input_ids)
    return values.gather(1, _response_columns(batch, 0))


def chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


@torch.no_grad()
def batched_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, micro: int, device: torch.device
) -> torch.Tensor:
    """Log-probs (B, L-1) without gradients, in micro-batches, returned on the CPU."""
    out = []
    for sl in chunks(batch.input_ids.shape[0], micro):
        mb = _to(batch.index(torch.arange(sl.start, sl.stop)), device)
        with autocast(device):
            out.append(forward_logprobs(model, mb, temperature)[0].cpu())
    return torch.cat(out)


@torch.no_grad()
def batched_values(critic: ValueModel, batch: TokenBatch, micro: int, device: torch.device) -> torch.Tensor:
    """Critic values (B, R) without gradients, in micro-batches, returned on the CPU."""
    out = []
    for sl in chunks(batch.input_ids.shape[0], micro):
        mb = _to(batch.index(torch.arange(sl.start, sl.stop)), device)
        with autocast(device):
            out.append(loss_fns.at_least_fp32(critic_values(critic, mb)).cpu())
    return torch.cat(out)


def _to(batch: TokenBatch, device: torch.device) -> TokenBatch:
    return TokenBatch(*(t.to(device) for t in (batch.input_ids, batch.response_start, batch.action_mask)))


# ----------------------------------------------------------------------------
# Metrics log
# ----------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


# ----------------------------------------------------------------------------
# Building the pieces a recipe names
# ----------------------------------------------------------------------------


def build_retriever(recipe: Recipe):
    if recipe.retriever.mcp is not None or recipe.retriever.http is not None:
        from sleuth.retrieval.tools import tool_retriever

        return tool_retriever(recipe.retriever.mcp, recipe.retriever.http)
    if recipe.retriever.url is not None:
        from sleuth.retrieval.client import RemoteRetriever

        return RemoteRetriever(recipe.retriever.url, retry=recipe.services.retry.policy())
    from sleuth.retrieval import load_retriever

    return load_retriever(recipe.retriever.index, corpus=recipe.retriever.corpus)


def loop_options(recipe: Recipe) -> dict[str, Any]:
    cfg = dict(recipe.agent.options)
    if recipe.agent.max_turns is not None:
        cfg["max_turns"] = recipe.agent.max_turns
    if recipe.agent.top_k is not None:
        cfg["top_k"] = recipe.agent.top_k
    return cfg


def build_loop(recipe: Recipe):
    from sleuth.agent import get_loop

    return get_loop(recipe.agent.loop, **loop_options(recipe))


def searcher_info(recipe: Recipe) -> dict[str, Any]:
    return {
        "recipe": recipe.name,
        "loop": recipe.agent.loop,
        "loop_options": loop_options(recipe),
        "base_model": recipe.model.policy,
        "lora": recipe.model.lora.enabled,
        "max_new_tokens_per_turn": recipe.agent.max_new_tokens_per_turn,
        "max_obs_tokens": recipe.agent.max_obs_tokens,
        "max_response_tokens": recipe.agent.max_response_tokens,
    }


def load_examples(recipe: Recipe) -> list[QAExample]:
    from sleuth.data.formats import load_qa

    examples = load_qa(recipe.data.train)
    if recipe.data.drop_yes_no:
        from sleuth.data.filters import drop_yes_no

        examples = drop_yes_no(examples)
    if recipe.data.hard_from:
        from sleuth.data.filters import keep_hard
        from sleuth.data.score_cache import ScoreCache

        examples = keep_hard(examples, ScoreCache(recipe.data.hard_from))
    if recipe.data.max_train_examples:
        examples = examples[: recipe.data.max_train_examples]
    if not examples:
        raise ConfigError(f"data.train={recipe.data.train}: no training examples left after filtering")
    return examples


def build_reward_services(recipe: Recipe, policy_gen: Any, policy: nn.Module, retriever: Any):
    from sleuth.rewards.base import RewardServices

    def service_model(spec: str | None, role: str):
        if spec is None:
            return None
        if spec == "policy-base":
            if not hasattr(policy, "disable_adapter"):
                raise ConfigError("reward generator 'policy-base' needs model.lora.enabled=true")
            return FrozenBaseGenerator(policy_gen, policy)
        from sleuth.llm.registry import is_remote_spec, load_generator

        if is_remote_spec(spec):
            return load_generator(spec, retry=recipe.services.retry.policy(), service=f"reward {role}")
        return load_generator(spec)

    encoder = None
    if recipe.reward.encoder:
        from sleuth.retrieval.encoders import Encoder, EncoderConfig

        encoder = Encoder(EncoderConfig(name=recipe.reward.encoder))
    cache = None
    if recipe.reward.baseline_cache:
        from sleuth.data.score_cache import ScoreCache

        cache = ScoreCache(recipe.reward.baseline_cache)
    return RewardServices(
        generator=service_model(recipe.reward.generator, "generator"),
        judge=service_model(recipe.reward.judge, "judge"),
        encoder=encoder,
        baseline_cache=cache,
        retriever=retriever,
    )


def build_optimizer(params, lr: float, recipe: Recipe):
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=lr, betas=recipe.optim.betas, eps=recipe.optim.eps, weight_decay=recipe.optim.weight_decay
    )
    warmup = recipe.optim.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return opt, sched


# ----------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------


def initial_weights(recipe: Recipe) -> Path | None:
    """The policy directory of `model.init_from` (a checkpoint or run directory), if set."""
    if recipe.model.init_from is None:
        return None
    from sleuth.agent.searcher import resolve_checkpoint

    return resolve_checkpoint(recipe.model.init_from) / "policy"


def check_input_paths(recipe: Recipe) -> None:
    """Every file and directory the recipe names must exist: checked before any model loads, so a
    typo costs a second, not a model load and a traceback."""
    from sleuth.llm.registry import check_model_spec

    named = [
        ("data.train", recipe.data.train),
        ("data.dev", recipe.data.dev),
        ("data.hard_from", recipe.data.hard_from),
        ("retriever.index", recipe.retriever.index),
        ("retriever.corpus", recipe.retriever.corpus),
        ("model.init_from", recipe.model.init_from),
        ("sft.data", recipe.sft.data if recipe.sft is not None else None),
    ]
    missing = [f"{field}: {value} does not exist" for field, value in named if value and not Path(value).exists()]
    try:
        check_model_spec(recipe.model.policy)
    except ConfigError as err:
        missing.append(f"model.policy: {err}")
    if missing:
        raise ConfigError(f"recipe {recipe.name!r} names inputs that are not there:\n  " + "\n  ".join(missing))


def train(recipe: Recipe, *, resume: bool = False, console: Any = None) -> dict[str, Any]:
    """Run the recipe. Inputs are checked first; a run that fails before logging a step removes
    the output directory it created, so a rerun does not find a half-made one."""
    check_input_paths(recipe)
    out_dir = Path(recipe.trainer.out_dir)
    created = not out_dir.exists()
    try:
        return _train(recipe, resume=resume, console=console)
    except BaseException:
        progress = any((out_dir / name).exists() for name in ("metrics.jsonl", "checkpoints", "sft"))
        if created and not progress:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _train(recipe: Recipe, *, resume: bool = False, console: Any = None) -> dict[str, Any]:
    from rich.console import Console

    from sleuth.llm.hf import HFGenerator
    from sleuth.rewards.base import failed_trajectories, get_reward

    console = console or Console()
    if recipe.sft is not None and recipe.model.init_from is None:
        # SFT first (resumable; a finished SFT run is reused), then RL from its final checkpoint
        from sleuth.rl.sft import run_sft

        sft = run_sft(recipe, resume=True, console=console)
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"init_from": sft["checkpoint"]})})
    ctx = init_distributed(recipe.model.device)
    if not ctx.is_main:
        console = Console(quiet=True)
    out_dir = Path(recipe.trainer.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    algo = recipe.algorithm
    device = ctx.device
    seed_everything(recipe.seed)

    # --- resume point -------------------------------------------------------
    ckpt = None
    if resume:
        ckpt, skipped = resumable_checkpoint(out_dir)
        for path, reason in skipped:
            console.print(f"[yellow]skipping damaged checkpoint {path}[/]: {reason}")
    trainer_state: dict[str, Any] = {}
    tensor_state: dict[str, Any] = {}
    if ckpt is not None:
        trainer_state, tensor_state = load_training_state(ckpt)
        console.print(f"[bold]resuming[/] from {ckpt} (step {trainer_state['step']})")
    elif resume:
        console.print(f"[yellow]--resume: no checkpoint under {out_dir}, starting fresh[/]")
    start_step = int(trainer_state.get("step", 0))

    # --- models -------------------------------------------------------------
    tokenizer, policy, model_path = load_policy(recipe, device, ckpt / "policy" if ckpt else initial_weights(recipe))
    pad_id = tokenizer.pad_token_id
    kl_coef = algo.kl.coef
    ref_model = None
    if kl_coef > 0 and not hasattr(policy, "disable_adapter"):
        # the reference is the starting model, also when resuming (the policy then holds trained weights)
        ref_model = load_reference(model_path, policy, device)
        if recipe.model.offload_reference:
            ref_model.to("cpu")
    critic = (
        load_critic(model_path, device, master_dtype(recipe)) if algo.uses_critic else None
    )
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
    models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
    if tensor_state:
        load_optimizer_states(models, optimizers, tensor_state["optimizers"])
        for k, s in schedulers.items():
            s.load_state_dict(tensor_state["schedulers"][k])
        set_rng_state(tensor_state["rng"])
    if ctx.enabled:  # ranks sample different trajectories
        seed_everything(recipe.seed * 1_000_003 + start_step * 1_009 + ctx.rank)

    # --- environment, data, reward ------------------------------------------
    rollout_model = rollout_copy(recipe, policy, device)
    rollout_weights = rollout_model if rollout_model is not None else unwrap(policy)
    check_rollout_cache(recipe, rollout_weights, device)
    generator = HFGenerator(
        rollout_weights,
        tokenizer=tokenizer,
        cache=recipe.model.generation_cache,
        compile=recipe.model.compile_generation,
    )
    retriever = build_retriever(recipe)
    loop = build_loop(recipe)
    examples = load_examples(recipe)
    cursor = DataCursor(recipe.seed, len(examples), recipe.data.shuffle, **trainer_state.get("cursor", {}))
    for module in recipe.reward.plugins:
        importlib.import_module(module)
    reward_fn = get_reward(recipe.reward.name, **recipe.reward.options)
    services = build_reward_services(recipe, generator, unwrap(policy), retriever)
    sampling = SamplingParams(
        max_new_tokens=recipe.agent.max_new_tokens_per_turn,
        temperature=recipe.sampling.temperature,
        top_p=recipe.sampling.top_p,
    )
    local_prompts = shard_range(algo.prompts_per_step, ctx, "algorithm.prompts_per_step")
    local_minibatch = algo.minibatch_size // ctx.world_size
    if algo.minibatch_size % ctx.world_size:
        raise ConfigError(
            f"algorithm.minibatch_size must be divisible by the number of ranks ({ctx.world_size})"
        )
    log = open_recipe_loggers(recipe, out_dir, start_step) if ctx.is_main else None
    if ctx.is_main:
        run_info = {
            "recipe": recipe.model_dump(),
            "model_path": model_path,
            "device": str(device),
            "ranks": ctx.world_size,
        }
        write_run_info(out_dir, run_info)
        log.log_config(run_info)

    def save(done: int, cursor_state: dict[str, int], stage: int) -> None:
        model_states, optim_states = full_states(models, optimizers)  # collective: all ranks
        if ctx.is_main:
            save_checkpoint(
                out_dir,
                done,
                policy=unwrap(policy),
                tokenizer=tokenizer,
                critic=unwrap(critic) if critic is not None else None,
                optimizers=optimizers,
                schedulers=schedulers,
                trainer_state={"cursor": cursor_state, "stage": stage, "recipe": recipe.name},
                searcher_info=searcher_info(recipe),
                keep=recipe.trainer.keep_checkpoints,
                policy_state=model_states["policy"],
                critic_state=model_states.get("critic"),
                optimizer_states=optim_states,
            )
        ctx.barrier()

    # --- steps --------------------------------------------------------------
    metrics: dict[str, float] = {}  # the last step's, for the final report
    last_saved = start_step
    for step in range(start_step, recipe.trainer.total_steps):
        t_start = time.perf_counter()
        reward_fn.set_step(step)
        stage = getattr(reward_fn, "current_stage", 1)  # two-stage rewards (staged) switch on the step

        # 1. rollout and reward (each rank its slice of the prompts)
        policy.eval()
        cursor_before = cursor.state()
        try:
            collected = collect_rollouts(
                recipe,
                ctx,
                generator,
                retriever,
                loop,
                reward_fn,
                services,
                sampling,
                examples,
                cursor,
                local_prompts,
            )
        except ServiceError as err:
            # a service past its retry budget: keep every finished step, then stop with its name
            where = "no new checkpoint (nothing done since the last one)"
            if step > last_saved and not ctx.enabled:  # a lone rank cannot run the collective save
                save(step, cursor_before, stage)
                where = f"checkpoint of step {step} written"
            raise ServiceError(
                f"{err}\nstopped at step {step + 1} of {recipe.trainer.total_steps}: {where} under {out_dir}; "
                f"when the service is back, rerun with --resume (or raise services.retry.budget_s)"
            ) from err
        kept, scores = collected.trajs, collected.scores

        # 2. tensors, old/ref log-probs, values
        t2 = time.perf_counter()
        batch = collate(kept, pad_id, drop_truncated=algo.overlong_filter)
        micro = algo.micro_batch_size
        temperature = recipe.sampling.temperature
        # One update over the whole batch is on-policy: the old log-probs are the ones the update's own
        # forward computes, so the extra no-grad pass is skipped (unless a KL reward penalty needs them).
        on_policy = algo.ppo_epochs == 1 and local_minibatch >= len(kept)
        needs_old = not on_policy or (kl_coef > 0 and algo.kl.mode == "penalty")
        old_logprobs = batched_logprobs(policy, batch, temperature, micro, device) if needs_old else None
        ref_logprobs = None
        if kl_coef > 0:
            if ref_model is not None:
                ref_logprobs = reference_logprobs(ref_model, batch, temperature, micro, device)
            else:
                with unwrap(policy).disable_adapter():  # LoRA: the base model is the reference
                    ref_logprobs = batched_logprobs(policy, batch, temperature, micro, device)
        mask = batch.action_mask
        score_t = torch.tensor(scores, dtype=torch.promote_types(dtype_of(policy), torch.float32))
        token_rewards = adv_fns.outcome_to_token_rewards(score_t, mask)
        kl_for_log = None
        if ref_logprobs is not None:
            if old_logprobs is not None:
                kl_for_log = loss_fns.kl_penalty(old_logprobs, ref_logprobs, algo.kl.estimator)
            if algo.kl.mode == "penalty":
                token_rewards = loss_fns.apply_kl_penalty(token_rewards, kl_for_log, kl_coef, mask)

        # 3. advantages (groups never span ranks; whitening statistics are global)
        old_values = None
        if algo.advantage == "gae":
            critic.eval()
            old_values = batched_values(critic, batch, micro, device)
            advantages, returns = adv_fns.gae_advantages(
                token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam, whiten=False
            )
            advantages = dist_masked_whiten(advantages, mask, ctx)
        else:
            advantages, returns = adv_fns.compute_advantages(
                algo.advantage, token_rewards=token_rewards, response_mask=mask, group_ids=_group_index(kept)
            )

        # 4. K epochs of minibatch updates
        policy.train()
        stats = update(
            recipe,
            ctx,
            policy,
            critic,
            optimizers,
            batch,
            old_logprobs,
            ref_logprobs,
            advantages,
            returns,
            old_values,
            local_minibatch,
            debug_path=out_dir / "debug" / f"nonfinite_step_{step + 1:06d}_rank{ctx.rank}.pt",
        )
        for s in schedulers.values():
            s.step()
        if rollout_model is not None:
            sync_rollout_copy(rollout_model, policy)
        t_update = time.perf_counter() - t2

        # 5. log (metrics averaged over ranks; every rank holds an equal share of the batch)
        metrics = _step_metrics(
            kept, scores, collected.all_rewards, mask, kl_for_log, stats, answers=get_method(recipe.agent.loop).answers
        )
        metrics.update(
            {
                "stage": float(stage),
                "sampling_rounds": float(collected.rounds),
                "time/rollout": collected.t_rollout,
                "time/reward": collected.t_reward,
                "time/update": t_update,
                "time/step": time.perf_counter() - t_start,
                "tokens/policy_per_s": float(mask.sum()) / max(collected.t_rollout, 1e-9),
                **_memory_metrics(device),
            }
        )
        failed = failed_trajectories(collected.trajs_all)
        metrics["rollout/errors"] = float(len(failed))
        metrics = _mean_over_ranks(metrics, ctx)
        metrics["lr"] = schedulers["policy"].get_last_lr()[0]
        if ctx.enabled:
            metrics["tokens/policy_per_s"] *= ctx.world_size
        if ctx.is_main:
            log.write(step + 1, metrics)
            console.print(_format_line(step + 1, recipe.trainer.total_steps, metrics))
            write_trajectories(
                out_dir / "rollouts" / f"step_{step + 1:06d}.jsonl", kept[: min(len(kept), 32)]
            )
        if failed:  # one example per step is enough to debug; the count is in the metrics
            write_trajectories(out_dir / "debug" / f"failed_step_{step + 1:06d}_rank{ctx.rank}.jsonl", failed[:1])

        # 6. checkpoint (the data cursor is global, so a run resumes on any number of ranks)
        done = step + 1
        every = recipe.trainer.save_every
        if every and (done % every == 0 or done == recipe.trainer.total_steps):
            save(done, cursor.state(), stage)
            last_saved = done
    if services.baseline_cache is not None:
        services.baseline_cache.save()
    final = latest_checkpoint(out_dir)
    result = {"out_dir": str(out_dir), "checkpoint": str(final) if final else None}
    if log is not None:
        log.finish({**result, "steps": recipe.trainer.total_steps, "final_metrics": metrics})
    return result


@dataclass
class Collected:
    trajs: list[Trajectory]
    scores: list[float]
    all_rewards: list[float]  # before DAPO's filter
    trajs_all: list[Trajectory]  # every rollout of the step, before DAPO's filter
    rounds: int
    t_rollout: float
    t_reward: float


def collect_rollouts(
    recipe: Recipe,
    ctx: DistContext,
    generator: Any,
    retriever: Any,
    loop: Any,
    reward_fn: Any,
    services: Any,
    sampling: SamplingParams,
    examples: list[QAExample],
    cursor: DataCursor,
    local_prompts: slice,
) -> Collected:
    """Roll out this rank's prompts and score them. With DAPO dynamic sampling, groups whose
    rewards are all equal carry no signal: they are dropped and new prompts are drawn until every
    rank holds its share of groups, or `max_sampling_rounds` is reached (ranks agree on when to stop)."""
    from sleuth.agent.engine import rollout
    from sleuth.rewards.base import guarded_rewards

    algo = recipe.algorithm
    target = (local_prompts.stop - local_prompts.start) * algo.n
    out = Collected([], [], [], [], 0, 0.0, 0.0)
    last_round: tuple[list[Trajectory], list[float]] = ([], [])
    while out.rounds < algo.max_sampling_rounds:
        out.rounds += 1
        indices = cursor.take(algo.prompts_per_step)[local_prompts]  # the same global draw on every rank
        t0 = time.perf_counter()
        with autocast(ctx.device):
            trajs = rollout(
                loop,
                generator,
                retriever,
                [examples[i] for i in indices],
                sampling,
                n=algo.n,
                max_obs_tokens=recipe.agent.max_obs_tokens,
                max_response_tokens=recipe.agent.max_response_tokens,
            )
        t1 = time.perf_counter()
        results = guarded_rewards(reward_fn, trajs, services)
        out.t_rollout += t1 - t0
        out.t_reward += time.perf_counter() - t1
        for t, r in zip(trajs, results, strict=True):
            t.rewards = {"total": r.total, **r.components}
            t.extra["group"] = f"{out.rounds}:{t.extra.get('group', 0)}"
        round_scores = torch.tensor([r.total for r in results], dtype=torch.float32)
        out.trajs_all += trajs
        out.all_rewards += round_scores.tolist()
        last_round = (list(trajs), round_scores.tolist())
        if algo.dynamic_sampling:
            from sleuth.rl.sampling import filter_groups

            keep = filter_groups(round_scores, _group_index(trajs))
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


def update(
    recipe: Recipe,
    ctx: DistContext,
    policy: nn.Module,
    critic: nn.Module | None,
    optimizers: dict[str, torch.optim.Optimizer],
    batch: TokenBatch,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor | None,
    local_minibatch: int,
    debug_path: Path | None = None,
) -> dict[str, list[float]]:
    """PPO-style epochs over minibatches, micro-batched for memory. Loss normalisers are the
    minibatch's global totals divided by the number of ranks, so DDP's gradient mean equals the
    gradient of one process's loss over the whole minibatch."""
    algo, device, mask = recipe.algorithm, ctx.device, batch.action_mask
    kl_coef = algo.kl.coef
    temperature = recipe.sampling.temperature
    stats: dict[str, list[float]] = {}
    n_traj = batch.input_ids.shape[0]
    for _epoch in range(algo.ppo_epochs):
        perm = torch.randperm(n_traj)
        for mb_slice in chunks(n_traj, local_minibatch):
            mb_idx = perm[mb_slice]
            counts = ctx.all_reduce_sum(torch.tensor([float(mask[mb_idx].sum()), float(len(mb_idx))]))
            totals = {
                "num_tokens": max(counts[0].item(), 1.0) / ctx.world_size,
                "num_seqs": counts[1].item() / ctx.world_size,
            }
            for o in optimizers.values():
                o.zero_grad(set_to_none=True)
            micro_slices = list(chunks(len(mb_idx), algo.micro_batch_size))
            # losses are summed over micro-batches: each is normalised by the minibatch totals, so the
            # sum is this rank's share of the minibatch loss (averaged over ranks when logged)
            mb_losses: dict[str, float] = {}
            for i, mi_slice in enumerate(micro_slices):
                idx = mb_idx[mi_slice]
                mi = _to(batch.index(idx), device)
                m = mi.action_mask
                # DDP: all-reduce gradients once per minibatch, on its last micro-batch
                sync = i == len(micro_slices) - 1
                with _maybe_no_sync(policy, sync), autocast(device):
                    logprobs, entropy = forward_logprobs(policy, mi, temperature, with_entropy=True)
                    pg_loss, pg_stats = loss_fns.policy_loss(
                        logprobs.detach() if old_logprobs is None else old_logprobs[idx].to(device),
                        logprobs,
                        advantages[idx].to(device),
                        m,
                        clip_low=algo.clip_low,
                        clip_high=algo.clip_high,
                        dual_clip_c=algo.clip_ratio_c,
                        agg_mode=algo.loss_agg,
                        **totals,
                    )
                    loss = pg_loss
                    if algo.entropy_coef:
                        loss = loss - algo.entropy_coef * loss_fns.agg_loss(
                            entropy, m, algo.loss_agg, **totals
                        )
                    if ref_logprobs is not None and algo.kl.mode == "loss":
                        kl_term = loss_fns.kl_loss(
                            logprobs,
                            ref_logprobs[idx].to(device),
                            m,
                            kind=algo.kl.estimator,
                            agg_mode=algo.loss_agg,
                            **totals,
                        )
                        loss = loss + kl_coef * kl_term
                        _acc(mb_losses, "actor/kl_loss", kl_term.item())
                    loss.backward()
                _acc(mb_losses, "actor/pg_loss", pg_loss.item())
                _add(stats, "actor/entropy", loss_fns.agg_loss(entropy.detach(), m, algo.loss_agg).item())
                for k, v in pg_stats.items():
                    _add(stats, f"actor/{k}", float(v))
                if critic is not None:
                    with _maybe_no_sync(critic, sync), autocast(device):
                        values = critic_values(critic, mi)
                        v_loss, v_stats = loss_fns.value_loss(
                            values,
                            old_values[idx].to(device),
                            returns[idx].to(device),
                            m,
                            clip=algo.value_clip,
                            agg_mode=algo.loss_agg,
                            **totals,
                        )
                        (algo.value_coef * v_loss).backward()
                    _acc(mb_losses, "critic/value_loss", v_loss.item())
                    _add(stats, "critic/clipfrac", float(v_stats["vf_clipfrac"]))
            for k, v in mb_losses.items():
                _add(stats, k, v)
            grad_norm = _step_if_finite(
                optimizers["policy"], [p for p in policy.parameters() if p.requires_grad], recipe.optim.grad_clip, ctx
            )
            _add(stats, "actor/skipped_nonfinite_grad", float(not math.isfinite(grad_norm)))
            if math.isfinite(grad_norm):
                _add(stats, "actor/grad_norm", grad_norm)
            else:
                _report_nonfinite(policy, grad_norm, debug_path, {
                    "batch": {k: v[mb_idx] for k, v in vars(batch).items()},
                    "advantages": advantages[mb_idx],
                    "ref_logprobs": None if ref_logprobs is None else ref_logprobs[mb_idx],
                    "micro_batch_size": algo.micro_batch_size,
                })
            if critic is not None:
                critic_norm = _step_if_finite(
                    optimizers["critic"], list(critic.parameters()), recipe.optim.grad_clip, ctx
                )
                _add(stats, "critic/skipped_nonfinite_grad", float(not math.isfinite(critic_norm)))
    return stats


def _step_if_finite(optimizer: torch.optim.Optimizer, params: list, max_norm: float, ctx: DistContext) -> float:
    """Clip to the global gradient norm and step; returns the norm. A non-finite norm (global, so
    every rank agrees) would turn the weights into NaN for good: that step is skipped, as verl does."""
    norm = clip_grad_norm(params, max_norm, ctx)
    if math.isfinite(norm):
        optimizer.step()
    return norm


def _report_nonfinite(policy: nn.Module, norm: float, debug_path: Path | None, minibatch: dict[str, Any]) -> None:
    """Name the parameters with non-finite gradients and save the minibatch to reproduce it offline."""
    bad = [n for n, p in policy.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    if debug_path is not None:
        with atomic_path(debug_path) as tmp:
            torch.save({**minibatch, "nonfinite_parameters": bad}, tmp)
    logging.getLogger(__name__).warning(
        "non-finite gradient (norm %s) in %d parameter(s), e.g. %s; optimizer step skipped%s",
        norm, len(bad), ", ".join(bad[:3]), f"; minibatch saved to {debug_path}" if debug_path is not None else "",
    )


def dtype_of(model: nn.Module) -> torch.dtype:
    return next(unwrap(model).parameters()).dtype


def _maybe_no_sync(model: nn.Module, sync: bool):
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


@torch.no_grad()
def reference_logprobs(
    ref_model: nn.Module, batch: TokenBatch, temperature: float, micro: int, device: torch.device
) -> torch.Tensor:
    """Reference log-probs; an offloaded reference visits the GPU only for this pass."""
    home = next(ref_model.parameters()).device
    ref_model.to(device)
    try:
        return batched_logprobs(ref_model, batch, temperature, micro, device)
    finally:
        ref_model.to(home)


def _mean_over_ranks(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    if not ctx.enabled:
        return metrics
    keys = sorted(metrics)
    summed = ctx.all_reduce_sum(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    return {k: v / ctx.world_size for k, v in zip(keys, summed.tolist(), strict=True)}


# ----------------------------------------------------------------------------
# Small helpers for the loop above
# ----------------------------------------------------------------------------


def _memory_metrics(device: torch.device) -> dict[str, float]:
    """GPU memory of this rank: PyTorch's peak since the start, and what the whole card has in use
    (other allocators in the process, e.g. a library's JAX preallocating 75% of the GPU, show up
    only in the second)."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory/device_in_use_gib": (total - free) / 2**30,
    }


def _group_index(trajs: list[Trajectory]) -> list[int]:
    """Map each trajectory's group key to a dense integer id (samples of one prompt share it)."""
    ids: dict[str, int] = {}
    return [ids.setdefault(str(t.extra.get("group")), len(ids)) for t in trajs]


def _add(stats: dict[str, list[float]], key: str, value: float) -> None:
    stats.setdefault(key, []).append(value)


def _acc(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _step_metrics(
    trajs: list[Trajectory],
    scores: list[float],
    all_rewards: list[float],
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    stats: dict[str, list[float]],
    answers: bool = True,
) -> dict[str, float]:
    """`answers=False` for searcher-only loops (s3), whose accuracy is a reward component instead;
    it depends on the recipe only, so every rank logs the same keys."""
    metrics: dict[str, float] = {
        "reward/mean": _mean(scores),
        "reward/std": float(np.std(scores)) if scores else 0.0,
        "reward/mean_before_filter": _mean(all_rewards),
        "retrieval_count": _mean([t.retrieval_count for t in trajs]),
        "turns": _mean([t.num_turns for t in trajs]),
        "response_length/policy_tokens": _mean([t.num_policy_tokens for t in trajs]),
        "response_length/total_tokens": _mean([len(t.response_ids) for t in trajs]),
        "answered": _mean([float(t.answer is not None) for t in trajs]),
    }
    components = sorted({k for t in trajs for k in t.rewards if k != "total"})
    for k in components:
        metrics[f"reward/{k}"] = _mean([t.rewards.get(k, 0.0) for t in trajs])
    from sleuth.rewards.metrics import exact_match

    if answers:
        metrics["accuracy/em"] = _mean([exact_match(t.answer or "", t.golden_answers) for t in trajs])
    if kl is not None:
        metrics["actor/kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
    elif (
        "actor/kl_loss" in stats
    ):  # on-policy steps skip the old-log-prob pass; the KL loss term is the estimate
        metrics["actor/kl"] = _mean(stats["actor/kl_loss"])
    for k, v in stats.items():
        metrics[k] = _mean(v)
    return {k: (0.0 if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


def _format_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [
        f"[bold]step {step}/{total}[/]",
        f"reward {m['reward/mean']:+.3f}",
        *([f"em {m['accuracy/em']:.3f}"] if "accuracy/em" in m else []),
        f"rc {m['retrieval_count']:.2f}",
        f"len {m['response_length/policy_tokens']:.0f}",
    ]
    if "actor/kl" in m:
        parts.append(f"kl {m['actor/kl']:.4f}")
    if "actor/entropy" in m:
        parts.append(f"ent {m['actor/entropy']:.3f}")
    if m.get("actor/skipped_nonfinite_grad"):
        parts.append(f"[yellow]skipped {m['actor/skipped_nonfinite_grad']:.0%} of updates (non-finite grad)[/]")
    parts.append(
        f"t {m['time/rollout']:.1f}/{m['time/reward']:.1f}/{m['time/update']:.1f}s (rollout/reward/update)"
    )
    return "  ".join(parts)
