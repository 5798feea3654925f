"""The StepSearch and ZeroSearch plugins train one step through `sleuth train` and serve the trained searcher
through `sleuth serve-searcher`, with no edit to sleuth: the per-turn rewards go through the trainer's make_batch,
the simulated engine hears the training step, and the served searcher reads the real index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import uvicorn
import yaml
from fastapi.testclient import TestClient
from transformers import AutoTokenizer
from typer.testing import CliRunner

import sleuth.rl.run as run_module
from plugin_install import installed
from sleuth.cli import app
from sleuth.llm.scripted import ScriptedGenerator
from sleuth.llm.tiny import build_tiny_model

SMALL = {
    "agent": {
        "max_turns": 2,
        "top_k": 2,
        "max_new_tokens_per_turn": 8,
        "max_response_tokens": 96,
        "max_obs_tokens": 48,
    },
    "model": {"policy": "tiny"},
}


def train(out: Path, recipe: dict, **agent) -> Path:
    recipe["agent"] = {**recipe["agent"], **SMALL["agent"], **agent}
    recipe.update(
        model=SMALL["model"], trainer={"total_steps": 1, "save_every": 1, "out_dir": str(out / "run")}
    )
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["train", str(path)])
    assert res.exit_code == 0, res.output
    return out / "run"


def serve(run: Path, plugin: str, small_world: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """`sleuth serve-searcher` of a trained run, in a test client instead of a bound port: one /search answer."""
    answers = []

    def serve_in_test_client(asgi, **_kwargs):
        with TestClient(asgi) as client:
            answers.append(client.post("/search", json={"question": "Where was Ada born?"}))

    monkeypatch.setattr(uvicorn, "run", serve_in_test_client)
    args = [
        "serve-searcher",
        "--plugin",
        plugin,
        "--checkpoint",
        str(run),
        "--index",
        str(small_world / "bm25"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    (resp,) = answers
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_stepsearch_trains_one_ppo_step_and_serves(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with installed("sleuth_stepsearch") as sleuth_stepsearch:
        run = _train_stepsearch(sleuth_stepsearch, small_world, tmp_path)
        served = serve(run, "sleuth_stepsearch", small_world, monkeypatch)
    assert served["loop"] == "stepsearch"
    (line,) = (run / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert {"reward/f1", "reward/information_gain", "reward/redundancy"} <= set(metrics)
    rollouts = [json.loads(r) for r in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rollouts} == {"stepsearch"}
    assert all(r["extra"].get("supporting_ids") for r in rollouts)  # the synthetic world's gold passages


def _train_stepsearch(sleuth_stepsearch, small_world: Path, tmp_path: Path) -> Path:
    recipe = sleuth_stepsearch.recipe(str(small_world / "train.jsonl"))
    recipe["retriever"] = {"index": str(small_world / "bm25")}
    recipe["algorithm"].update(n=2, prompts_per_step=2, minibatch_size=4, micro_batch_size=4)
    return train(tmp_path, recipe)


def test_zerosearch_trains_one_step_against_its_simulated_engine_and_serves_on_the_index(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's `build_retriever` is replaced by a simulated engine over a scripted writer here (a tiny model's
    documents would be noise to check against), the rest is `sleuth train`; the trained policy is then served
    against the real index, as ZeroSearch's policies are used."""
    prompts: list[str] = []
    with installed("sleuth_zerosearch") as zs:
        run = _train_zerosearch(zs, small_world, tmp_path, monkeypatch, prompts)
        monkeypatch.undo()
        served = serve(run, "sleuth_zerosearch", small_world, monkeypatch)
    assert served["loop"] == "zerosearch"


def _train_zerosearch(
    zs, small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prompts: list[str]
) -> Path:

    def write(call) -> str:
        prompts.append(call.prompt_text)
        return "Doc 1: simulated one\nDoc 2: simulated two"

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    engine = zs.SimulatedSearchEngine(
        ScriptedGenerator(tok, write), total_steps=1, start_threshold=0.0, end_threshold=1.0
    )
    monkeypatch.setattr(run_module, "build_retriever", lambda recipe: engine)
    real = run_module._rollout_generator

    def scripted_policy(*args, **kwargs):  # an untrained tiny policy seldom searches: this one always does
        rollout_model, generator = real(*args, **kwargs)
        turns = lambda call: "<search> where </search>" if call.turn_index == 0 else "<answer> x </answer>"  # noqa: E731
        return rollout_model, ScriptedGenerator(generator.tokenizer, turns)

    monkeypatch.setattr(run_module, "_rollout_generator", scripted_policy)
    recipe = zs.recipe(str(small_world / "train.jsonl"), total_steps=1)
    recipe["retriever"] = {"index": str(small_world / "bm25")}  # required by the schema; replaced above
    recipe["algorithm"].update(n=2, prompts_per_step=2, minibatch_size=4, micro_batch_size=4)
    run = train(tmp_path, recipe, max_new_tokens_per_turn=32)
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/f1" in metrics
    # every search of step 0 was asked at step 0 (noise probability 0: useful documents), with its question
    assert engine.draws and {(step, kind) for _, step, kind in engine.draws} == {(0, "useful")}
    questions = {
        json.loads(line)["question"] for line in (small_world / "train.jsonl").read_text().splitlines()
    }
    assert all(any(f'"{q}"' in p for q in questions) for p in prompts)
    return run
