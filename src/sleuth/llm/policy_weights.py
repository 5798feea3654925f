"""Reading a policy's weights for sleuth's decode engine: which models it decodes, and each linear layer's
weight as the policy computes it (FSDP2 shards gathered, active LoRA adapters merged)."""

from __future__ import annotations

import torch

from sleuth.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP2 shard (DTensor), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    seen = model
    for _ in range(4):
        if hasattr(seen, "get_base_model"):
            seen = seen.get_base_model()
        elif hasattr(seen, "module") and isinstance(seen.module, torch.nn.Module):  # DDP
            seen = seen.module
        else:
            break
    return seen


def supports(model: torch.nn.Module) -> str | None:
    """None when the engine can decode this model, else why not (one line)."""
    base = base_model(model)
    config = getattr(base, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model type {kind!r} (the decode engine supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the decode engine supports silu)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no decoder layers / rotary embedding found"
    return None


def linear_weight(
    module: torch.nn.Module, merge_adapters: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a Linear, with active LoRA adapters merged in (W + scale * B @ A)."""
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        base = module.base_layer
        weight = full_tensor(base.weight.detach()).float()
        if (
            merge_adapters
            and not getattr(module, "disable_adapters", False)
            and not getattr(module, "merged", False)
        ):
            if getattr(module, "fan_in_fan_out", False) or any(getattr(module, "use_dora", {}).values()):
                raise ConfigError("the decode engine merges plain LoRA only (no DoRA, no fan_in_fan_out)")
            for name in module.active_adapters:
                if name in module.lora_A:
                    a = full_tensor(module.lora_A[name].weight.detach()).float()
                    b = full_tensor(module.lora_B[name].weight.detach()).float()
                    weight = weight + (b @ a) * float(module.scaling[name])
        bias = base.bias
    else:
        weight, bias = full_tensor(module.weight.detach()), module.bias
    return weight, (full_tensor(bias.detach()) if bias is not None else None)
