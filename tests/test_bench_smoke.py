"""The bench scripts: their arithmetic against hand-computed values, and one tiny end-to-end run each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench_loading import load_bench

common = load_bench("_common")


def test_decode_call_bytes_by_hand() -> None:
    # 3 steps read the weights 3x (300); KV: row 1 reads 5+6+7 = 18 tokens, row 2 reads 5: 23 x 10 = 230.
    assert common.decode_call_bytes(100, 10, 5, [3, 1]) == 530
    assert common.decode_call_bytes(100, 10, 5, []) == 0


def test_kv_bytes_and_hbm_fraction() -> None:
    # Qwen2.5-0.5B in bf16: K and V x 24 layers x 2 KV heads x 64 dims x 2 bytes.
    assert common.kv_bytes_per_token(24, 2, 64, 2) == 12288
    # 3.35e9 bytes at 3350 GB/s take 1 ms; measured 4 ms -> 25% of the bound.
    assert common.hbm_fraction(3.35e9, 0.004, 3350.0) == pytest.approx(0.25)
    assert common.hbm_fraction(1.0, 1.0, None) is None


def test_verl_flops_counter_by_hand() -> None:
    # Qwen2.5-3B: head_dim 128, K/V 2 x 256; per layer MLP 2048 x 11008 x 3 = 67,633,152 and attention linears
    # 2048 x (2048 + 512 + 2048) = 9,437,184; x 36 layers + 151,936 x 2048 x 2 (embedding and output) = 3,396,861,952
    arch = common.RANDOM_ARCHS["qwen2.5-3b"]
    dense = 6 * 3_396_861_952 * (1000 + 3000)
    attention = 12 * (1000**2 + 3000**2) * 128 * 16 * 36
    assert common.verl_flops(arch, [1000, 3000]) == dense + attention
    assert common.default_bf16_tflops("NVIDIA H200") == 989.0
    assert common.default_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert common.default_bf16_tflops("cpu") is None


def test_bandwidth_from_card_name() -> None:
    assert common.default_bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350.0
    assert common.default_bandwidth_gbs("NVIDIA H100 PCIe") == 2000.0
    assert common.default_bandwidth_gbs("NVIDIA H200") == 4800.0
    assert common.default_bandwidth_gbs("Some CPU") is None


def test_random_model_sizes_match_the_published_counts() -> None:
    """The random:* shapes must be the real models': Qwen2.5-0.5B has 494M, 1.5B 1.54B and 3B 3.09B parameters
    (tied), 7B 7.62B (untied), as their model cards count them."""
    import torch
    from transformers import Qwen2Config

    expected = {
        "qwen2.5-0.5b": 494_032_768,
        "qwen2.5-1.5b": 1_543_714_304,
        "qwen2.5-3b": 3_085_938_688,
        "qwen2.5-7b": 7_615_616_512,
    }
    for arch, count in expected.items():
        config = Qwen2Config(**({"tie_word_embeddings": True} | common.RANDOM_ARCHS[arch]))
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == count, arch


def test_rollout_bench_tiny(tmp_path: Path) -> None:
    rollout = load_bench("rollout")
    out = tmp_path / "rollout.json"
    rollout.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--batch",
            "3",
            "--turns",
            "2",
            "--new-tokens",
            "4",
            "--baseline-trajectories",
            "1",
            "--passages",
            "300",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    engine, baseline = data["rows"]
    assert engine["mode"] == "dynamic" and baseline["mode"] == "baseline"
    assert engine["trajectories"] == 3 and baseline["trajectories"] == 1
    # The engine batches a turn of all trajectories into one generate call; the baseline makes one per turn each.
    assert engine["generate_calls"] <= 2
    assert baseline["generate_calls"] == round(baseline["turns_mean"] * baseline["trajectories"])
    for row in (engine, baseline):
        assert 0 < row["generated_tokens"] <= row["trajectories"] * 2 * 4
        assert row["tokens_per_s"] == pytest.approx(row["generated_tokens"] / row["wall_s"], rel=1e-3)
        assert row["decode_steps"] <= row["generate_calls"] * 4


def test_train_step_bench_tiny_sleuth(tmp_path: Path) -> None:
    train_step = load_bench("train_step")
    out = tmp_path / "train.json"
    train_step.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--prompts",
            "2",
            "--n",
            "2",
            "--new-tokens",
            "4",
            "--steps",
            "1",
            "--warmup-steps",
            "1",
            "--passages",
            "300",
            "--variants",
            "sleuth",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["status"] == "ok", row
    assert row["measured_steps"] == 1
    assert row["step_s"] >= row["generate_s"] + row["update_s"] > 0
    assert 0 < row["tokens_per_trajectory"] <= 4
    assert row["peak_memory_gib"] > 0
    # The trainer ran in a fresh process: the GPU image lacks these, so the bench must not import them.
    loaded = data["details"]["sleuth"]["modules_loaded"]
    assert not {"faiss", "fastapi", "sentence_transformers", "trl"} & set(loaded), loaded


def test_scale_step_bench_one_vs_two_processes(tmp_path: Path) -> None:
    scale_step = load_bench("scale_step")
    out = tmp_path / "scale.json"
    scale_step.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--gpus",
            "1",
            "2",
            "--parallel",
            "ddp",
            "--prompts",
            "2",
            "--n",
            "2",
            "--turns",
            "1",
            "--new-tokens",
            "4",
            "--steps",
            "1",
            "--passages",
            "300",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gpus"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok")], rows
    assert [r["trajectories_per_rank"] for r in rows] == [4, 2]  # the global batch is split, not repeated
    assert rows[0]["speedup_vs_1"] == 1.0
    assert all(r["step_s"] >= r["rollout_s"] > 0 for r in rows)


def test_scale_step_rejects_a_rank_count_that_splits_groups() -> None:
    scale_step = load_bench("scale_step")
    with pytest.raises(SystemExit, match="must divide --prompts"):
        scale_step.parse_args(["--gpus", "1", "3", "--prompts", "4"])


def test_bench_scripts_name_a_flag_below_one() -> None:
    for name, argv, flag in (
        ("train_step", ["--steps", "0"], "--steps"),
        ("rollout", ["--new-tokens", "0"], "--new-tokens"),
        ("scale_step", ["--micro", "0"], "--micro"),
    ):
        with pytest.raises(SystemExit, match=f"{flag} must be >= 1, got 0"):
            load_bench(name).parse_args(argv)


def _write_metrics(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_learning_reward_slope_by_hand(tmp_path: Path) -> None:
    learning = load_bench("learning")
    # rewards 0.2, 0.3, 0.5, 0.6 at steps 1-4: x mean 2.5, y mean 0.4; Sxy = (-1.5)(-0.2) + (-0.5)(-0.1)
    # + (0.5)(0.1) + (1.5)(0.2) = 0.7, Sxx = 5: slope 0.14, intercept 0.05. Residuals 0.01, -0.03, 0.03, -0.01
    # -> SSE 0.002; stderr = sqrt(0.002 / 2 / 5) = 0.0141421; t(0.975, 2) = 4.302653 -> half-width 0.060849.
    # The kept-groups mean (reward/mean) is ignored when the before-filter mean is logged.
    rows = [
        {"step": s, "reward/mean": 0.5, "reward/mean_before_filter": r, "accuracy/em": r}
        for s, r in zip((1, 2, 3, 4), (0.2, 0.3, 0.5, 0.6), strict=True)
    ]
    slope = learning.reward_slope(_write_metrics(tmp_path / "m.jsonl", rows))
    assert slope["reward"] == "reward/mean_before_filter"
    assert slope["slope"] == pytest.approx(0.14)
    assert slope["ci"] == pytest.approx([0.14 - 0.060849, 0.14 + 0.060849], abs=1e-5)
    assert slope["first"] == pytest.approx(1.0 / 3) and slope["last"] == pytest.approx(1.4 / 3)
    assert "per_stage" not in slope
    assert "em_slope" not in slope  # groups were filtered out of the logged accuracy: no stage-free slope


def test_learning_reward_slope_per_stage(tmp_path: Path) -> None:
    learning = load_bench("learning")
    # stage 1 rises by 0.1 a step from 1.0, stage 2 (a reward on another scale) by 0.05 from 0.2
    rows = [
        {"step": s, "stage": 1, "reward/mean": 1.0 + 0.1 * (s - 1), "accuracy/em": 0.5} for s in (1, 2, 3)
    ]
    rows += [
        {"step": s, "stage": 2, "reward/mean": 0.2 + 0.05 * (s - 4), "accuracy/em": 0.5} for s in (4, 5, 6, 7)
    ]
    slope = learning.reward_slope(_write_metrics(tmp_path / "m.jsonl", rows))
    assert slope["reward"] == "reward/mean"
    assert slope["per_stage"]["1"]["slope"] == pytest.approx(0.1)
    assert slope["per_stage"]["2"]["slope"] == pytest.approx(0.05)
    assert slope["per_stage"]["2"]["first_step"] == 4
    assert slope["slope"] < 0  # across the switch the raw reward falls: why stages get their own slopes
    assert slope["em_slope"]["slope"] == pytest.approx(0.0, abs=1e-12)
    assert learning.reward_slope(_write_metrics(tmp_path / "short.jsonl", rows[:2])) is None


def test_learning_rl_steps_override(monkeypatch: pytest.MonkeyPatch) -> None:
    learning = load_bench("learning")
    size = learning.Size()
    monkeypatch.setenv("LEARN_RL_STEPS", "r_search=20,qagent=12")
    assert learning.rl_steps("r_search", size) == 20
    assert learning.rl_steps("qagent", size) == 12
    assert learning.rl_steps("s3", size) == size.rl_steps
    monkeypatch.delenv("LEARN_RL_STEPS")
    assert learning.rl_steps("r_search", size) == size.rl_steps


def test_learning_validation_size_override(monkeypatch: pytest.MonkeyPatch) -> None:
    learning = load_bench("learning")
    assert (learning.run_size(False).val_examples, learning.run_size(False).val_every) == (200, 10)
    monkeypatch.setenv("LEARN_VAL_EXAMPLES", "300")
    monkeypatch.setenv("LEARN_VAL_EVERY", "5")
    size = learning.run_size(False)
    assert (size.val_examples, size.val_every, size.rl_steps) == (300, 5, learning.Size().rl_steps)
    assert learning.run_size(True).passages == learning.CPU_SIZE.passages


def test_learning_validation_reward_pairs_first_and_last(tmp_path: Path) -> None:
    learning = load_bench("learning")
    assert learning.validation_reward(tmp_path) is None  # a run without data.dev
    (tmp_path / "validation").mkdir()
    rewards = {0: [0.0, 1.0, 0.0], 10: [1.0, 1.0, 0.0], 20: [1.0, 1.0, 1.0]}
    for step, values in rewards.items():
        rows = [{"id": f"q{i}", "reward": r} for i, r in enumerate(values)]
        (tmp_path / "validation" / f"step_{step:06d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
        with open(tmp_path / "validation.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "val/reward/mean": sum(values) / 3, "val/stage": 1.0}) + "\n")
    result = learning.validation_reward(tmp_path)
    assert result["steps"] == [0, 10, 20] and result["n"] == 3
    assert result["means"] == pytest.approx([1 / 3, 2 / 3, 1.0])
    # per question +1, 0, +1: mean 2/3. A resample of the three is all 0 with probability 1/27 (3.7% > 2.5%)
    # and all +1 with probability 8/27 (29.6%), so the 95% percentile interval is [0, 1]
    change = result["change"]
    assert change["diff"] == pytest.approx(2 / 3) and change["ci"] == pytest.approx([0.0, 1.0])


def test_learning_eval_off_runs_training_stages_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    learning = load_bench("learning")
    ran: list[str] = []
    monkeypatch.setattr(
        learning, "stage", lambda out, name, fn, *args: ran.append(name) or {"checkpoint": "c"}
    )
    learning.run_job(tmp_path, "r_search:full", "m", learning.CPU_SIZE, None)
    assert ran == [
        "r_search_trajectories",
        "r_search_full_sft",
        "r_search_full_eval_sft",
        "r_search_full_rl",
        "r_search_full_eval_rl",
    ]
    ran.clear()
    monkeypatch.setenv("LEARN_EVAL", "0")
    learning.run_job(tmp_path, "r_search:full", "m", learning.CPU_SIZE, None)
    assert ran == ["r_search_trajectories", "r_search_full_sft", "r_search_full_rl"]


def test_decode_bench_tiny(tmp_path: Path) -> None:
    """bench/decode.py runs the engine end to end and books bytes per step from its own arithmetic."""
    decode = load_bench("decode")
    out = tmp_path / "decode.json"
    decode.main(
        [
            "--models",
            "tiny",
            "--device",
            "cpu",
            "--batches",
            "3",
            "--context",
            "16",
            "--new-tokens",
            "6",
            "--out",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 3 and row["steps_per_s"] > 0
    # weights once + every row's live keys/values at the mean length (16 + 7/2 tokens)
    assert row["bytes_per_step"] == int(
        row["weight_bytes_per_step"] + 3 * (16 + 3.5) * row["kv_bytes_per_token"]
    )


def test_paper_scale_rehearsal_tiny(tmp_path: Path) -> None:
    """bench/paper_scale.py trains one step under torchrun with the rehearsal loop: every turn ends in a search
    (the scripted query), the step split and the 1,000 x 512 projection are reported, and a rerun resumes."""
    paper = load_bench("paper_scale")
    out, work = tmp_path / "paper.json", tmp_path / "work"
    argv = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--gpus",
        "1",
        "--prompts",
        "2",
        "--n",
        "2",
        "--turns",
        "2",
        "--new-tokens",
        "6",
        "--max-obs-tokens",
        "24",
        "--steps",
        "1",
        "--micro",
        "2",
        "--passages",
        "300",
        "--work",
        str(work),
        "--out",
        str(out),
    ]
    paper.main(argv)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row.get("log_tail")
    assert row["retrievals_per_trajectory"] == 2.0  # one scripted search per turn
    assert row["update_s"] > 0 and row["rollout_s"] > 0
    # the update's passes and optimizer step are parts of it; the first and slowest micro-batch bound the mean
    assert 0 < row["micro_batches_s"] + row["optimizer_s"] < row["update_s"]
    assert (
        row["micro_batch_s"] <= row["micro_batch_max_s"]
        and row["micro_batch_first_s"] <= row["micro_batch_max_s"]
    )
    assert row["micro_batches_s"] == pytest.approx(row["micro_batch_s"] * row["micro_batches_per_minibatch"])
    # the rollout's searches: 2 prompts x 2 samples share a question, so 2 distinct queries a turn, 2 turns
    assert row["retrieval_queries_per_step"] == 4.0
    assert 0 < row["retrieval_s"] < row["rollout_s"]
    assert row["retrieval_share_of_rollout"] == pytest.approx(row["retrieval_s"] / row["rollout_s"])
    assert row["projected_hours_1000_steps_512_prompts"] == pytest.approx(
        1000 * 512 * 5 / row["trajectories_per_s"] / 3600
    )
    paper.main(argv)  # measured before: kept, not rerun
    assert json.loads(out.read_text())["rows"][0]["wall_s"] == row["wall_s"]


def test_paper_scale_search_r1_late_shape_tiny(tmp_path: Path) -> None:
    """--shape search-r1-late (issue 43 item 7): 2-3 turns drawn per trajectory (ragged across the batch), every
    turn but the last searching, 48 new tokens a turn; the row carries the shape and the update's counters."""
    paper = load_bench("paper_scale")
    out = tmp_path / "late.json"
    paper.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--gpus",
            "1",
            "--prompts",
            "2",
            "--n",
            "4",
            "--steps",
            "1",
            "--micro",
            "4",
            "--micro-tokens",
            "4096",
            "--passages",
            "300",
            "--shape",
            "search-r1-late",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row.get("log_tail")
    assert row["shape"] == "search-r1-late" and row["turns"] == 3 and row["new_tokens_per_turn"] == 48
    assert (
        1.0 < row["retrievals_per_trajectory"] < 2.0
    )  # one or two searches: turn counts differ in the batch
    assert 96 <= row["policy_tokens_per_trajectory"] <= 144
    assert row["update_tokens_per_s_per_gpu"] > 0 and row["micro_batches_per_minibatch"] >= 1
    assert row["recipe"]["algorithm"]["micro_batch_tokens"] == 4096


def test_paper_scale_weak_scaling_grows_the_global_batch_with_the_gpus() -> None:
    """--prompts-per-gpu P gives every configuration P prompts per GPU; without it every configuration takes the
    same global --prompts."""
    paper = load_bench("paper_scale")
    weak = paper.parse_args(["--model", "tiny", "--gpus", "1", "2", "4", "--prompts-per-gpu", "3"])
    assert [paper.config_args(weak, g).prompts for g in (1, 2, 4)] == [3, 6, 12]
    strong = paper.parse_args(["--model", "tiny", "--gpus", "1", "4", "--prompts", "8"])
    assert [paper.config_args(strong, g).prompts for g in (1, 4)] == [8, 8]
    with pytest.raises(SystemExit):
        paper.parse_args(["--prompts-per-gpu", "0"])


def test_paper_scale_overlap_sets_the_recipe_and_reports_the_overlapped_steps() -> None:
    """--overlap one_step_async reaches the recipe; the row's steady step is the mean over the steps that rolled
    the next step out during their update (they log time/overlap_wait), set against max(rollout, update)."""
    paper = load_bench("paper_scale")
    args = paper.parse_args(["--model", "tiny", "--overlap", "one_step_async", "--steps", "3"])
    shared = {"model_dir": "m", "train": "t.jsonl", "index": "i", "model": "tiny"}
    assert paper.recipe_for(args, shared, Path("out"), "cpu", 1)["trainer"]["overlap"] == "one_step_async"
    step = {"time/rollout": 2.0, "time/reward": 0.0, "time/update": 3.0}
    lines = [
        {"step": 1, "time/step": 9.0, **step},
        {"step": 2, "time/step": 3.5, "time/overlap_wait": 0.5, "rollout/staleness": 1.0, **step},
        {"step": 3, "time/step": 3.1, "time/overlap_wait": 0.1, "rollout/staleness": 1.0, **step},
        {"step": 4, "time/step": 3.0, "rollout/staleness": 1.0, **step},  # the last: nothing to roll out
    ]
    row = paper.summarise(args, lines, 1)
    assert row["overlapped_step_s"] == pytest.approx(3.3) and row["overlap_wait_s"] == pytest.approx(0.3)
    assert row["step_over_max_rollout_update"] == pytest.approx(3.3 / 3.0) and row["staleness"] == 1.0


def test_rollout_bench_engine_row_splits_prefill_from_decode(tmp_path: Path) -> None:
    """The engine row says how much of the time inside generate went to prefills (CPU: the engine runs eagerly,
    so no graph is captured and none fails)."""
    rollout = load_bench("rollout")
    out = tmp_path / "rollout.json"
    rollout.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--batch",
            "3",
            "--turns",
            "2",
            "--new-tokens",
            "4",
            "--modes",
            "engine",
            "--baseline-trajectories",
            "0",
            "--passages",
            "300",
            "--out",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "engine" and row["graph_failures"] == 0
    assert 0 < row["prefill_s"] < row["generate_s"]
    assert row["prefill_share_of_generate"] == pytest.approx(row["prefill_s"] / row["generate_s"], rel=1e-3)


def test_stop_check_cost_bench_tiny(tmp_path: Path) -> None:
    """bench/stop_check_cost.py times both stop-check paths (the tiny tokenizer when the Qwen one is absent)."""
    bench = load_bench("stop_check_cost")
    out = tmp_path / "stop.json"
    bench.main(
        [
            "--tokenizer",
            str(tmp_path / "absent"),
            "--rows",
            "4",
            "--chunk",
            "3",
            "--chunks",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert [r["path"] for r in result["rows"]] == [
        "tails after every token",
        "tails after tokens that may end a stop",
    ]
    assert all(r["ms_per_chunk_median"] > 0 for r in result["rows"]) and result["tokenizer_size"] > 0


def test_claims_figure_groups_em_and_retrievals_by_type_and_draws_the_retrieval_panel(tmp_path: Path) -> None:
    """bench/claims_figure.py: the per-type means by hand (EM and, for the staged claim, retrievals per question),
    and a three-panel figure from a claim folder laid out as committed."""
    figure = load_bench("claims_figure")
    rows = [
        {"dataset": "all-known", "em": 1.0, "retrieval_count": 1},
        {"dataset": "all-known", "em": 0.0, "retrieval_count": 3},
        {"dataset": "mixed", "em": 1.0, "retrieval_count": 2},
    ]
    em = figure.em_by_type(rows)
    counts = figure.em_by_type(rows, "retrieval_count")
    assert list(em) == ["all-known", "mixed", "all"]  # "all" last
    assert em["all-known"][0] == 0.5 and em["all-known"][3] == 2 and em["all"][0] == 2 / 3
    assert counts["all-known"][0] == 2.0 and counts["mixed"][0] == 2.0 and counts["all"][0] == 2.0
    run = tmp_path / "run"
    for arm in ("staged", "search_r1"):
        (run / arm).mkdir(parents=True)
        (run / arm / "per_question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / arm / "metrics.jsonl").write_text(json.dumps({"step": 1, "retrieval_count": 2.0}) + "\n")
    (run / "report.json").write_text(
        json.dumps({"arms": ["staged", "search_r1"], "claim": {"method": "staged"}})
    )
    summary = figure.draw(run, ["retrieval_count"], tmp_path / "fig.png", retrievals=True)
    assert set(summary) == {"staged", "search_r1"} and (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def _prediction(qid: str, dataset: str, em: float, served: list[tuple[str, str]], rc: int = 2) -> dict:
    return {
        "id": qid,
        "dataset": dataset,
        "prediction": "p",
        "golden_answers": ["Oslo"],
        "retrieval_count": rc,
        "metrics": {"em": em, "cover_em": em, "f1": em},
        "trajectory": {"served_context": [{"doc_id": d, "title": "t", "text": text} for d, text in served]},
    }


def test_claims_pack_rows_and_the_why_analysis_by_hand(tmp_path: Path) -> None:
    """bench/claims_pack.py: a prediction's supporting passages served and answer found, by hand; pack refuses a
    world whose sha256 differs from the run's record; why's means and its split by support served, by hand; the
    curve and per-type figures from the packed folder."""
    pack = load_bench("claims_pack")
    support = {"a": ["1", "2"], "b": ["3"], "c": ["4", "5"]}
    prediction = _prediction("a", "2hop", 1.0, [("1", "capital Oslo"), ("9", "x")])
    prediction["trajectory"]["retrieved"] = [[{"doc_id": "1"}, {"doc_id": "2"}], [{"doc_id": "9"}]]
    row = pack.per_question(prediction, support)
    assert row["served_docs"] == 2 and row["support_served"] == 0.5 and row["answer_in_served"] == 1.0
    assert row["support_retrieved"] == 1.0  # "2" was retrieved but not served: a selection left it out
    assert pack.per_question(_prediction("b", "1hop", 0.0, []), support)["support_served"] == 0.0
    assert "unknown_support_retrieved" not in row  # a world without a knowledge boundary
    assert "agent_answer" not in row and row["metrics"] == prediction["metrics"]
    handed = {
        **prediction,
        "extra": {"agent_answer": "Oslo, I think"},
    }  # a reader answered for the agent (qagent)
    assert pack.per_question(handed, support)["agent_answer"] == "Oslo, I think"
    # a knowledge-boundary world: hop 1 ("1") known, hop 2 ("2") not; a search that found only "2" has all it needs
    mixed = _prediction("a", "mixed", 1.0, [("2", "Oslo")], rc=1)
    mixed["trajectory"]["retrieved"] = [[{"doc_id": "2"}, {"doc_id": "7"}]]
    boundary = pack.per_question(mixed, support, {"a": [True, False], "b": [True]})
    assert boundary["support_retrieved"] == 0.5 and boundary["unknown_support_retrieved"] == 1.0
    assert (
        pack.per_question(_prediction("b", "all-known", 1.0, [], rc=0), support, {"b": [True]})[
            "unknown_support_retrieved"
        ]
        is None
    )  # nothing unknown to find
    assert pack.per_question(mixed, support, {"a": [False, False]})["unknown_support_retrieved"] == 0.5
    # a run as `sleuth reproduce` lays it out: an evaluation, an RL arm, its world record
    run, world = tmp_path / "runs" / "s3", tmp_path / "world"
    world.mkdir(parents=True)
    (world / "test.jsonl").write_text(
        "".join(json.dumps({"id": q, "metadata": {"supporting_ids": s}}) + "\n" for q, s in support.items())
    )
    (run / "stages").mkdir(parents=True)
    (run / "stages" / "world.json").write_text("{}")
    (run / "report.json").write_text("{}")
    for name, preds in (
        (
            "s3_4",
            [
                _prediction("a", "2hop", 1.0, [("1", ""), ("2", "Oslo")]),
                _prediction("b", "1hop", 0.0, [("3", "")]),
                _prediction("c", "2hop", 0.0, [("4", "")], rc=4),
            ],
        ),
        ("s3_16", [_prediction(q, "2hop", 1.0, [(d, "") for d in "12345"]) for q in support]),
    ):
        (run / "eval" / name / "s3").mkdir(parents=True)
        (run / "eval" / name / "s3" / "predictions.jsonl").write_text(
            "".join(json.dumps(p) + "\n" for p in preds)
        )
        (run / "eval" / name / "summary.json").write_text("{}")
        (run / name / "train").mkdir(parents=True)
        (run / name / "rl_recipe.yaml").write_text("algo: grpo\n")
        (run / name / "train" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    from sleuth.utils import sha256_file

    for name in ("corpus.jsonl", "train.jsonl"):
        (world / name).write_text("{}\n")
    digests = {name: sha256_file(world / name) for name in ("corpus.jsonl", "train.jsonl", "test.jsonl")}
    record = tmp_path / "claim_world.json"
    record.write_text(json.dumps({"files": {**digests, "test.jsonl": "0" * 64}}))
    dest = tmp_path / "packed"
    with pytest.raises(SystemExit, match="test.jsonl differ"):
        pack.pack(run, dest, world, None, record)
    record.write_text(json.dumps({"files": digests}))
    hidden = run / "eval" / "s3_4" / "s3" / "predictions.jsonl"
    hidden.rename(hidden.with_suffix(".bak"))  # as in claims.tgz, which leaves predictions out
    with pytest.raises(SystemExit, match="no \\*/predictions.jsonl beside summary.json"):
        pack.pack(run, tmp_path / "unpacked", world, None, record)
    hidden.with_suffix(".bak").rename(hidden)
    assert pack.pack(run, dest, world, None, record) == ["s3_16", "s3_4"]
    assert (dest / "s3_4" / "metrics.jsonl").exists() and (dest / "s3_4" / "rl_recipe.yaml").exists()
    # a second training seed (`--seeds 2`) lies in RUN/seed1: packed beside the first, under seed1/
    seeded = tmp_path / "seeded"
    shutil.copytree(run, seeded)
    shutil.copytree(run / "eval", seeded / "seed1" / "eval")
    assert pack.pack(seeded, tmp_path / "packed_seeds", world, None, record) == [
        "s3_16",
        "s3_4",
        "seed1/s3_16",
        "seed1/s3_4",
    ]
    assert (tmp_path / "packed_seeds" / "seed1" / "s3_4" / "per_question.jsonl").read_text() == (
        dest / "s3_4" / "per_question.jsonl"
    ).read_text()
    analysis = pack.why(dest)
    small = analysis["s3_4"]
    # a: both supporting served, EM 1; b: its one served, EM 0; c: one of two served, EM 0
    assert small["all"]["em"]["mean"] == pytest.approx(1 / 3) and small["all"]["retrievals"]["mean"] == 8 / 3
    assert small["all"]["all_support_served"]["mean"] == pytest.approx(2 / 3)
    assert small["all"]["all_support_retrieved"]["mean"] == 0.0  # these predictions record no searches
    assert small["all"]["em_when_all_support_served"]["mean"] == 0.5
    assert (
        small["all"]["em_when_all_support_served"]["n"] == 2 and small["all"]["em_otherwise"]["mean"] == 0.0
    )
    assert small["2hop"]["em"]["n"] == 2 and small["1hop"]["em_otherwise"]["n"] == 0
    assert small["all"]["searched"]["mean"] == 1.0 and small["all"]["all_unknown_support_retrieved"]["n"] == 0
    assert (
        analysis["s3_16"]["all"]["all_support_served"]["mean"] == 1.0
    )  # every passage served to every question
    assert "| s3_4 | all | 33.3" in pack.markdown(analysis)
    figure = load_bench("claims_figure")
    curve = figure.draw_curve(dest, tmp_path / "curve.png")
    assert curve == {"s3": [(4, pytest.approx(1 / 3), pytest.approx(2 / 3)), (16, 1.0, 1.0)]}
    by_type = figure.draw_types(dest, ["s3_4", "s3_16"], "em", tmp_path / "types.png")
    assert by_type["s3_4"]["2hop"] == 0.5 and (tmp_path / "types.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="no evaluation s3_99"):
        figure.draw_types(dest, ["s3_99"], "em", tmp_path / "x.png")


def test_tree_grpo_budget_compares_at_grpo_budget_by_hand() -> None:
    bench = load_bench("tree_grpo_budget")
    grpo = {
        "trajectories": 8.0,
        "generated_tokens": 1000.0,
        "tool_calls": 12.0,
        "trajectories_per_1k_tokens": 8.0,
        "tool_calls_per_1k_tokens": 12.0,
        "tool_calls_per_trajectory": 1.5,
    }
    tree = {
        "trajectories": 10.0,
        "generated_tokens": 800.0,
        "tool_calls": 8.0,
        "trajectories_per_1k_tokens": 12.5,
        "tool_calls_per_1k_tokens": 10.0,
        "tool_calls_per_trajectory": 0.8,
    }
    bench.compare(grpo, tree)
    # at GRPO's 1000 tokens the tree gives 10 x 1000 / 800 = 12.5 trajectories and 8 x 1.25 = 10 tool calls
    assert tree["trajectories_at_grpo_budget"] == 12.5 and tree["tool_calls_at_grpo_budget"] == 10.0
    assert (
        tree["trajectories_per_1k_tokens_vs_grpo"] == 12.5 / 8
        and tree["tool_calls_per_trajectory_vs_grpo"] == 0.8 / 1.5
    )
    assert grpo["trajectories_at_grpo_budget"] == 8.0


def test_tree_grpo_budget_bench_tiny_on_the_decode_engine(tmp_path: Path) -> None:
    from plugin_install import installed

    bench = load_bench("tree_grpo_budget")
    out = tmp_path / "tree.json"
    with installed("sleuth_tree_grpo"):
        bench.main(
            [
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--cache",
                "engine",
                "--questions",
                "2",
                "--n",
                "3",
                "--trees",
                "2",
                "--expansions",
                "1",
                "--branches",
                "2",
                "--max-turns",
                "3",
                "--new-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
    grpo, tree = json.loads(out.read_text())["rows"]
    assert grpo["trajectories"] == 2 * 3 and 2 * 2 < tree["trajectories"] <= 2 * 2 * (1 + 2)
    # the rehearsal loop searches in every turn but its last: each trajectory runs 0..2 of its own searches
    assert (
        0 < grpo["tool_calls"] <= 2 * grpo["trajectories"] and tree["tool_calls"] <= 2 * tree["trajectories"]
    )
    assert 0 < tree["generated_tokens"] <= tree["trajectories"] * 3 * 4
    assert tree["prefix_tokens_reused"] > 0  # branches continued from their parents' keys/values
    assert tree["trajectories_per_1k_tokens"] == pytest.approx(
        1000 * tree["trajectories"] / tree["generated_tokens"]
    )
