"""Does a checkpoint fit the recipe? Checked before `--resume` or `model.init_from` loads it.

Resuming continues one run, so what the run *is* must not change: the loop (`agent.loop`), the reward
(`reward.name`), the algorithm and its critic (`algorithm.name`, `algorithm.advantage`), LoRA vs full
fine-tuning (`model.lora.enabled`), the base model (`model.policy`) and its vocabulary. What may change is
logged: the data (`data.train`, `data.dev`), the learning rate (`optim.lr`) and the length (`trainer.total_steps`).

`model.init_from` starts a new run from a checkpoint's weights, so its loop, reward and algorithm may differ
(QAgent's stage 2 changes the reward; an SFT checkpoint has no algorithm) and are logged; the weights must
still fit: LoRA vs full, base model, vocabulary.

Each checkpoint records the recipe fields it was trained with (`fingerprint` in trainer_state.json); for an
older one, LoRA and the critic are read from its files and the loop and base model from searcher.json.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError
from sleuth.llm.registry import resolve_model_path
from sleuth.rl.config import Recipe
from sleuth.run_layout import CRITIC, POLICY_DIR, TRAINER_STATE, SearcherInfo

FINGERPRINT = "fingerprint"
ALLOWED_ON_RESUME = ("data.train", "data.dev", "optim.lr", "trainer.total_steps")


def recipe_fingerprint(recipe: Recipe, algorithm: str | None = None) -> dict[str, Any]:
    """The recipe fields a checkpoint records (`algorithm`: "sft" for an SFT checkpoint)."""
    algo = recipe.algorithm
    return {
        "agent.loop": recipe.agent.loop,
        "reward.name": recipe.reward.name,
        "algorithm.name": algorithm or algo.name,
        "algorithm.advantage": None if algorithm else algo.advantage,
        "critic": False if algorithm else algo.uses_critic,
        "model.lora.enabled": recipe.model.lora.enabled,
        "model.policy": recipe.model.policy,
        **{key: _field(recipe, key) for key in ALLOWED_ON_RESUME},
    }


def _field(recipe: Recipe, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(recipe, section), name)


def checkpoint_facts(ckpt: Path) -> dict[str, Any]:
    """What a checkpoint was trained with: its fingerprint, else what its files and searcher.json say.
    LoRA and the critic always come from the files (what will actually be loaded)."""
    facts: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, AttributeError):  # damaged: resume skips it anyway
        facts.update(json.loads((ckpt / TRAINER_STATE).read_text(encoding="utf-8")).get(FINGERPRINT) or {})
    if "agent.loop" not in facts or "model.policy" not in facts:
        try:
            info = SearcherInfo.read(ckpt)
            facts.setdefault("agent.loop", info.loop)
            facts.setdefault("model.policy", info.base_model)
        except Exception:  # noqa: BLE001 - no searcher.json: nothing more to learn
            pass
    facts["model.lora.enabled"] = (ckpt / POLICY_DIR / "adapter_config.json").is_file()
    if (ckpt / TRAINER_STATE).is_file() and facts.get("algorithm.name") != "sft":
        facts["critic"] = (ckpt / CRITIC).is_file()
    return facts


def _same_model(a: str | None, b: str | None) -> bool:
    """The same base model, also when named by a hub id on one machine and a local copy on another."""
    if a is None or b is None or a == b:
        return True
    return Path(str(a).rstrip("/")).name == Path(str(b).rstrip("/")).name


def _vocab_sizes(recipe: Recipe, ckpt: Path) -> tuple[int, int] | None:
    """(checkpoint's, recipe base model's) tokenizer sizes, or None if either cannot be read."""
    # deferred: transformers takes seconds to import; needed only once a model loads
    from transformers import AutoTokenizer

    try:
        saved = len(AutoTokenizer.from_pretrained(ckpt / POLICY_DIR))
        base = len(AutoTokenizer.from_pretrained(resolve_model_path(recipe.model.policy)))
    except (OSError, ValueError):
        return None
    return saved, base


def _weights_mismatch(recipe: Recipe, ckpt: Path, facts: dict[str, Any], how: str) -> str | None:
    """LoRA vs full, base model, vocabulary: what every load of a checkpoint's weights needs."""
    lora = recipe.model.lora.enabled
    if facts["model.lora.enabled"] != lora:
        if facts["model.lora.enabled"]:
            return (f"model.lora.enabled differs: {ckpt} holds LoRA adapters, the recipe fine-tunes fully; pass "
                    f"model.lora.enabled=true, or `sleuth export` it (merged) and pass model.policy=EXPORT_DIR")
        instead = ("pass model.lora.enabled=false" if how == "--resume" else
                   f"pass model.lora.enabled=false, or model.policy={ckpt / POLICY_DIR} without model.init_from "
                   "to put new adapters on its weights")
        return f"model.lora.enabled differs: {ckpt} holds fully fine-tuned weights, the recipe trains LoRA; {instead}"
    trained_on = facts.get("model.policy")
    if not _same_model(trained_on, recipe.model.policy):
        return (f"model.policy differs: {ckpt} was trained on {trained_on!r}, the recipe loads "
                f"{recipe.model.policy!r}; pass model.policy={trained_on}")
    sizes = _vocab_sizes(recipe, ckpt)
    if sizes is not None and sizes[0] != sizes[1]:
        return (f"vocabulary differs: {ckpt}'s tokenizer has {sizes[0]} tokens, model.policy={recipe.model.policy} "
                f"has {sizes[1]}; pass the model.policy it was trained on")
    return None


def check_resume(recipe: Recipe, ckpt: Path, console: Any = None) -> None:
    """Refuse to resume `ckpt` under a recipe that is another run; log the allowed changes."""
    facts = checkpoint_facts(ckpt)
    run_fields = (("agent.loop", recipe.agent.loop), ("reward.name", recipe.reward.name),
                  ("algorithm.name", recipe.algorithm.name), ("algorithm.advantage", recipe.algorithm.advantage))
    for key, wanted in run_fields:
        if key in facts and facts[key] is not None and facts[key] != wanted:
            raise ConfigError(
                f"--resume: {key} differs: {ckpt} was trained with {key}={facts[key]}, the recipe asks {wanted}; "
                f"pass {key}={facts[key]} to resume it, or start a new run (another trainer.out_dir) with "
                f"model.init_from={ckpt}"
            )
    if "critic" in facts and facts["critic"] != recipe.algorithm.uses_critic:
        has = "has a critic" if facts["critic"] else "has no critic"
        raise ConfigError(
            f"--resume: critic differs: {ckpt} {has}, algorithm.advantage={recipe.algorithm.advantage} "
            f"{'needs' if recipe.algorithm.uses_critic else 'has'} {'one' if recipe.algorithm.uses_critic else 'none'}; "
            f"pass the algorithm it was trained with, or start a new run with model.init_from={ckpt}"
        )
    problem = _weights_mismatch(recipe, ckpt, facts, "--resume")
    if problem is not None:
        raise ConfigError(f"--resume: {problem}")
    for key in ALLOWED_ON_RESUME:
        if key in facts and facts[key] != _field(recipe, key) and console is not None:
            console.print(f"resume changes {key}: {facts[key]} -> {_field(recipe, key)} (allowed)")


def check_init_from(recipe: Recipe, ckpt: Path, console: Any = None) -> None:
    """Refuse `model.init_from` weights that cannot load into the recipe's model; log a changed loop,
    reward or algorithm (allowed: a new run starts from these weights)."""
    facts = checkpoint_facts(ckpt)
    problem = _weights_mismatch(recipe, ckpt, facts, "model.init_from")
    if problem is not None:
        raise ConfigError(f"model.init_from: {problem}")
    for key, wanted in (("agent.loop", recipe.agent.loop), ("reward.name", recipe.reward.name),
                        ("algorithm.name", recipe.algorithm.name)):
        if facts.get(key) is not None and facts[key] != wanted and console is not None:
            console.print(f"model.init_from: {ckpt} was trained with {key}={facts[key]}; this run uses {wanted}")
