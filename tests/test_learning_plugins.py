"""bench/learning.py runs plugin methods by their registered names (issue 45): StepSearch, ZeroSearch and Tree-GRPO
beside search_r1 on the CPU profile, end to end: Search-R1's oracle as their cold start (`Method.oracle_format`),
SFT, one RL step with each method's own sections (`Method.recipe_sections`), the held-out evaluation, and the
report's rows paired against search_r1 and naive RAG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bench_loading import BENCH, load_bench
from plugin_install import PLUGINS, installed
from sleuth.agent.registry import Method, RunShape, get_method
from sleuth.agent.search_r1 import SearchR1Loop
from sleuth.errors import ConfigError

ROOT = BENCH.parent
PLUGIN_MODULES = "sleuth_stepsearch,sleuth_zerosearch,sleuth_tree_grpo"
METHODS = ("search_r1", "stepsearch", "zerosearch", "tree_search")


def _learning(*argv: str, out: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(PLUGINS)]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        # one lane, no warm-up variant: the jobs the GPU plan runs (bench/plans/plugins45.json)
        "LEARN_LANES": "shared," + ",".join(f"{m}:full" for m in METHODS),
    }
    # one RL step a method: the plugins' sections, rewards and rollouts all act in it (two steps were 10 s more)
    env["LEARN_RL_STEPS"] = ",".join(f"{m}=1" for m in METHODS)
    res = subprocess.run(
        [sys.executable, str(BENCH / "learning.py"), *argv, "--out", str(out), "--plugins", PLUGIN_MODULES],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = "".join(p.read_text() for p in sorted(out.glob("lane*.log")))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs[-3000:]
    return res.stdout


@pytest.mark.slow
def test_plugin_methods_learn_end_to_end_on_the_cpu_profile(tmp_path: Path) -> None:
    out = tmp_path / "learn"
    _learning("run", "--cpu", "--model", "tiny", "--gpus", "1", "--methods", ",".join(METHODS), out=out)
    status = json.loads((out / "status.json").read_text())
    failed = (
        {p.name: p.read_text()[-1500:] for p in (out / "failed").glob("*")}
        if (out / "failed").exists()
        else {}
    )
    assert status["failed"] == [], failed
    done = status["done"]
    for method in METHODS:
        # the cold start: Search-R1's oracle writes every plugin's trajectories (their loops are Search-R1's)
        assert done[f"{method}_trajectories"]["kept"] > 0
        for stage in ("full_sft", "full_eval_sft", "full_rl", "full_eval_rl"):
            assert f"{method}_{stage}" in done
        rows = (out / method / "full" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1]
    # each plugin's own sections reached its RL recipe
    recipe = {m: yaml.safe_load((out / m / "full" / "recipe.yaml").read_text()) for m in METHODS}
    assert recipe["tree_search"]["algorithm"]["advantage"] == "tree_grpo"
    assert recipe["tree_search"]["agent"]["options"] == {"tree_expansions": 1, "tree_branches": 2}
    assert (
        recipe["stepsearch"]["algorithm"]["name"] == "ppo"
        and recipe["stepsearch"]["reward"]["name"] == "stepsearch"
    )
    assert recipe["zerosearch"]["retriever"]["location"].startswith("zerosearch:tiny?total_steps=1&")
    assert recipe["search_r1"]["retriever"]["index"].endswith("bm25") and "plugins" not in recipe["search_r1"]
    # the tree rollouts forked: more trajectories than chains, branches marked
    tree_rows = [
        json.loads(x) for x in (out / "tree_search" / "full" / "rollouts" / "step_000001.jsonl").open()
    ]
    assert any("forked_at_turn" in r.get("extra", {}) for r in tree_rows), tree_rows[0].keys()

    _learning("report", "--dest", str(tmp_path / "report"), out=out)
    report = json.loads((tmp_path / "report" / "learning.json").read_text())
    assert set(report["methods"]) == set(METHODS)
    test_questions = report["shared"]["naive-rag"]["n"]
    for method in METHODS[1:]:
        for label in ("SFT only", "SFT + RL"):
            row = report["methods"][method]["rows"][label]
            assert row["vs_naive_rag"]["n"] == row["vs_search_r1"]["n"] == test_questions
    assert "vs_search_r1" not in report["methods"]["search_r1"]["rows"]["SFT + RL"]


def test_plugin_methods_describe_their_runs() -> None:
    shape = RunShape(model="m", total_steps=30, prompts_per_step=16, n=5)
    with installed("sleuth_tree_grpo") as tree:
        # M = 2 trees of 1 + 1 x 2 trajectories per question: one optimizer step holds all 16 x 6
        assert tree.run_sections(shape)["algorithm"] == {
            "advantage": "tree_grpo",
            "n": 2,
            "minibatch_size": 96,
        }
        assert get_method("tree_search").oracle() is get_method("search_r1").oracle_planner
    with installed("sleuth_stepsearch") as step:
        # PPO, one sample a question on 16 x 5 questions: as many trajectories a step as GRPO's 16 x 5
        assert step.run_sections(shape)["algorithm"] == {
            "name": "ppo",
            "advantage": "gae",
            "gamma": 1.0,
            "lam": 1.0,
            "n": 1,
            "prompts_per_step": 80,
            "minibatch_size": 80,
        }
    assert get_method("search_r1").recipe_sections is None and get_method("search_r1").oracle_format == ""
    # an oracle format naming no registered method says so when the cold start asks for it
    with pytest.raises(ConfigError, match="unknown agent loop 'no_such_method'"):
        Method(loop=SearchR1Loop, title="t", oracle_format="no_such_method").oracle()


def test_more_lanes_than_gpus_share_them_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LEARN_LANES with four lanes on one GPU (bench/plans/plugins45.json): every lane's process sees GPU 0."""
    learning = load_bench("learning")
    devices: list[str] = []

    class Lane:
        def __init__(self, cmd: list[str], env: dict[str, str], **_: object) -> None:
            devices.append(env["CUDA_VISIBLE_DEVICES"])

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(learning, "stage", lambda *a: {})
    monkeypatch.setattr(learning, "status", lambda args: None)
    monkeypatch.setattr(learning.subprocess, "Popen", Lane)
    monkeypatch.setenv("LEARN_LANES", "shared,search_r1:full;s3:full;staged:full;qagent:full")
    args = SimpleNamespace(
        out=str(tmp_path), cpu=False, methods="search_r1", plugins="", gpus=1, model="m", encoder=None
    )
    learning.run(args)
    assert devices == ["0", "0", "0", "0"]
    args.gpus = 2
    devices.clear()
    learning.run(args)
    assert devices == ["0", "1", "0", "1"]
