"""bench/update_memory.py --recipe: a real `sleuth train` run per case, its process tree's RSS sampled, the rows
merged beside the synthetic ones in the results JSON; a case over the cap is stopped and reported."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench_loading import load_bench


def test_update_memory_measures_training_runs_and_stops_one_over_the_cap(
    small_world: Path, tmp_path: Path
) -> None:
    bench = load_bench("update_memory")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "model": {"policy": "tiny", "lora": {"enabled": True, "r": 2, "alpha": 4}},
                "data": {"train": str(small_world / "train.jsonl")},
                "retriever": {"index": str(small_world / "bm25")},
                "agent": {
                    "loop": "search_r1",
                    "max_turns": 1,
                    "max_new_tokens_per_turn": 8,
                    "max_response_tokens": 64,
                    "max_obs_tokens": 16,
                },
                "reward": {"name": "search_r1_em"},
                "algorithm": {
                    "name": "grpo",
                    "n": 2,
                    "prompts_per_step": 2,
                    "minibatch_size": 4,
                    "micro_batch_size": 4,
                },
                "trainer": {"total_steps": 3, "save_every": 0, "out_dir": str(tmp_path / "unused")},
            }
        )
    )
    out = tmp_path / "memory.json"
    out.write_text(json.dumps({"bench": "update_memory", "rows": [{"path": "synthetic"}]}))
    bench.main(
        [
            "--recipe",
            str(recipe),
            "--set",
            "trainer.total_steps=1",
            "--interval",
            "0.1",
            "--out",
            str(out),
            "--case",
            "micro2",
            "algorithm.micro_batch_size=2",
        ]
    )
    data = json.loads(out.read_text())
    assert data["rows"] == [{"path": "synthetic"}]  # the synthetic rows are kept
    (row,) = data["train"]["rows"]
    assert row["status"] == "ok", row
    assert row["overrides"] == ["algorithm.micro_batch_size=2"] and data["train"]["overrides"] == [
        "trainer.total_steps=1"
    ]
    assert 0.2 < row["peak_rss_gib"] < 8 and 0 < row["peak_at_s"] <= row["wall_s"]
    assert row["metrics"]["update/micro_batches"] == 2  # the case's override reached the run
    assert max(g for _, g in row["rss_timeline_gib"]) <= row["peak_rss_gib"]

    bench.main(
        [
            "--recipe",
            str(recipe),
            "--cap-gib",
            "0.1",
            "--interval",
            "0.1",
            "--out",
            str(out),
            "--case",
            "capped",
        ]
    )
    (row,) = json.loads(out.read_text())["train"]["rows"]
    assert (
        row["status"] == "killed over the 0.1 GiB cap" and row["peak_rss_gib"] >= 0.1 and row["wall_s"] < 60
    )
