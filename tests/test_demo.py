"""`sleuth demo --fast` end to end (what CI runs), and evaluating the checkpoint it trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_fast_end_to_end(tmp_path: Path, fast_demo_run: tuple[Path, dict]) -> None:
    # the run (a subprocess) is shared with the browser test of its report (tests/conftest.py)
    out, demo = fast_demo_run
    assert demo["returncode"] == 0, demo["stdout"][-2000:] + demo["stderr"][-2000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    # the pipeline: oracle trajectories -> SFT -> RL with groups of 4 from the SFT checkpoint
    records = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert records and all(
        r["loop"] == "search_r1" and len(r["loss_mask"]) == len(r["response_ids"]) for r in records
    )
    sft_steps = [
        json.loads(x)["step"] for x in (out / "train" / "sft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert sft_steps == list(range(1, len(sft_steps) + 1)) and sft_steps
    run = json.loads((out / "train" / "run.json").read_text())
    assert run["recipe"]["model"]["init_from"].startswith(str(out / "train" / "sft" / "checkpoints"))
    assert run["recipe"]["algorithm"]["n"] >= 4
    steps = [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    rollouts = [
        json.loads(x) for x in (out / "train" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]
    groups: dict[tuple[int, int], int] = {}
    for t in rollouts:
        key = (t["sampling_round"], t["group"])
        groups[key] = groups.get(key, 0) + 1
    assert set(groups.values()) == {4}
    ckpt = out / "train" / "checkpoints" / "step_000002"
    info = json.loads((ckpt / "searcher.json").read_text())
    assert info["loop"] == "search_r1" and info["lora"] is True
    assert (ckpt / "policy" / "adapter_config.json").exists()

    after = json.loads((out / "eval_after" / "summary.json").read_text())
    assert set(after["methods"]) == {"naive-rag", "search-r1"}
    assert after["methods"]["search-r1"]["overall"]["n"] == 8
    assert "span_check_ci" in after["methods"]["search-r1"]["overall"] and "paired" in after
    assert not (out / "eval_committed").exists()  # the tiny model has no committed searcher

    html = (out / "report.html").read_text()
    assert "What this demo shows" in html and "eval_after" in html and "data:image/png;base64" in html
    # the RL run's health panel and verdict; the SFT run is not called healthy (Chromium draws the panel:
    # tests/test_eval_report_browser.py::test_demo_report_draws_the_health_panel)
    assert 'data-plot="health" alt="health plot for train" src="data:image/png;base64,' in html
    # 2 RL steps cannot judge guards that need 5: the verdict says so, naming what was past a threshold
    assert "Health: too few steps to judge (2 logged" in html and "Health: no RL steps" in html
    # the comparison the demo exists to show: the console's last line and the top of the report
    last = [line for line in demo["stdout"].splitlines() if line.strip()][-1]
    assert last.startswith("searcher trained here vs naive RAG: ") and "% [" in last and "difference" in last
    assert 'id="headline"' in html and html.index('id="headline"') < html.index('id="training"')
    assert str(Path.home()) + "/" not in html  # the model cache under $HOME shows as ~
    # third-party warnings are silenced where sleuth triggers them
    assert (
        "is_gradient_checkpointing" not in demo["stderr"]
        and "clean_up_tokenization_spaces" not in demo["stderr"]
    )

    # the trained checkpoint evaluates through the CLI like any model
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sleuth.cli",
            "eval",
            "-m",
            "search-r1",
            "--data",
            str(out / "world" / "test.jsonl"),
            "--retriever",
            str(out / "world" / "bm25"),
            "--model",
            str(out / "train"),
            "--generator",
            "tiny",
            "--limit",
            "3",
            "--max-new-tokens",
            "8",
            "--max-turns",
            "1",
            "--out",
            str(tmp_path / "ev"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["methods"]["search-r1"]["overall"]["n"] == 3


def test_demo_trains_another_method(tmp_path: Path) -> None:
    # R-Search's oracle, loop and reward (evidence F1 from the frozen base model) through the same demo
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sleuth.cli",
            "demo",
            "--fast",
            "--method",
            "r_search",
            "--steps",
            "1",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    after = json.loads((out / "eval_after" / "summary.json").read_text())["methods"]
    assert set(after) == {"naive-rag", "r-search"}
    assert all(
        "<original_evidence>" in json.loads(x)["response_text"]
        for x in (out / "trajectories.jsonl").read_text().splitlines()
    )
    metrics = [json.loads(x) for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    # R-Search's reward components are logged separately
    assert {"reward/answer_f1", "reward/evidence_f1", "reward/format"} <= set(metrics[0]), sorted(metrics[0])
    info = json.loads((out / "train" / "checkpoints" / "step_000001" / "searcher.json").read_text())
    assert info["loop"] == "r_search"
    assert "r_search on a synthetic world" in (out / "report.html").read_text()

    # a rerun resumes (every stage is already done) and adds its wall time to the recorded totals
    first = json.loads((out / "demo.json").read_text())["timings"]
    assert set(first) == {"world_and_index_s", "pipeline_s", "eval_and_report_s", "total_s"}
    assert abs(first["total_s"] - sum(v for k, v in first.items() if k != "total_s")) < 1e-6
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sleuth.cli",
            "demo",
            "--fast",
            "--method",
            "r_search",
            "--steps",
            "1",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    second = json.loads((out / "demo.json").read_text())["timings"]
    assert all(second[k] > first[k] for k in first)
    assert [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_committed_searcher_is_found_only_for_its_model_and_world(tmp_path: Path, monkeypatch) -> None:
    import sleuth.demo as demo

    assert demo.committed_checkpoint("search_r1", demo.FULL, None) == demo.REPO_CHECKPOINTS / "search_r1"
    assert demo.committed_checkpoint("search_r1", demo.FAST, None) is None  # tiny model, small world
    assert demo.committed_checkpoint("search_r1", demo.FULL, "none") is None
    # checkpoints/claims holds the claim runs' injected model and reader (tests/test_claim_checkpoints.py)
    for committed in sorted(p for p in demo.REPO_CHECKPOINTS.iterdir() if p.is_dir() and p.name != "claims"):
        info = json.loads((committed / "searcher.json").read_text())
        assert info["base_model"] == "smollm2-135m-instruct", (
            committed
        )  # loads anywhere, not a GPU box's path
        assert (committed / "recipe.yaml").exists() and (
            committed / "policy" / "adapter_model.safetensors"
        ).exists()
    monkeypatch.setattr(demo, "REPO_CHECKPOINTS", tmp_path)  # a checkout without a committed searcher
    assert demo.committed_checkpoint("r_search", demo.FULL, None) is None


def test_demo_rejects_an_unknown_method(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sleuth.cli",
            "demo",
            "--fast",
            "--method",
            "s4",
            "--out",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "--method 's4'" in proc.stdout and "r_search" in proc.stdout


def test_gpu_profile_recipe_decodes_rollouts_with_the_engine_over_a_bf16_base(
    monkeypatch, tmp_path: Path
) -> None:
    """The GPU profile leaves rollout decoding to the trainer's "auto" (the decode engine on CUDA, no per-shape
    compile); `--compile` asks for the compiled static cache, `--no-compile` for HF's dynamic cache."""
    from dataclasses import replace

    import sleuth.demo as demo
    from sleuth.rl.config import recipe_from_dict

    monkeypatch.setattr(demo, "_cuda", lambda: True)
    recipe = recipe_from_dict(demo.demo_recipe(tmp_path, demo.GPU, "r_search"))
    assert (recipe.model.generation_cache, recipe.model.compile_generation) == ("auto", None)
    assert (
        recipe.model.dtype == "bfloat16" and recipe.model.lora.enabled
    )  # GPU decoding wants bf16 rollout weights
    compiled = recipe_from_dict(
        demo.demo_recipe(tmp_path, replace(demo.GPU, compile_generation=True), "r_search")
    )
    assert (compiled.model.generation_cache, compiled.model.compile_generation, compiled.model.dtype) == (
        "static",
        True,
        "bfloat16",
    )
    plain = recipe_from_dict(
        demo.demo_recipe(tmp_path, replace(demo.GPU, compile_generation=False), "r_search")
    )
    assert (plain.model.generation_cache, plain.model.dtype) == ("dynamic", "auto")
    assert demo.GPU.eval_batch_size == 128 and demo.FULL.eval_batch_size == 16
    assert recipe.agent.max_new_tokens_per_turn == 128 and recipe.reward.name == "r_search"
    assert recipe.sft is not None and recipe.algorithm.n >= 4
    monkeypatch.setattr(demo, "_cuda", lambda: False)  # on a CPU the same profile keeps fp32 masters
    assert recipe_from_dict(demo.demo_recipe(tmp_path, demo.GPU, "s3")).model.dtype == "auto"
