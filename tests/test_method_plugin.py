"""A method defined outside sleuth (tests/plugins/sleuth_test_method.py: a new loop and reward) trains one
step, evaluates and serves through the CLI, with no edit to sleuth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from plugin_install import registrations_taken_back
from sleuth.cli import app

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))  # where a user's plugin would sit on PYTHONPATH


@pytest.fixture(scope="module", autouse=True)
def _plugins_taken_back_after():
    # the CLI commands run in-process, so the recipe's plugins register into this worker's registries: later test
    # modules (which list the built-in methods) must not see them
    with registrations_taken_back("sleuth_test_method", "sleuth_test_parts"):
        yield


@pytest.fixture(scope="module")
def trained(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plugin") / "run"
    recipe = {
        "name": "plugin-method",
        "model": {"policy": "tiny"},
        "data": {"train": str(small_world / "train.jsonl")},
        # a retriever backend, an advantage estimator and a policy loss from a plugin module, named in the recipe
        "retriever": {"location": f"test_counted:{small_world / 'bm25'}"},
        "agent": {
            "loop": "test_lookup",
            "max_turns": 1,
            "max_new_tokens_per_turn": 8,
            "max_response_tokens": 64,
            "max_obs_tokens": 32,
        },
        "plugins": [
            "sleuth_test_method",
            "sleuth_test_parts",
        ],  # no reward: section: the method's default reward
        "algorithm": {
            "name": "grpo",
            "n": 2,
            "prompts_per_step": 2,
            "minibatch_size": 4,
            "micro_batch_size": 4,
            "advantage": "test_counted_grpo",
            "policy_loss": "test_counted_ppo",
        },
        "trainer": {"total_steps": 1, "save_every": 1, "out_dir": str(out)},
    }
    path = out.parent / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    import sleuth_test_parts  # the recipe imports it again (a no-op): its counters are the ones below

    before = dict(sleuth_test_parts.CALLS)
    res = CliRunner().invoke(app, ["train", str(path)])
    assert res.exit_code == 0, res.output
    used = {k: v - before.get(k, 0) for k, v in sleuth_test_parts.CALLS.items()}
    assert used["advantage"] >= 1 and used["policy_loss"] >= 1 and used["open"] == 1, used
    return out


def test_plugin_method_trains_one_step(trained: Path) -> None:
    (line,) = (trained / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["step"] == 1
    # the plugin's reward components are logged, and its loop answers (so exact match is logged too)
    assert {"reward/searched", "reward/even", "accuracy/em"} <= set(metrics)
    assert 0.0 <= metrics["reward/mean"] <= 1.0
    rollouts = (trained / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    assert {json.loads(r)["method"] for r in rollouts} == {"test_lookup"}
    assert "<lookup>" in json.loads(rollouts[0])["prompt_text"]  # the plugin's own prompt


def test_train_without_a_reward_section_uses_the_methods_reward(trained: Path) -> None:
    """`sleuth train` of a recipe with no `reward:` trains on `Method.default_reward` (not search_r1_em)."""
    from sleuth.rl.config import recipe_from_dict

    assert json.loads((trained / "run.json").read_text())["recipe"]["reward"]["name"] == "test_lookup_reward"
    assert (
        recipe_from_dict(
            {"name": "x", "data": {"train": "t"}, "retriever": {"index": "i"}, "agent": {"loop": "s3"}}
        ).reward.name
        == "s3_gbr"
    )


def test_plugin_parts_are_refused_without_their_module() -> None:
    """Named without the module on the recipe's plugins, each part is refused at load with its own field."""
    from sleuth.errors import ConfigError
    from sleuth.retrieval.backends import parse_location
    from sleuth.rl.config import recipe_from_dict

    base = {"name": "x", "data": {"train": "t"}, "retriever": {"index": "i"}}
    with pytest.raises(ConfigError, match="algorithm.advantage: unknown estimator 'no_such_estimator'"):
        recipe_from_dict({**base, "algorithm": {"advantage": "no_such_estimator"}})
    with pytest.raises(ConfigError, match="unknown backend 'no_such_backend'.*--plugin MODULE"):
        parse_location("no_such_backend:somewhere")


def test_plugin_method_evaluates_through_the_cli(trained: Path, small_world: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    import sleuth_test_parts

    searched = sleuth_test_parts.CALLS["search"]
    args = [
        "eval",
        "--plugin",
        "sleuth_test_method",
        "--plugin",
        "sleuth_test_parts",
        "-m",
        "test-lookup,naive-rag",
        "--data",
        str(small_world / "test.jsonl"),
        "--retriever",
        f"test_counted:{small_world / 'bm25'}",
        "--model",
        str(trained),
        "--generator",
        "tiny",
        "--out",
        str(out),
        "--limit",
        "3",
        "--batch-size",
        "3",
    ]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == ["naive-rag", "test-lookup"]
    records = [json.loads(r) for r in (out / "test-lookup" / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["trajectory"]["method"] == "test_lookup" for r in records)
    assert all(r["answer_source"] != "generator" for r in records)  # it answers itself: no hand-over
    assert sleuth_test_parts.CALLS["search"] > searched  # the plugin's retriever backend, by its location


def test_plugin_method_serves_through_the_cli(trained: Path, small_world: Path, monkeypatch) -> None:
    import uvicorn

    answers = []

    def serve_in_test_client(asgi, **_kwargs):  # instead of binding a port
        with TestClient(asgi) as client:
            answers.append(client.post("/search", json={"question": "Where was Ada born?"}))

    monkeypatch.setattr(uvicorn, "run", serve_in_test_client)
    import sleuth_test_parts

    opened = sleuth_test_parts.CALLS["open"]
    res = CliRunner().invoke(
        app,
        [
            "serve-searcher",
            "--plugin",
            "sleuth_test_method",
            "--plugin",
            "sleuth_test_parts",
            "--checkpoint",
            str(trained),
            "--retriever",
            f"test_counted:{small_world / 'bm25'}",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "test_lookup searcher" in res.output
    assert sleuth_test_parts.CALLS["open"] == opened + 1  # the plugin's retriever backend, by its location
    (resp,) = answers
    assert resp.status_code == 200, resp.text
    assert resp.json()["loop"] == "test_lookup"


def test_plugin_reader_prompt_reads_its_served_documents(
    trained: Path, small_world: Path, monkeypatch
) -> None:
    """The plugin's own reader prompt (Method.reader) is what the service's /answer hands the frozen
    generator, and a reward option or EvalConfig.answer_template can name it: no edit to sleuth."""
    import uvicorn

    import sleuth.serve.service as service_module
    from sleuth.rewards.answerer import document_prompt

    handed = []
    real = service_module.answer_from_documents

    def recording(generator, questions, docs, template, params=None):
        handed.append((list(questions), [list(d) for d in docs], template))
        return real(generator, questions, docs, template, params)

    monkeypatch.setattr(service_module, "answer_from_documents", recording)
    answers = []

    def serve_in_test_client(asgi, **_kwargs):
        with TestClient(asgi) as client:
            answers.append(client.post("/answer", json={"question": "Where was Ada born?", "max_turns": 1}))

    monkeypatch.setattr(uvicorn, "run", serve_in_test_client)
    res = CliRunner().invoke(
        app,
        [
            "serve-searcher",
            "--plugin",
            "sleuth_test_method",
            "--checkpoint",
            str(trained),
            "--index",
            str(small_world / "bm25"),
            "--generator",
            "tiny",
        ],
    )
    assert res.exit_code == 0, res.output
    (resp,) = answers
    assert resp.status_code == 200, resp.text
    assert isinstance(resp.json()["answer"], str)
    import sleuth_test_method

    ((questions, docs, template),) = handed
    assert template is sleuth_test_method.NOTES_READER
    (messages,) = [document_prompt(q, d, template) for q, d in zip(questions, docs, strict=True)]
    assert messages[0]["content"].startswith("Notes:") and messages[0]["content"].endswith(
        "answer: Where was Ada born?"
    )
    # by name, like a recipe's reward option or `--answer-template`
    assert document_prompt("Q?", [], "test-lookup-notes") == sleuth_test_method.notes_prompt("Q?", [])


def test_an_unknown_plugin_is_named() -> None:
    res = CliRunner().invoke(
        app,
        [
            "serve-searcher",
            "--plugin",
            "no_such_plugin_module",
            "--model",
            "tiny",
            "--loop",
            "search_r1",
            "--index",
            "x",
        ],
    )
    assert res.exit_code == 2 and "no_such_plugin_module" in res.output


def _sleuth(args: list[str], with_plugins_on_path: bool) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh process: the plugin is registered only if something imports it there."""

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != PLUGINS]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(([str(PLUGINS)] if with_plugins_on_path else []) + paths),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return subprocess.run(
        [sys.executable, "-m", "sleuth.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_checkpoint_records_its_plugin_and_eval_loads_it_without_plugin_flag(
    trained: Path, small_world: Path, tmp_path: Path
) -> None:
    from sleuth.run_layout import SearcherInfo, resolve_checkpoint

    assert SearcherInfo.read(resolve_checkpoint(trained)).plugins == [
        "sleuth_test_method",
        "sleuth_test_parts",
    ]
    args = [
        "eval",
        "-m",
        "test-lookup",
        "--data",
        str(small_world / "test.jsonl"),
        "--retriever",
        str(small_world / "bm25"),
        "--model",
        str(trained),
        "--out",
        str(tmp_path / "eval"),
        "--limit",
        "2",
        "--batch-size",
        "2",
    ]
    res = _sleuth(args, with_plugins_on_path=True)  # no --plugin: the checkpoint names it
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(json.loads((tmp_path / "eval" / "summary.json").read_text())["methods"]) == ["test-lookup"]


def test_a_missing_plugin_is_named_with_the_flag_to_pass(
    trained: Path, small_world: Path, tmp_path: Path
) -> None:
    import shutil

    from sleuth.run_layout import resolve_checkpoint

    res = _sleuth(
        ["serve-searcher", "--checkpoint", str(trained), "--index", str(small_world / "bm25")],
        with_plugins_on_path=False,
    )
    assert res.returncode != 0
    assert "sleuth_test_method" in res.stderr + res.stdout and "--plugin" in res.stderr + res.stdout
    # a checkpoint from before plugins were recorded: eval's unknown-method error names --plugin
    old = tmp_path / "old"
    shutil.copytree(trained, old)
    info_path = resolve_checkpoint(old) / "searcher.json"
    info = json.loads(info_path.read_text())
    del info["plugins"]
    info_path.write_text(json.dumps(info))
    res = _sleuth(
        [
            "eval",
            "-m",
            "test-lookup",
            "--data",
            str(small_world / "test.jsonl"),
            "--retriever",
            str(small_world / "bm25"),
            "--model",
            str(old),
            "--out",
            str(tmp_path / "e"),
        ],
        with_plugins_on_path=False,
    )
    assert res.returncode != 0 and "--plugin" in res.stderr + res.stdout, res.stderr + res.stdout
