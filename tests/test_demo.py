"""`sleuth demo --fast` end to end (what CI runs), and evaluating the checkpoint it trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_fast_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "sleuth.cli", "demo", "--fast", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    before = json.loads((out / "eval_before" / "summary.json").read_text())["methods"]
    after = json.loads((out / "eval_after" / "summary.json").read_text())["methods"]
    assert set(before) == {"direct", "naive-rag", "s3"} and set(after) == {"s3"}
    n_test = before["s3"]["overall"]["n"]
    assert n_test == after["s3"]["overall"]["n"] > 0
    assert before["naive-rag"]["overall"]["retrieval_count"] == 1.0  # one search for the question
    assert before["direct"]["overall"]["retrieval_count"] == 0.0

    steps = [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    ckpt = out / "train" / "checkpoints" / "step_000002"
    info = json.loads((ckpt / "searcher.json").read_text())
    assert info["loop"] == "s3" and info["lora"] is True
    assert (ckpt / "policy" / "adapter_config.json").exists()

    html = (out / "report.html").read_text()
    assert "What it cannot show" in html and "eval_after" in html and "data:image/png;base64" in html

    # the trained checkpoint evaluates through the CLI like any model
    proc = subprocess.run(
        [sys.executable, "-m", "sleuth.cli", "eval", "-m", "s3", "--data", str(out / "world" / "test.jsonl"),
         "--retriever", str(out / "world" / "bm25"), "--model", str(out / "train"), "--generator", "tiny",
         "--limit", "3", "--max-new-tokens", "8", "--max-turns", "1", "--out", str(tmp_path / "ev")],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["methods"]["s3"]["overall"]["n"] == 3


def test_demo_trains_another_method(tmp_path: Path) -> None:
    # R-Search's loop and reward (evidence F1 from the frozen base model) through the same demo
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "sleuth.cli", "demo", "--fast", "--method", "r_search",
                           "--steps", "1", "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    before = json.loads((out / "eval_before" / "summary.json").read_text())["methods"]
    after = json.loads((out / "eval_after" / "summary.json").read_text())["methods"]
    assert set(before) == {"direct", "naive-rag", "r-search"} and set(after) == {"r-search"}
    metrics = [json.loads(x) for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    # R-Search's reward components are logged separately
    assert {"reward/answer_f1", "reward/evidence_f1", "reward/format"} <= set(metrics[0]), sorted(metrics[0])
    info = json.loads((out / "train" / "checkpoints" / "step_000001" / "searcher.json").read_text())
    assert info["loop"] == "r_search"
    assert "r_search on a synthetic world" in (out / "report.html").read_text()

    # a rerun resumes (every stage is already done) and adds its wall time to the recorded totals
    first = json.loads((out / "demo.json").read_text())["timings"]
    assert set(first) == {"world_and_indexes_s", "eval_before_s", "train_s", "eval_after_s", "total_s"}
    assert abs(first["total_s"] - sum(v for k, v in first.items() if k != "total_s")) < 1e-6
    proc = subprocess.run([sys.executable, "-m", "sleuth.cli", "demo", "--fast", "--method", "r_search",
                           "--steps", "1", "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    second = json.loads((out / "demo.json").read_text())["timings"]
    assert all(second[k] > first[k] for k in first)
    assert [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_demo_rejects_an_unknown_method(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sleuth.cli", "demo", "--fast", "--method", "s4",
                           "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--method 's4'" in proc.stdout and "r_search" in proc.stdout


def test_gpu_profile_recipe_compiles_rollouts_over_a_bf16_base(monkeypatch, tmp_path: Path) -> None:
    import sleuth.demo as demo
    from sleuth.rl.config import recipe_from_dict

    monkeypatch.setattr(demo, "_cuda", lambda: True)
    recipe = recipe_from_dict(demo.demo_recipe(tmp_path, demo.GPU, "r_search"))
    assert (recipe.model.generation_cache, recipe.model.compile_generation) == ("static", True)
    assert recipe.model.dtype == "bfloat16" and recipe.model.lora.enabled  # static cache needs bf16 rollout weights
    assert recipe.agent.max_new_tokens_per_turn == 128 and recipe.reward.name == "r_search"
    monkeypatch.setattr(demo, "_cuda", lambda: False)  # on a CPU the same profile keeps fp32 masters
    assert recipe_from_dict(demo.demo_recipe(tmp_path, demo.GPU, "s3")).model.dtype == "auto"
