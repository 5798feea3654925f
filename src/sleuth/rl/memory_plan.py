"""Activation checkpointing (off, selective or full) chosen from the measured free memory and the update's token
budget (the micro-batches themselves: `sleuth.rl.batch.forward_plan`).

Activations a decoder layer keeps for its backward, per token, without checkpointing (a Llama/Qwen-style
layer with SwiGLU and a fused attention kernel that stores no score matrix): the normed inputs of attention and
MLP, q/k/v, the attention output, the residuals, and the MLP's gate, up, activation and product, about
`8 h + 2 kv + 4 I` values (h hidden, kv the key/value width, I the MLP width). Under checkpointing a layer keeps
only its input (h values) and recomputes the rest in the backward (about a third more compute for that layer).
Attention kernels that store their probabilities (the CPU's) keep 2 x heads x row length values a token more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from sleuth.rl.config import Recipe

CheckpointMode = Literal["off", "selective", "full"]

# the share of the free memory the activations may take: the rest is for the logits chunk, the gradients'
# temporaries, the allocator's fragmentation and (full fine-tuning) the optimizer states created after loading
ACTIVATION_SHARE = 0.5
# a trajectory's prompt when the token budget is counted in rows: the recipe bounds only the response
PROMPT_TOKENS_GUESS = 1024


@dataclass(frozen=True)
class CheckpointPlan:
    mode: CheckpointMode
    layers: int  # decoder layers checkpointed
    total_layers: int
    activation_gib: float  # the estimate for one micro-batch under this plan
    free_gib: float | None  # what the choice was made from (None: the recipe chose)

    @property
    def fraction(self) -> float:
        return self.layers / max(self.total_layers, 1)


def activation_bytes_per_token(config: Any, dtype_bytes: int, score_len: int = 0) -> tuple[int, int]:
    """(bytes one layer keeps per token without checkpointing, with it): see the module's docstring.
    `score_len`: the row length when attention stores its probabilities (the CPU's kernels: 2 x heads x row length
    values a token, which the measurement in docs/scaling.md needed), 0 under a fused GPU kernel."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(config, "intermediate_size", 4 * h)
    return (8 * h + 2 * kv + 4 * inter + 2 * heads * score_len) * dtype_bytes, h * dtype_bytes


def choose_checkpointing(
    config: Any, tokens: int, free_bytes: float, dtype_bytes: int, score_len: int = 0
) -> CheckpointPlan:
    """Off when every layer's activations for `tokens` fit ACTIVATION_SHARE of the free memory; else the
    fewest layers checkpointed that make them fit (selective); all of them when even that does not (full)."""
    layers = config.num_hidden_layers
    full, kept = activation_bytes_per_token(config, dtype_bytes, score_len)
    budget = ACTIVATION_SHARE * free_bytes
    for k in range(layers + 1):
        need = tokens * ((layers - k) * full + k * kept)
        if need <= budget:
            mode: CheckpointMode = "off" if k == 0 else "full" if k == layers else "selective"
            return CheckpointPlan(mode, k, layers, need / 2**30, free_bytes / 2**30)
    return CheckpointPlan("full", layers, layers, tokens * layers * kept / 2**30, free_bytes / 2**30)


def free_memory(device: torch.device) -> float:
    """Bytes free now: the GPU's free memory (other processes' use counted), else the host's available RAM
    (Linux's MemAvailable, which counts reclaimable page cache; elsewhere the free pages)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def row_tokens(recipe: Recipe) -> int:
    """The longest row the update is planned for: a prompt guess + the response limit."""
    return PROMPT_TOKENS_GUESS + recipe.agent.max_response_tokens


def micro_batch_tokens(recipe: Recipe) -> int:
    """The most tokens one micro-batch's forward holds: the token budget, else rows x (a prompt guess + the
    response limit)."""
    algo = recipe.algorithm
    if algo.micro_batch_tokens is not None:
        return algo.micro_batch_tokens
    return algo.micro_batch_size * row_tokens(recipe)


def apply_checkpointing(recipe: Recipe, model: nn.Module, device: torch.device) -> CheckpointPlan:
    """Resolve `model.gradient_checkpointing` (True = full, False = off, or off/selective/full/auto) on a
    loaded transformers model and switch it on for the chosen layers, spread evenly over the depth."""
    setting = recipe.model.gradient_checkpointing
    config = model.config
    dtype_bytes = 2 if device.type == "cuda" else next(model.parameters()).element_size()
    layers = config.num_hidden_layers
    tokens = micro_batch_tokens(recipe)
    score_len = 0 if device.type == "cuda" else min(tokens, row_tokens(recipe))
    if setting == "auto":
        # full fine-tuning adds Adam's two fp32 moments (and fp32 gradients) after this measurement
        trainable = 0 if recipe.model.lora.enabled else sum(p.numel() for p in model.parameters())
        free = max(free_memory(device) - 12 * trainable, 0.0)
        plan = choose_checkpointing(config, tokens, free, dtype_bytes, score_len)
    else:
        mode: CheckpointMode = {True: "full", False: "off"}.get(setting, setting)  # type: ignore[arg-type]
        k = {"off": 0, "full": layers}.get(mode, layers // 2)
        full, kept = activation_bytes_per_token(config, dtype_bytes, score_len)
        need = tokens * ((layers - k) * full + k * kept) / 2**30
        plan = CheckpointPlan(mode, k, layers, need, None)
    model.checkpoint_plan = plan  # read back for the run's metrics (`checkpoint_plan_of`)
    if plan.layers:
        # transformers 5 renamed it (the old name warns); older versions have only the old one
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.config.use_cache = False
        chosen = {round(i * layers / plan.layers) for i in range(plan.layers)}
        for index, layer in enumerate(_decoder_layers(model)):
            layer.gradient_checkpointing = index in chosen
    return plan


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    # deferred: transformers takes seconds to import
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_plan_of(model: nn.Module) -> CheckpointPlan | None:
    """The plan `apply_checkpointing` recorded on the transformers model inside any wrapper (DDP, peft)."""
    for module in model.modules():
        plan = getattr(module, "checkpoint_plan", None)
        if isinstance(plan, CheckpointPlan):
            return plan
    return None


def update_plan_metrics(policy: nn.Module, plan: Any) -> dict[str, float]:
    """How the update ran, for the step's metrics: the share of decoder layers checkpointed, packed or padded,
    the token budget per micro-batch (0: rows only)."""
    checkpoint = checkpoint_plan_of(policy)
    return {
        "memory/checkpointed_layers": checkpoint.fraction if checkpoint is not None else 0.0,
        "update/packed": float(plan.packed),
        "update/micro_batch_tokens": float(plan.max_tokens or 0),
    }
