"""Does a checkpoint fit the recipe? Checked before `--resume` or `model.init_from` loads it.

Resume semantics live here, in one table (`RESUME_RULES`, docs/compatibility.md "Resume"): every recipe field
is either

- **refused**: resuming continues one run, so what the run *is* must not change: the loop (`agent.loop`),
  the reward (`reward.name`), the algorithm and its critic (`algorithm.name`, `algorithm.advantage`), LoRA vs
  full fine-tuning (`model.lora.enabled`), the base model (`model.policy`) and its vocabulary, and `seed`
  (the data order and random streams continue the checkpoint's); one line names the field and the value to pass;
- **applied**: printed as "resume changes X: a -> b" and in effect from the first resumed step (the optimizers'
  param groups and the scheduler are set from the recipe after their states load: `setup.apply_optim_recipe`;
  the KL coefficient: `resumed_kl_coef`; sampling, rewards, loop, guards are built from the recipe);
- **fixed by the checkpoint**: the LoRA shape (the adapters load from it), `model.init_from` and `sft`
  (the checkpoint's weights are where the run is); a change is printed as not used.

`model.init_from` starts a new run from a checkpoint's weights, so its loop, reward and algorithm may differ
(QAgent's stage 2 changes the reward; an SFT checkpoint has no algorithm) and are logged; the weights must
still fit: LoRA vs full, base model, vocabulary.

Each checkpoint records every recipe field it was trained with (`fingerprint` in trainer_state.json; since
issue 48, `complete`); an older one recorded a few (then only those are compared), and for one older still,
LoRA and the critic are read from its files and the loop and base model from searcher.json.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from rich.markup import escape

from sleuth.errors import ConfigError
from sleuth.llm.registry import resolve_model_path
from sleuth.rl.config import Recipe
from sleuth.run_layout import CRITIC, POLICY_DIR, TRAINER_STATE, SearcherInfo

FINGERPRINT = "fingerprint"
COMPLETE = "complete"  # a fingerprint holding every recipe field (issue 48); older ones hold a few
GUARDS = "trainer.guards"


@dataclass(frozen=True)
class ResumeRule:
    """What `--resume` does with a recipe field the checkpoint was trained with another value of."""

    kind: Literal["refused", "applied", "fixed"]
    why: str


def _refused(why: str) -> ResumeRule:
    return ResumeRule("refused", why)


def _applied(why: str) -> ResumeRule:
    return ResumeRule("applied", why)


def _fixed(why: str) -> ResumeRule:
    return ResumeRule("fixed", why)


# Every recipe field takes the rule of its longest entry here: the field itself or a section above it
# (`model.lora.enabled` before `model.lora` before `model`). tests/test_resume_semantics.py checks every field of
# the schema has one and that docs/compatibility.md lists them all, so a new field needs a decision here.
RESUME_RULES: dict[str, ResumeRule] = {
    "name": _applied("names the loggers' run and the new checkpoints"),
    "description": _applied("text only"),
    "seed": _refused("the data order and the random streams continue the checkpoint's"),
    "plugins": _applied("imported before the recipe is read"),
    "model": _applied("dtype, device, parallelism and decoding: the checkpoint's weights load under them"),
    "model.policy": _refused("the checkpoint's weights belong to its base model (and its vocabulary)"),
    "model.lora": _fixed("the adapters (rank, alpha, dropout, target modules) load from the checkpoint"),
    "model.lora.enabled": _refused("the checkpoint holds adapters or full weights, not both"),
    "model.init_from": _fixed("the policy continues from the checkpoint's weights"),
    "data": _applied("the questions trained and validated on; the cursor's epoch and position carry over"),
    "retriever": _applied("built from the recipe"),
    "agent": _applied("turns, top-k, options and token budgets: the loop is built from the recipe"),
    "agent.loop": _refused("another loop is another run"),
    "reward": _applied("options and frozen models: the reward is built from the recipe"),
    "reward.name": _refused("another reward is another run"),
    "algorithm": _applied("read at every step"),
    "algorithm.name": _refused("another algorithm is another run"),
    "algorithm.advantage": _refused("another estimator (and critic or not) is another run"),
    "algorithm.kl.coef": _applied(
        "fixed: the new value; adaptive: restarts from it (unchanged, the adapted value carries over)"
    ),
    "optim": _applied(
        "set in the resumed optimizers' param groups and the scheduler's base rates; a new "
        "warm-up is read at the step reached"
    ),
    "sampling": _applied("the rollouts' sampling parameters are built from the recipe"),
    "trainer": _applied("steps, checkpoints, loggers, validation, time limit: read from the recipe"),
    GUARDS: _applied("the guards are built from the recipe; their history is rebuilt from the run directory"),
    "sft": _fixed("the SFT warm-up ran before the checkpoint's RL steps"),
    "services": _applied("retry policy of the retriever and reward models"),
}


def resume_rule(field: str) -> ResumeRule | None:
    """The rule of a dotted recipe field (None: not a recipe field, e.g. the recorded `critic`)."""
    parts = field.split(".")
    for n in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return None


def recipe_fields(recipe: Recipe) -> dict[str, Any]:
    """Every leaf field of the recipe under its dotted name, as JSON values; a guard is one value under
    `trainer.guards.<name>` (guards are matched by name, not by position)."""
    dumped = recipe.model_dump(mode="json")
    guards = dumped["trainer"].pop("guards")
    out = _flatten(dumped, "")
    out.update({f"{GUARDS}.{g['name']}": g for g in guards})
    return out


def _flatten(node: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        # an empty mapping (no reward options) adds no field, so a first option shows as "(unset) -> value"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def schema_fields(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every field path the recipe schema declares (sections descended; open mappings like
    `agent.options` are one path)."""
    out = []
    for name, info in model.model_fields.items():
        inner = info.annotation
        candidates = [inner, *getattr(inner, "__args__", ())]
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        out += schema_fields(section, f"{prefix}{name}.") if section is not None else [f"{prefix}{name}"]
    return out


def recipe_fingerprint(recipe: Recipe, algorithm: str | None = None) -> dict[str, Any]:
    """The recipe fields a checkpoint records (`algorithm`: "sft" for an SFT checkpoint)."""
    algo = recipe.algorithm
    return {
        **recipe_fields(recipe),
        "algorithm.name": algorithm or algo.name,
        "algorithm.advantage": None if algorithm else algo.advantage,
        "critic": False if algorithm else algo.uses_critic,
        COMPLETE: True,
    }


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
            return (
                f"model.lora.enabled differs: {ckpt} holds LoRA adapters, the recipe fine-tunes fully; pass "
                f"model.lora.enabled=true, or `sleuth export` it (merged) and pass model.policy=EXPORT_DIR"
            )
        instead = (
            "pass model.lora.enabled=false"
            if how == "--resume"
            else f"pass model.lora.enabled=false, or model.policy={ckpt / POLICY_DIR} without model.init_from "
            "to put new adapters on its weights"
        )
        return f"model.lora.enabled differs: {ckpt} holds fully fine-tuned weights, the recipe trains LoRA; {instead}"
    trained_on = facts.get("model.policy")
    if not _same_model(trained_on, recipe.model.policy):
        return (
            f"model.policy differs: {ckpt} was trained on {trained_on!r}, the recipe loads "
            f"{recipe.model.policy!r}; pass model.policy={trained_on}"
        )
    sizes = _vocab_sizes(recipe, ckpt)
    if sizes is not None and sizes[0] != sizes[1]:
        return (
            f"vocabulary differs: {ckpt}'s tokenizer has {sizes[0]} tokens, model.policy={recipe.model.policy} "
            f"has {sizes[1]}; pass the model.policy it was trained on"
        )
    return None


def check_resume(recipe: Recipe, ckpt: Path, console: Any = None) -> None:
    """Refuse to resume `ckpt` under a recipe that is another run (`RESUME_RULES`' refused fields, one line
    naming the field and the value to pass); print every other change, applied or fixed by the checkpoint."""
    facts = checkpoint_facts(ckpt)
    wanted = recipe_fields(recipe)
    # the weights' fields (LoRA vs full, base model, vocabulary) are compared below, also for old checkpoints
    checked_by_weights = ("model.policy", "model.lora.enabled")
    for key, rule in RESUME_RULES.items():
        if rule.kind != "refused" or key in checked_by_weights or facts.get(key) is None:
            continue
        if facts[key] != wanted[key]:
            raise ConfigError(
                f"--resume: {key} differs: {ckpt} was trained with {key}={facts[key]}, the recipe asks {wanted[key]} "
                f"({rule.why}); pass {key}={facts[key]} to resume it, or start a new run (another trainer.out_dir) "
                f"with model.init_from={ckpt}"
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
    if console is not None:
        for line in resume_changes(facts, wanted):
            console.print(escape(line))


def resume_changes(facts: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """One line per recipe field the checkpoint was trained with another value of. A complete fingerprint
    also names fields added or removed (a guard, a reward option); an older one only the fields it holds."""
    keys = sorted(set(facts) | set(wanted)) if facts.get(COMPLETE) else sorted(set(facts) & set(wanted))
    lines = []
    for key in keys:
        rule = resume_rule(key)
        old, new = facts.get(key), wanted.get(key)
        if rule is None or rule.kind == "refused" or old == new:
            continue
        if rule.kind == "applied":
            lines.append(f"resume changes {key}: {_shown(old, new)}")
        else:
            lines.append(
                f"resume keeps {key}={_value(old)} from the checkpoint; the recipe's {_value(new)} "
                f"is not used ({rule.why})"
            )
    return lines


def _value(value: Any) -> str:
    return "(unset)" if value is None else str(value)


def _shown(old: Any, new: Any) -> str:
    """`a -> b`; for two guards (mappings), only the fields that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
        return ", ".join(f"{k} {_value(old.get(k))} -> {_value(new.get(k))}" for k in keys)
    return f"{_value(old)} -> {_value(new)}"


def resumed_kl_coef(recipe: Recipe, trainer_state: dict[str, Any]) -> float:
    """The KL coefficient of the first resumed step. Only an adaptive controller's adapted value carries over,
    and only while the recipe asks the same controller from the same start; otherwise the recipe's coefficient
    (on main a fixed coefficient changed on resume kept the checkpoint's)."""
    kl = recipe.algorithm.kl
    saved = trainer_state.get("kl_coef")
    facts = trainer_state.get(FINGERPRINT) or {}
    if saved is None or kl.type != "adaptive":
        return kl.coef
    # an older fingerprint has no KL fields: the adapted value carries over, as it did
    if (
        facts.get("algorithm.kl.type", "adaptive") != "adaptive"
        or facts.get("algorithm.kl.coef", kl.coef) != kl.coef
    ):
        return kl.coef
    return float(saved)


def check_init_from(recipe: Recipe, ckpt: Path, console: Any = None) -> None:
    """Refuse `model.init_from` weights that cannot load into the recipe's model; log a changed loop,
    reward or algorithm (allowed: a new run starts from these weights)."""
    facts = checkpoint_facts(ckpt)
    problem = _weights_mismatch(recipe, ckpt, facts, "model.init_from")
    if problem is not None:
        raise ConfigError(f"model.init_from: {problem}")
    for key, wanted in (
        ("agent.loop", recipe.agent.loop),
        ("reward.name", recipe.reward.name),
        ("algorithm.name", recipe.algorithm.name),
    ):
        if facts.get(key) is not None and facts[key] != wanted and console is not None:
            console.print(
                f"model.init_from: {ckpt} was trained with {key}={facts[key]}; this run uses {wanted}"
            )
