"""The models a run trains or consults: policy (optionally LoRA), frozen reference, critic, rollout copy."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sleuth.errors import ConfigError
from sleuth.llm.decode_engine import supports as engine_supports
from sleuth.llm.registry import resolve_model_path
from sleuth.llm.special_tokens import peft_deprecation_silenced
from sleuth.rl.config import Recipe
from sleuth.rl.dist import unwrap
from sleuth.rl.memory_plan import apply_checkpointing


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
    # deferred: transformers takes seconds to import; needed only once a model loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(recipe.model.policy)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # dtype "bfloat16" with LoRA gives a bf16 frozen base (half the memory, and one dtype in a static
    # KV cache) while peft keeps the trained adapters in fp32.
    dtype = master_dtype(recipe, device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    apply_checkpointing(recipe, model, device)  # off, selective or full; "auto" from the free memory
    if recipe.model.lora.enabled:
        # deferred: heavy, and only LoRA models need it
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter_dir is not None:
            with peft_deprecation_silenced():
                model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
            # the adapter names the base as found where it was trained (another machine's path); name the
            # base loaded here, so the next save records it and peft finds its config
            model.peft_config["default"].base_model_name_or_path = str(path)
        else:
            lora = recipe.model.lora
            with peft_deprecation_silenced():
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
        apply_checkpointing(recipe, model, device)  # the reloaded weights are a new module
    return tokenizer, model, path


def master_dtype(recipe: Recipe, device: torch.device | None = None) -> torch.dtype:
    """Dtype of the loaded weights. "auto": fp32 masters for full fine-tuning (bf16 comes from autocast on
    GPU); under LoRA on CUDA a bf16 frozen base, as PEFT users load it (the adapters stay fp32), which also
    lets rollouts decode with a compiled static cache."""
    if (
        recipe.model.dtype == "auto"
        and device is not None
        and device.type == "cuda"
        and recipe.model.lora.enabled
    ):
        return torch.bfloat16
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

    # Each parameter goes straight to a bf16 clone through deepcopy's memo (no transient fp32 copy of
    # the model; tied weights stay tied). Buffers such as RoPE's inv_freq stay fp32.
    memo: dict[int, Any] = {
        id(p): nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False) for p in model.parameters()
    }
    return copy.deepcopy(model, memo).eval()


def rollout_decoding(
    recipe: Recipe, generator_model: nn.Module, device: torch.device
) -> tuple[str, bool, str]:
    """(cache, compile, why) for rollout decoding. Default ("auto"): on CUDA sleuth's decode engine where it
    supports the model (unless compile_generation is false), else a static KV cache with a compiled decode
    step when the rollout weights are bf16/fp16 and not FSDP-sharded; else HF's dynamic cache. Explicit recipe values win; fp32 weights cannot fill a static
    cache under autocast (fp32 keys after RoPE, bf16 values), so that combination fails here with the fix."""
    cache, compiled = recipe.model.generation_cache, recipe.model.compile_generation
    low_precision = next(generator_model.parameters()).dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda" and cache == "static" and not low_precision:
        raise ConfigError(
            "model.generation_cache=static on GPU needs bf16 rollout weights: with LoRA set model.dtype=bfloat16 "
            "(a bf16 frozen base; the adapters stay fp32), with FSDP use generation_cache=dynamic"
        )
    if cache == "engine" and (unsupported := engine_supports(generator_model)) is not None:
        raise ConfigError(
            f"model.generation_cache=engine: {unsupported}; use generation_cache=static or dynamic"
        )
    if cache == "auto":
        if device.type != "cuda":
            cache, why = "dynamic", "CPU"
        elif compiled is not False and engine_supports(generator_model) is None:
            cache, why = "engine", "CUDA: sleuth's decode engine (bf16 copy, ragged KV, CUDA graphs)"
        elif recipe.model.parallel == "fsdp":
            cache, why = "dynamic", "FSDP-sharded weights"
        elif not low_precision:
            cache, why = "dynamic", "fp32 rollout weights (set model.dtype=bfloat16)"
        elif compiled is False:
            cache, why = "dynamic", "model.compile_generation=false (a static cache pays only when compiled)"
        else:
            cache, why = "static", "CUDA with bf16 rollout weights"
    else:
        why = f"model.generation_cache={cache}"
    if compiled is None or cache == "engine":
        compiled = cache == "static" and device.type == "cuda"
    return cache, compiled, why


@torch.no_grad()
def sync_rollout_copy(rollout: nn.Module, policy: nn.Module) -> None:
    for dst, src in zip(rollout.parameters(), unwrap(policy).parameters(), strict=True):
        dst.copy_(src)


def release_rollout_memory(run: Any) -> None:
    """Before the update: the decode engine frees its KV pool and graphs (captured again at the next rollout)."""
    if hasattr(run.generator, "release"):
        run.generator.release()


def sync_rollout_weights(run: Any) -> None:
    """After the policy's weights changed (an update, a rollback): refresh what rollouts decode with, the bf16
    copy or the decode engine's copy (a collective under FSDP: every rank calls it)."""
    if run.rollout_model is not None:
        sync_rollout_copy(run.rollout_model, run.policy)
    if hasattr(run.generator, "refresh_weights"):
        run.generator.refresh_weights()


def load_reference(model_path: str, policy: nn.Module, device: torch.device) -> nn.Module:
    # deferred: transformers takes seconds to import; needed only once a model loads
    from transformers import AutoModelForCausalLM

    dtype = next(policy.parameters()).dtype
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    return ref.eval().requires_grad_(False)


def load_critic(model_path: str, device: torch.device, dtype: torch.dtype) -> ValueModel:
    # deferred: transformers takes seconds to import; needed only once a model loads
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


def dtype_of(model: nn.Module) -> torch.dtype:
    return next(unwrap(model).parameters()).dtype
