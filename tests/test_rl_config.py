"""Recipe loading: every shipped recipe validates; bad values fail naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sleuth.errors import ConfigError
from sleuth.rl.config import apply_overrides, load_recipe, recipe_from_dict, write_recipe

RECIPES_DIR = Path(__file__).parent.parent / "recipes"
RECIPES = sorted(RECIPES_DIR.rglob("*.yaml"))

MINIMAL = {"name": "t", "data": {"train": "x.jsonl"}, "retriever": {"index": "idx"}}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name
    assert recipe.algorithm.advantage in {"gae", "grpo", "drgrpo", "rloo"}


def test_paper_defaults_in_recipes() -> None:
    s3 = load_recipe(RECIPES_DIR / "s3.yaml")
    assert (s3.algorithm.name, s3.algorithm.advantage, s3.sampling.temperature) == ("ppo", "gae", 0.6)
    assert (s3.agent.top_k, s3.agent.max_turns, s3.optim.lr, s3.optim.critic_lr) == (8, 3, 1e-6, 1e-5)
    staged = load_recipe(RECIPES_DIR / "staged.yaml")
    assert staged.algorithm.dynamic_sampling and staged.algorithm.clip_high > staged.algorithm.clip_low
    assert staged.reward.options["beta"] == 0.3


def test_unknown_field_is_named() -> None:
    data = {**MINIMAL, "algorithm": {"nn": 5}}
    with pytest.raises(ConfigError, match=r"algorithm\.nn"):
        recipe_from_dict(data)


def test_invalid_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"agent\.loop"):
        recipe_from_dict({**MINIMAL, "agent": {"loop": "nope"}})
    with pytest.raises(ConfigError, match=r"algorithm\.n >= 2"):
        recipe_from_dict({**MINIMAL, "algorithm": {"name": "grpo", "n": 1}})
    with pytest.raises(
        ConfigError,
        match="exactly one of retriever.index, retriever.url, retriever.mcp, retriever.http or retriever.location",
    ):
        recipe_from_dict({**MINIMAL, "retriever": {"index": "a", "url": "http://x"}})


def test_any_loop_reward_algorithm_combination_is_valid() -> None:
    for loop in ["search_r1", "s3", "r_search", "staged", "qagent"]:
        for algo in ["ppo", "grpo", "dapo", "rloo", "drgrpo"]:
            r = recipe_from_dict(
                {
                    **MINIMAL,
                    "agent": {"loop": loop},
                    "reward": {"name": "s3_gbr"},
                    "algorithm": {"name": algo},
                }
            )
            assert r.algorithm.uses_critic == (algo == "ppo")


def test_overrides_parse_yaml_values(tmp_path: Path) -> None:
    data = apply_overrides(
        {"algorithm": {"n": 5}}, ["algorithm.n=3", "sampling.temperature=0.5", "x.y=[1, 2]"]
    )
    assert data == {"algorithm": {"n": 3}, "sampling": {"temperature": 0.5}, "x": {"y": [1, 2]}}
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["algorithm.n"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_reward_and_loop_options_are_accepted(path: Path) -> None:
    """Recipes are data the trainer hands to the reward and loop registries: unknown options fail there."""
    from sleuth.agent import get_loop
    from sleuth.rewards.base import get_reward
    from sleuth.rl.setup import loop_options

    recipe = load_recipe(path)
    get_reward(recipe.reward.name, **recipe.reward.options)
    get_loop(recipe.agent.loop, **loop_options(recipe))


def test_clip_ratio_c_is_off_by_default_and_must_exceed_one() -> None:
    from pydantic import ValidationError

    from sleuth.rl.config import AlgorithmConfig

    assert AlgorithmConfig().clip_ratio_c is None
    assert AlgorithmConfig(clip_ratio_c=3.0).clip_ratio_c == 3.0
    with pytest.raises(ValidationError, match="clip_ratio_c"):
        AlgorithmConfig(clip_ratio_c=1.0)


def test_plugins_have_their_own_section_and_the_old_place_migrates_with_a_warning() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    new = recipe_from_dict(
        {**MINIMAL, "plugins": ["sleuth_test_rewards"], "reward": {"name": "test_token_fraction"}}
    )
    assert new.plugins == ["sleuth_test_rewards"] and "plugins" not in new.reward.model_dump()
    old = {**MINIMAL, "reward": {"name": "test_token_fraction", "plugins": ["sleuth_test_rewards"]}}
    with pytest.warns(DeprecationWarning, match=r"reward\.plugins is read as the top-level `plugins:`"):
        migrated = recipe_from_dict(old)
    assert migrated.plugins == ["sleuth_test_rewards"] and migrated.reward.name == "test_token_fraction"
    # a saved recipe (run.json) from before: an empty reward.plugins is dropped without a word
    assert recipe_from_dict({**MINIMAL, "reward": {"plugins": []}}).plugins == []
    with pytest.raises(ConfigError, match=r"reward\.plugins .* must be a list"):
        recipe_from_dict({**MINIMAL, "reward": {"plugins": "sleuth_test_rewards"}})
    with pytest.raises(ConfigError, match="no_such_plugin_module"):
        recipe_from_dict({**MINIMAL, "plugins": ["no_such_plugin_module"]})


def test_write_recipe_saves_yaml_that_loads_back_and_names_the_file_in_errors(tmp_path: Path) -> None:
    """A recipe built in code (demo, reproduce, knowledge injection, reader) is saved where a user can rerun it."""
    path = tmp_path / "run" / "recipe.yaml"
    written = write_recipe({**MINIMAL, "name": "saved"}, path)
    assert written.name == "saved" and load_recipe(path) == written
    with pytest.raises(ConfigError, match=rf"(?s){tmp_path / 'bad.yaml'}: invalid recipe.*agent\.loop"):
        write_recipe({**MINIMAL, "agent": {"loop": "nope"}}, tmp_path / "bad.yaml")


def _check_recipe(*args: str):
    from typer.testing import CliRunner

    from sleuth.cli import app

    return CliRunner().invoke(app, ["check-recipe", *args])


@pytest.mark.parametrize(
    ("recipe", "override", "said"),
    [
        ("search_r1.yaml", "reward.options.answer_source=upstrem", "did you mean 'upstream'?"),
        ("r_search.yaml", "reward.options.rules=upstram", "did you mean 'upstream'?"),
        ("s3.yaml", "reward.options.judge_rul=em", "did you mean judge_rule?"),
        ("s3.yaml", "agent.options.no_such=1", "has no option(s) no_such"),
    ],
)
def test_check_recipe_refuses_what_train_refuses_before_any_model_loads(
    recipe: str, override: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sleuth.rl.models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sleuth.rl.models, "load_policy", no_model)
    result = _check_recipe(str(RECIPES_DIR / recipe), override)
    assert result.exit_code == 2, result.output
    assert said in result.output and result.stdout == ""
    # `train` checks the same pieces before it loads anything (check_input_paths runs first in train)
    from sleuth.rl.setup import check_input_paths

    with pytest.raises(ConfigError, match=re.escape(said)):
        check_input_paths(load_recipe(RECIPES_DIR / recipe, [override]))


def test_check_recipe_prints_yaml_that_round_trips(tmp_path: Path) -> None:
    result = _check_recipe(str(RECIPES_DIR / "staged.yaml"), "description=" + "a long description " * 8)
    assert result.exit_code == 0, result.output
    assert (
        "\x1b[" not in result.stdout
        and "data.train: data/2wikimqa/train.jsonl does not exist" in result.stderr
    )
    (tmp_path / "r.yaml").write_text(result.stdout)
    again = load_recipe(tmp_path / "r.yaml")
    assert (
        again.model_dump()
        == load_recipe(RECIPES_DIR / "staged.yaml", ["description=" + "a long description " * 8]).model_dump()
    )


def test_unknown_keys_get_did_you_mean_and_verl_names_mapped() -> None:
    data = {
        **MINIMAL,
        "data": {"train": "x", "train_files": ["x"], "trian": "x"},
        "trainer": {"logger": ["console"]},
        "algorithm": {"adv_estimator": "grpo"},
        "actor_rollout_ref": {"rollout": {"n": 5}},
    }
    with pytest.raises(ConfigError) as err:
        recipe_from_dict(data)
    lines = str(err.value).splitlines()
    for line in (
        "  data.train_files: unknown key; verl's data.train_files is data.train here",
        "  data.trian: unknown key; did you mean data.train?",
        "  actor_rollout_ref: unknown key; verl's actor_rollout_ref.rollout.n is algorithm.n here",
    ):
        assert line in lines
    assert any(
        x.startswith("  trainer.logger: unknown key; verl's trainer.logger is trainer.loggers here")
        for x in lines
    )
    assert any(
        x.startswith(
            "  algorithm.adv_estimator: unknown key; verl's algorithm.adv_estimator is "
            "algorithm.advantage here"
        )
        for x in lines
    )


def test_every_verl_name_maps_to_a_recipe_key() -> None:
    from sleuth.rl.config import Recipe
    from sleuth.rl.recipe_hints import VERL_NAMES, _models_in

    for verl, target in VERL_NAMES.items():
        model: object = Recipe
        for part in target.partition(" : ")[0].split("."):
            assert part in model.model_fields, (verl, target)
            inner = _models_in(model.model_fields[part].annotation)
            model = inner[0] if inner else None
