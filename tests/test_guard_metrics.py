"""A guard watches a metric the run logs, with a finite threshold (issue 48). On main a typo in a guard's metric
(`health/no_serach`) and `value: .nan` passed `check-recipe` and `train` with rc 0, the guard never fired and
the report called the run "healthy (no guard fired)"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.errors import ConfigError
from sleuth.rl.config import load_recipe, recipe_from_dict
from sleuth.rl.guard_metrics import check_guard_metrics, loggable_metrics
from sleuth.rl.trainer import train
from tiny_recipe import tiny_grpo_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PLUGINS = Path(__file__).resolve().parent / "plugins"
TYPO = {"name": "g", "kind": "above", "metric": "health/no_serach", "value": 0.9, "action": "stop"}


def _recipe(guards: list[dict], **overrides: Any) -> dict:
    data = {
        "name": "t",
        "data": {"train": "x.jsonl"},
        "retriever": {"index": "i"},
        "trainer": {"guards": guards},
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        data.setdefault(section, {})[field] = value
    return data


def _check_recipe(tmp_path: Path, guards: list[dict]) -> Any:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(guards)))
    return CliRunner().invoke(app, ["check-recipe", str(path)])


def test_check_recipe_refuses_a_guard_on_a_metric_no_step_logs(tmp_path: Path) -> None:
    result = _check_recipe(tmp_path, [TYPO])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())  # rich wraps long lines at the terminal width
    assert (
        "guard 'g' watches metric 'health/no_serach'" in message
        and "did you mean 'health/no_search'?" in message
    )


def test_train_refuses_it_before_a_model_loads(small_world: Path, tmp_path: Path) -> None:
    data = tiny_grpo_recipe(small_world, tmp_path / "run", "typo", 1)
    data["trainer"]["guards"] = [TYPO]
    with pytest.raises(ConfigError) as err:
        train(recipe_from_dict(data))
    message = str(err.value)
    assert "\n" not in message and message.startswith("recipe 'typo': trainer.guards: guard 'g'")
    assert "did you mean 'health/no_search'?" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_guard_threshold_must_be_finite(tmp_path: Path, value: str) -> None:
    path = tmp_path / "r.yaml"
    text = yaml.safe_dump(_recipe([{**TYPO, "metric": "health/no_search", "value": "VALUE"}]))
    path.write_text(text.replace("VALUE", value).replace("'", ""))
    result = CliRunner().invoke(app, ["check-recipe", str(path)])
    assert result.exit_code == 2, result.output
    assert "trainer.guards.0.above.value" in result.output and "finite number" in result.output


@pytest.mark.parametrize(
    ("metric", "overrides", "logged"),
    [
        ("accuracy/em", {}, True),
        (
            "accuracy/em",
            {"agent.loop": "s3", "reward.name": "s3_gbr"},
            False,
        ),  # a searcher-only loop answers nothing
        ("reward/acc_s3", {"agent.loop": "s3", "reward.name": "s3_gbr"}, True),
        ("reward/acc_s3", {}, False),  # search_r1_em's components are em and has_answer
        ("reward/has_answer", {}, True),
        ("critic/value_loss", {}, False),
        ("critic/value_loss", {"algorithm.name": "ppo"}, True),
        ("actor/kl_loss", {}, True),  # the default KL: a loss term with coefficient 0.001
        ("actor/kl_loss", {"algorithm.kl": {"coef": 0.0}}, False),
        ("actor/kl_coef_next", {"algorithm.kl": {"mode": "penalty", "type": "adaptive"}}, True),
        ("actor/clipfrac", {}, True),
        ("actor/clipfrak", {}, False),
        ("retriever/cache_hits", {}, False),
        ("retriever/cache_hits", {"retriever.cache": "c"}, True),
        ("reward/anything", {"plugins": ["sleuth_test_rewards"], "reward.name": "test_token_fraction"}, True),
    ],
)
def test_the_metrics_follow_the_loop_reward_and_algorithm(
    metric: str, overrides: dict, logged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An undeclared reward (a plugin's) leaves `reward/...` open; the built-in ones declare their components."""
    overrides = dict(overrides)
    plugins = overrides.pop("plugins", None)
    data = _recipe([{"name": "g", "kind": "above", "metric": metric, "value": 1.0}], **overrides)
    if plugins:
        monkeypatch.syspath_prepend(str(PLUGINS))
        data["plugins"] = plugins
    recipe = recipe_from_dict(data)
    assert (metric in loggable_metrics(recipe)) is logged
    if logged:
        check_guard_metrics(recipe)
    else:
        with pytest.raises(ConfigError, match="never logs"):
            check_guard_metrics(recipe)


def test_the_committed_recipes_and_default_guards_pass() -> None:
    for path in sorted(RECIPES.glob("*.yaml")):
        check_guard_metrics(load_recipe(path), str(path))


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "grpo", "n": 2},
        {"name": "ppo", "n": 2, "kl": {"coef": 0.01, "mode": "penalty", "type": "adaptive"}},
    ],
    ids=["grpo-kl-loss", "ppo-adaptive-kl-penalty"],
)
def test_every_logged_metric_is_known(small_world: Path, tmp_path: Path, algorithm: dict) -> None:
    """The list is the trainer's: every name one step logs is in it (one step of the tiny model)."""
    data = tiny_grpo_recipe(
        small_world, tmp_path / "run", "logged", 1, **{"retriever.cache": str(tmp_path / "c")}
    )
    data["algorithm"].update(algorithm)
    recipe = recipe_from_dict(data)
    train(recipe)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    loggable = loggable_metrics(recipe)
    unknown = sorted(k for k in row if k not in ("step", "time") and k not in loggable)
    assert not unknown
