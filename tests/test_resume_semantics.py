"""What `--resume` does with every recipe field (issue 48), one class per test: refused with one line, applied
(printed as "resume changes X: a -> b" and in effect from the first resumed step), or fixed by the checkpoint
(printed as not used). Tiny model, CPU. On main a changed learning rate was printed and not applied, and
warm-up, sampling, reward options, max_turns, seed, the KL coefficient and guards changed with no message."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from sleuth.errors import ConfigError
from sleuth.rl.checkpoint_compat import RESUME_RULES, resume_rule, schema_fields
from sleuth.rl.config import recipe_from_dict
from sleuth.rl.dist import init_distributed
from sleuth.rl.guard_actions import start_guards
from sleuth.rl.run import setup
from sleuth.rl.trainer import train
from sleuth.run_layout import TRAINING_STATE, checkpoint_dir
from tiny_recipe import tiny_grpo_recipe

DOCS = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
LR = 0.01
KL_PENALTY = {"coef": 0.01, "mode": "penalty"}


def _recipe(world: Path, out: Path, steps: int, **overrides: Any) -> dict:
    data = tiny_grpo_recipe(world, out, "resume-rules", steps, **overrides)
    data.setdefault("optim", {}).setdefault("lr", LR)
    data["algorithm"].setdefault("kl", KL_PENALTY)
    return data


@pytest.fixture(scope="module")
def one_step_run(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-step run at lr 0.01 with a fixed KL penalty of 0.01 (copied before each resume)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(recipe_from_dict(_recipe(small_world, out, 1)))
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _optim_state(out: Path, step: int) -> dict:
    return torch.load(checkpoint_dir(out, step) / TRAINING_STATE, map_location="cpu", weights_only=True)


def test_resume_trains_at_a_changed_learning_rate(
    small_world: Path, tmp_path: Path, one_step_run: Path
) -> None:
    """The issue's case: on main the change was printed, then step 2 trained at 0.01, logged lr 0.01, and the
    new checkpoint's optimizer and scheduler held 0.01."""
    out = _copy(one_step_run, tmp_path)
    console = Console(record=True, width=400)
    train(recipe_from_dict(_recipe(small_world, out, 2, **{"optim.lr": 1e-3})), resume=True, console=console)
    assert "resume changes optim.lr: 0.01 -> 0.001" in console.export_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["lr"] == pytest.approx(LR)
    assert rows[1]["lr"] == pytest.approx(1e-3)
    state = _optim_state(out, 2)
    assert state["optimizers"]["policy"]["param_groups"][0]["lr"] == pytest.approx(1e-3)
    assert state["schedulers"]["policy"]["base_lrs"] == pytest.approx([1e-3])


CHANGES = {
    "optim.lr": 1e-3,
    "optim.warmup_steps": 4,
    "optim.weight_decay": 0.1,
    "optim.betas": [0.8, 0.95],
    "sampling.temperature": 0.7,
    "agent.max_turns": 2,
    "algorithm.n": 4,
    "reward.options": {"answer_source": "upstream"},
    "algorithm.kl": {"coef": 0.05, "mode": "penalty"},
}


def test_resume_applies_and_prints_every_other_change(
    small_world: Path, tmp_path: Path, one_step_run: Path
) -> None:
    """Applied fields: printed, and what the first resumed step uses (read from the built run, before any step).
    On main the optimizer kept lr 0.01, no warm-up, betas and weight decay of the checkpoint, the KL penalty
    kept 0.01, and only the learning rate was printed."""
    out = _copy(one_step_run, tmp_path)
    data = _recipe(small_world, out, 3, **CHANGES)
    data["trainer"]["guards"] = [
        {"name": "stopped_searching", "kind": "above", "metric": "health/no_search", "value": 0.9, "steps": 5}
    ]
    console = Console(record=True, width=400)
    run = setup(recipe_from_dict(data), init_distributed("cpu"), console, resume=True)
    printed = console.export_text()
    for line in (
        "optim.lr: 0.01 -> 0.001",
        "optim.warmup_steps: 0 -> 4",
        "optim.weight_decay: 0.0 -> 0.1",
        "optim.betas: [0.9, 0.999] -> [0.8, 0.95]",
        "sampling.temperature: 1.0 -> 0.7",
        "agent.max_turns: 1 -> 2",
        "algorithm.n: 2 -> 4",
        "reward.options.answer_source: (unset) -> upstream",
        "algorithm.kl.coef: 0.01 -> 0.05",
        "trainer.total_steps: 1 -> 3",
        "trainer.guards.stopped_searching: value 0.95 -> 0.9",
        "trainer.guards.entropy_collapse: {'name': 'entropy_collapse'",
    ):
        assert f"resume changes {line}" in printed, line
    group = run.optimizers["policy"].param_groups[0]
    # one step done: the warm-up of 4 steps is at (1 + 1) / 4 of the new rate
    assert group["lr"] == pytest.approx(1e-3 * 2 / 4) and group["initial_lr"] == pytest.approx(1e-3)
    assert group["weight_decay"] == 0.1 and tuple(group["betas"]) == (0.8, 0.95)
    assert run.schedulers["policy"].base_lrs == pytest.approx([1e-3])
    assert run.sampling.temperature == 0.7 and run.loop.max_turns == 2
    assert run.reward_fn.answer_source == "upstream" and run.kl_coef == 0.05
    assert run.recipe.algorithm.n == 4
    monitor = start_guards(run).monitor
    assert [(g.name, g.value) for g in monitor.guards] == [("stopped_searching", 0.9)]


def test_resume_refuses_another_seed_in_one_line(
    small_world: Path, tmp_path: Path, one_step_run: Path
) -> None:
    """Refused fields: on main another seed resumed silently (another data order from the checkpoint's
    position on, so questions repeated or skipped within the epoch)."""
    out = _copy(one_step_run, tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError) as err:
        train(recipe_from_dict(_recipe(small_world, out, 2, seed=7)), resume=True)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--resume: seed differs") and "pass seed=0" in message
    assert (out / "metrics.jsonl").read_bytes() == before


def test_resume_prints_fields_fixed_by_the_checkpoint(small_world: Path, tmp_path: Path) -> None:
    """Fixed fields: the LoRA rank of the adapters comes from the checkpoint whatever the recipe says; on main
    a changed rank resumed with no message."""
    lora = {"policy": "tiny", "lora": {"enabled": True, "r": 2, "alpha": 4}}
    out = tmp_path / "run"
    train(recipe_from_dict(_recipe(small_world, out, 1, model=lora)))
    bigger = {"policy": "tiny", "lora": {"enabled": True, "r": 8, "alpha": 4}}
    console = Console(record=True, width=400)
    run = setup(
        recipe_from_dict(_recipe(small_world, out, 2, model=bigger)),
        init_distributed("cpu"),
        console,
        resume=True,
    )
    printed = console.export_text()
    assert "resume keeps model.lora.r=2 from the checkpoint; the recipe's 8 is not used" in printed
    assert run.policy.peft_config["default"].r == 2


def test_every_recipe_field_has_a_resume_rule_and_the_docs_list_them() -> None:
    """A new recipe field needs a decision in RESUME_RULES; docs/compatibility.md lists every rule."""
    missing = [f for f in schema_fields() if resume_rule(f) is None]
    assert not missing, f"fields without a resume rule: {missing}"
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", DOCS.read_text(encoding="utf-8"), re.MULTILINE))
    assert set(RESUME_RULES) <= documented, sorted(set(RESUME_RULES) - documented)
    for key in RESUME_RULES:
        assert resume_rule(key) is RESUME_RULES[key]
