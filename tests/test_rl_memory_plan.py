"""Issue 43 item 4: activation checkpointing chosen from the free memory and the token budget, and applied to
the chosen decoder layers without changing the gradients."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sleuth.rl import memory_plan
from sleuth.rl.config import recipe_from_dict

# a Qwen2.5-3B-shaped layer: h 2048, 16 heads of 128, 2 KV heads, MLP 11008, 36 layers
QWEN3B = SimpleNamespace(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=11008,
    num_hidden_layers=36,
)


def _recipe(**overrides):
    model = {"policy": "tiny", **overrides.pop("model", {})}
    return recipe_from_dict(
        {
            "name": "t",
            "model": model,
            "data": {"train": "x.jsonl"},
            "retriever": {"index": "idx"},
            "agent": {"loop": "search_r1"},
            "reward": {"name": "search_r1_em"},
            **overrides,
        }
    )


def test_per_token_activations_by_hand() -> None:
    full, kept = memory_plan.activation_bytes_per_token(QWEN3B, dtype_bytes=2)
    assert full == (8 * 2048 + 2 * 256 + 4 * 11008) * 2 and kept == 2048 * 2
    # kernels that store attention probabilities (the CPU's) add 2 x heads x row length values a token
    assert memory_plan.activation_bytes_per_token(QWEN3B, 2, score_len=1000)[0] == full + 2 * 16 * 1000 * 2


@pytest.mark.parametrize(
    ("free_gib", "mode", "layers"), [(200.0, "off", 0), (40.0, "selective", 27), (2.0, "full", 36)]
)
def test_checkpointing_follows_the_free_memory(free_gib: float, mode: str, layers: int) -> None:
    # by hand: 1.86 GiB a layer for 16k tokens without checkpointing, 0.0625 with; 36 layers = 66.9 GiB;
    # at 40 GiB free (20 for activations) 66.9 - 1.80 k <= 20 needs k = 27 checkpointed layers
    tokens = 16_384
    plan = memory_plan.choose_checkpointing(QWEN3B, tokens, free_gib * 2**30, dtype_bytes=2)
    assert (plan.mode, plan.layers) == (mode, layers)
    full, kept = memory_plan.activation_bytes_per_token(QWEN3B, 2)
    budget = memory_plan.ACTIVATION_SHARE * free_gib * 2**30
    fits = [k for k in range(37) if tokens * ((36 - k) * full + k * kept) <= budget]
    # the fewest checkpointed layers that fit (all of them when nothing fits)
    assert plan.layers == (min(fits) if fits else 36)


def test_more_tokens_need_more_checkpointing() -> None:
    free = 60 * 2**30
    layers = [
        memory_plan.choose_checkpointing(QWEN3B, t, free, 2).layers for t in (2_048, 8_192, 32_768, 131_072)
    ]
    assert layers == sorted(layers) and layers[0] == 0 and layers[-1] == 36


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory):
    from sleuth.llm.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _grads(path, setting, monkeypatch=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    plan = memory_plan.apply_checkpointing(
        _recipe(model={"gradient_checkpointing": setting}), model, torch.device("cpu")
    )
    model.train()
    ids = torch.arange(3, 40).reshape(1, -1)
    model(input_ids=ids, labels=ids).loss.backward()
    flags = [layer.gradient_checkpointing for layer in memory_plan._decoder_layers(model)]
    return plan, flags, {n: p.grad for n, p in model.named_parameters()}


def test_selective_and_full_checkpointing_keep_the_gradients(tiny_path) -> None:
    off, off_flags, reference = _grads(tiny_path, False)
    assert off.mode == "off" and not any(off_flags)
    for setting, mode in (("selective", "selective"), (True, "full")):
        plan, flags, grads = _grads(tiny_path, setting)
        assert plan.mode == mode and sum(flags) == plan.layers > 0
        assert plan.layers == (len(flags) if mode == "full" else len(flags) // 2)
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], rtol=1e-10, atol=1e-12, msg=name)


def test_auto_reads_the_free_memory(tiny_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 1e12)
    assert _grads(tiny_path, "auto")[0].mode == "off"
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 0.0)
    plan, flags, _ = _grads(tiny_path, "auto")
    assert plan.mode == "full" and all(flags) and plan.free_gib == 0.0


def test_update_plan_is_in_the_metrics(tiny_path) -> None:
    from transformers import AutoModelForCausalLM

    from sleuth.rl.batch import ForwardPlan

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float64)
    memory_plan.apply_checkpointing(
        _recipe(model={"gradient_checkpointing": "selective"}), model, torch.device("cpu")
    )
    metrics = memory_plan.update_plan_metrics(model, ForwardPlan(4, 4096, packed=True))
    assert metrics == {
        "memory/checkpointed_layers": 0.5,
        "update/packed": 1.0,
        "update/micro_batch_tokens": 4096.0,
    }
