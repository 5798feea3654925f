"""HTML report: pure helpers against hand-computed values, and full pages built from synthetic runs."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest

from sleuth.agent.trajectory import Trajectory, Turn
from sleuth.errors import ConfigError, DataFormatError
from sleuth.eval.report import (
    best_indices,
    build_report,
    column_decimals,
    dodge,
    ema_smooth,
    highlight_text,
    order_metrics,
    smoothing_weight,
)
from sleuth.rewards.metrics import aggregate, exact_match, f1_score

MALICIOUS = "<script>alert('pwned')</script><img src=x onerror=alert(1)>"

# ----------------------------------------------------------------------------
# Synthetic run directories
# ----------------------------------------------------------------------------

QUESTIONS = [
    ("q1", "Who wrote the novel Dune?", ["Frank Herbert"], "nq"),
    ("q2", "What is the capital of Australia?", ["Canberra"], "nq"),
    ("q3", "Which river flows through Cairo?", ["Nile", "River Nile"], "hotpotqa"),
]
ANSWERS = {
    "s3": ["Frank Herbert", "Sydney", "the Nile"],
    "search_r1": ["Isaac Asimov", "Canberra", "Amazon"],
}


def make_trajectory(qid: str, question: str, golds: list[str], method: str, answer: str | None) -> Trajectory:
    hits = [
        {"doc_id": f"{qid}-d1", "title": f"Title of {qid} <b>bold</b>", "text": f"About {golds[0]}. {MALICIOUS}", "score": 12.5},
        {"doc_id": f"{qid}-d2", "title": "Unrelated page", "text": "Nothing relevant & nothing useful.", "score": 3.25},
    ]  # fmt: skip
    policy_1 = f"<think>I should look this up.</think><search>{question}</search>"
    env_1 = (
        "<information>"
        + "\n".join(f"Doc {i}(Title: {h['title']}) {h['text']}" for i, h in enumerate(hits, 1))
        + "</information>"
    )
    policy_2 = f"<answer>{answer}</answer>" if answer is not None else "I give up"
    text = policy_1 + env_1 + policy_2
    turns = [
        Turn(0, 10, "policy", policy_1),
        Turn(10, 40, "env", env_1),
        Turn(40, 45, "policy", policy_2),
    ]
    return Trajectory(
        question_id=qid,
        question=question,
        golden_answers=golds,
        method=method,
        turns=turns,
        prompt_text=f"Answer the question. Question: {question}",
        response_text=text,
        queries=[question],
        retrieved=[hits],
        selected=[hits[0]] if method == "s3" else [],
        evidence=f"{golds[0]} is stated in doc 1" if method == "search_r1" else None,
        answer=answer,
        retrieval_count=1,
        num_turns=2,
        finish_reason="answer" if answer is not None else "no_action",
        rewards={"total": 1.0 if answer and exact_match(answer, golds) else 0.0, "answer_f1": f1_score(answer, golds), "format": 0.2},
    )  # fmt: skip


def write_eval_dir(eval_dir: Path, answers: dict[str, list[str]], retrievals: dict[str, float]) -> dict:
    """Predictions + a summary computed from them with the shared `aggregate` (as the harness does)."""
    summary: dict = {"methods": {}, "config": {"retriever": "bm25", "generator": "tiny <model>"}}
    for method, preds in answers.items():
        records = []
        for (qid, question, golds, dataset), pred in zip(QUESTIONS, preds, strict=True):
            traj = make_trajectory(qid, question, golds, method, pred)
            records.append(
                {
                    "id": qid,
                    "question": question,
                    "golden_answers": golds,
                    "dataset": dataset,
                    "method": method,
                    "prediction": pred,
                    "metrics": {"em": exact_match(pred, golds), "f1": f1_score(pred, golds), "judge": None},
                    "retrieval_count": retrievals[method],
                    "input_tokens": 100,
                    "output_tokens": 20,
                    "latency_s": 0.5,
                    "trajectory": traj.to_dict(),
                }
            )
        (eval_dir / method).mkdir(parents=True, exist_ok=True)
        (eval_dir / method / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        flat = [
            {"dataset": r["dataset"], **r["metrics"], "retrieval_count": r["retrieval_count"]}
            for r in records
        ]
        summary["methods"][method] = aggregate(flat, ["em", "f1", "judge", "retrieval_count"])
    (eval_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def write_training_run(train_dir: Path, steps: int = 4) -> list[dict]:
    train_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in range(1, steps + 1):
        rows.append(
            {
                "step": s,
                "reward/mean": 0.1 * s,
                "reward/std": 0.05,
                "reward/answer_f1": 0.08 * s,
                "reward/format": 0.2,
                "accuracy/em": 0.05 * s,
                "retrieval_count": 1.0 + 0.25 * s,
                "turns": 2.0,
                "response_length/policy_tokens": 40.0 + s,
                "actor/kl": 0.001 * s,
                "actor/entropy": 1.5 - 0.1 * s,
                "actor/pg_loss": -0.01 * s,
                "actor/clipfrac": 0.0,
                "actor/grad_norm": 0.7,
                "time/rollout": 2.0,
                "time/reward": 0.5,
                "time/update": 1.5,
                "time/step": 4.25,
                "memory/device_in_use_gib": 20.0 + 0.1 * s,
                "memory/peak_allocated_gib": 8.0,
                "stage": 1.0 if s <= 2 else 2.0,
            }
        )
    (train_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "name": "search_r1_tiny",
        "model": {"policy": "tiny-qwen2"},
        "agent": {"loop": "search_r1"},
        "reward": {"name": "search_r1_em"},
        "algorithm": {"name": "grpo"},
        "trainer": {"total_steps": 10},
    }
    (train_dir / "run.json").write_text(json.dumps({"recipe": recipe, "model_path": "/m", "device": "cpu"}))
    (train_dir / "rollouts").mkdir(exist_ok=True)
    for s in (1, steps):
        trajs = [
            make_trajectory(
                "r1",
                "Who painted the Mona Lisa?",
                ["Leonardo da Vinci"],
                "search_r1",
                "Leonardo da Vinci" if s == steps else "Raphael",
            )
        ]
        (train_dir / "rollouts" / f"step_{s:06d}.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajs))  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("report") / "demo"
    write_training_run(run / "train")
    write_eval_dir(run / "eval_before", ANSWERS, {"s3": 2.0, "search_r1": 1.0})
    write_eval_dir(
        run / "eval_after",
        {
            "s3": ["Frank Herbert", "Canberra", "the Nile"],
            "search_r1": ["Frank Herbert", "Canberra", "Amazon"],
        },
        {"s3": 2.5, "search_r1": 1.5},
    )
    return run


# ----------------------------------------------------------------------------
# Pure helpers
# ----------------------------------------------------------------------------


def test_ema_smooth_is_debiased_weighted_mean_and_skips_nan():
    out = ema_smooth([1.0, 3.0, math.nan, 5.0], weight=0.5)
    # step 2: weights (0.5, 1) -> (0.5*1 + 3) / 1.5; step 4: weights (0.25, 0.5, 1) over 1, 3, 5
    assert out[0] == pytest.approx(1.0)
    assert out[1] == pytest.approx(3.5 / 1.5)
    assert math.isnan(out[2])
    assert out[3] == pytest.approx((0.25 * 1 + 0.5 * 3 + 5) / 1.75)
    assert ema_smooth([2.0, 4.0], 0.0) == [2.0, 4.0]
    with pytest.raises(ValueError, match="smoothing weight"):
        ema_smooth([1.0], 1.0)


def test_smoothing_weight_grows_with_run_length():
    assert smoothing_weight(5) == 0.0
    assert smoothing_weight(20) == pytest.approx(0.5)
    assert smoothing_weight(100) == pytest.approx(0.9)
    assert smoothing_weight(10_000) == 0.95


def test_best_indices_ties_direction_and_lone_values():
    assert best_indices([0.3, 0.5, None, 0.5], lower_is_better=False) == {1, 3}
    assert best_indices([0.3, 0.5, None, 0.5], lower_is_better=True) == {0}
    assert best_indices([0.3, None], lower_is_better=False) == set()
    assert best_indices([math.nan, 1.0, 2.0], lower_is_better=False) == {2}
    assert best_indices([0.5, 0.5, None], lower_is_better=False) == set()  # all tied: nothing stands out


def test_column_decimals_and_dodge():
    assert column_decimals([1.0, 2, None]) == 0
    assert column_decimals([0.5, 0.25]) == 4
    assert column_decimals([12.5, 3.0]) == 2
    assert column_decimals([116.0, 121.5]) == 1
    # three points on one spot spread to -step, 0, +step around it; a lone point stays put
    assert dodge([1.0, 1.0, 1.0, 2.0], [0.5, 0.5, 0.5, 0.5], step=0.1) == pytest.approx([0.9, 1.0, 1.1, 2.0])


def test_order_metrics_known_first_then_alphabetical_without_n():
    assert order_metrics(["zeta", "n", "f1", "em", "alpha", "latency_s"]) == [
        "em",
        "f1",
        "latency_s",
        "alpha",
        "zeta",
    ]


def test_highlight_text_escapes_every_segment_and_marks_tags_and_golds():
    text = "<script>x</script> Paris & <answer>paris</answer> Parisian"
    out = str(highlight_text(text, ["Paris"]))
    assert out == (
        '&lt;script&gt;x&lt;/script&gt; <mark class="gold">Paris</mark> &amp; '
        '<span class="tag">&lt;answer&gt;</span><mark class="gold">paris</mark>'
        '<span class="tag">&lt;/answer&gt;</span> Parisian'
    )
    # A gold answer that looks like an entity name must not break the escaping.
    assert str(highlight_text("a & b", ["amp"])) == "a &amp; b"
    long = highlight_text("x" * 50, (), max_chars=10)
    assert str(long).startswith("x" * 10 + "<span") and "40 more characters" in str(long)


# ----------------------------------------------------------------------------
# Full pages
# ----------------------------------------------------------------------------


def _table_rows(page: str, caption: str) -> dict[str, list[str]]:
    """Rows (label -> cell texts, best cells suffixed with '*') of the first table with this caption."""
    m = re.search(rf"<caption>{re.escape(caption)}</caption>(.*?)</table>", page, re.S)
    assert m, f"no table captioned {caption!r}"
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S):
        cells = re.findall(r"<td( class=\"best\")?>(.*?)</td>", row, re.S)
        if cells:
            rows[cells[0][1]] = [text + ("*" if best else "") for best, text in cells[1:]]
    return rows


def test_report_has_tables_plots_and_escaped_documents(demo_run: Path):
    out = build_report(demo_run, notes=["Two CPU steps cannot show learning; they show the pipeline runs."])
    assert out == demo_run / "report.html"
    page = out.read_text()

    # Header from run.json and metrics.jsonl
    assert "search_r1_tiny" in page and "tiny-qwen2" in page and "4 / 10" in page
    assert "Two CPU steps cannot show learning" in page

    # Plots: rewards, behaviour, optimisation, time, GPU memory, scatter; all embedded PNG, no external resources.
    plots = re.findall(r'data-plot="(\w+)"[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert {name for name, _ in plots} == {
        "rewards",
        "behaviour",
        "optimisation",
        "time",
        "memory",
        "scatter",
    }
    import base64

    assert all(base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n" for _, data in plots)
    assert not re.search(r'(src|href)="(https?:)?//', page)

    # Eval tables. eval_before: s3 gets Dune and "the Nile" (normalised to "nile") right -> 2/3;
    # search_r1 only Canberra -> 1/3. nq alone: 1/2 each (a tie of all rows: nothing marked).
    before = _table_rows(page.split("<h3>eval_before</h3>")[1], "overall")
    # columns: em, f1, judge, retrieval_count (lower is better); judge is all None -> "–"
    assert before["s3"][0] == "0.6667*" and before["search_r1"][0] == "0.3333"
    nq = _table_rows(page.split("<h3>eval_before</h3>")[1], "nq")
    assert nq["s3"][0] == "0.5000" and nq["search_r1"][0] == "0.5000"
    assert before["s3"][2] == "–"
    assert before["s3"][3] == "2" and before["search_r1"][3] == "1*"
    after = _table_rows(page.split("<h3>eval_after</h3>")[1], "overall")
    assert after["s3"][0] == "1.0000*" and after["search_r1"][0] == "0.6667"
    hotpot = _table_rows(page.split("<h3>eval_after</h3>")[1], "hotpotqa")
    assert hotpot["s3"][0] == "1*" and hotpot["search_r1"][0] == "0"
    comparison = _table_rows(page, "overall, all eval directories")
    assert comparison["eval_after · s3"][0] == "1.0000*"
    assert set(comparison) == {
        "eval_after · s3",
        "eval_after · search_r1",
        "eval_before · s3",
        "eval_before · search_r1",
    }

    # Trajectory viewer: 6 predictions per eval dir + 2 rollout files
    assert page.count('<details class="traj"') == 2 * 6 + 2
    assert page.count('data-correct="correct"') == 3 + 5 + 1  # before 3, after 5, last rollout step
    assert "Who wrote the novel Dune?" in page and "Title of q1 &lt;b&gt;bold&lt;/b&gt;" in page
    assert '<span class="pill sel">selected</span>' in page  # s3 kept doc 1
    assert '<pre class="text evidence">' in page  # search_r1 evidence block
    assert 'data-source="train · train step 4"' in page

    # The only script element is ours; document text arrives escaped.
    assert page.count("<script>") == 1 and page.count("<img") == len(plots)
    assert (
        "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in page
        or "&lt;script&gt;alert('pwned')" in page
    )
    assert "onerror=alert(1)>" not in page


def test_trajectory_cap_takes_from_every_source(demo_run: Path, tmp_path: Path):
    page = build_report(demo_run, out=tmp_path / "r.html", max_trajectories=5).read_text()
    assert page.count('<details class="traj"') == 5
    assert "Showing 5 of 14 records" in page
    sources = set(re.findall(r'<details class="traj" data-correct="\w+" data-source="([^"]+)"', page))
    assert len(sources) == 5  # round robin: 4 eval sources + first rollout file


def test_missing_sections_are_noted_not_fatal(tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    page = build_report(empty).read_text()
    assert "No training log" in page and "No evaluation summary" in page
    assert "No trajectories or per-question predictions" in page and "No method has both" in page
    assert "data:image/png" not in page

    # Eval dir with a summary but no predictions and no retrieval count; a foreign summary.json ignored.
    only_eval = tmp_path / "only_eval"
    (only_eval / "ev").mkdir(parents=True)
    (only_eval / "ev" / "summary.json").write_text(
        json.dumps({"methods": {"direct": {"overall": {"em": 0.25, "n": 4}}}})
    )
    (only_eval / "other").mkdir()
    (only_eval / "other" / "summary.json").write_text(json.dumps({"loss": 1.0}))
    page = build_report(only_eval).read_text()
    assert "No training log" in page and "0.25" in page and "No &lt;method&gt;/predictions.jsonl" in page
    assert "No method has both" in page

    # Training with only rewards logged (no run.json, no timing, no KL) and a half-written last line.
    train = tmp_path / "train_only"
    train.mkdir()
    (train / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n{"step": 3, "rew'
    )
    page = build_report(train).read_text()
    assert page.count('data-plot="rewards"') == 1 and 'data-plot="time"' not in page
    assert "Not logged by this run: accuracy / retrieval, KL / entropy / loss, time." in page
    assert "No run.json" in page and "ignored an incomplete last line" in page


def test_bad_inputs_raise_errors_naming_the_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_report(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(DataFormatError, match=r"metrics.jsonl:2: not valid JSON"):
        build_report(bad)
    (bad / "metrics.jsonl").write_text('{"reward/mean": 1}\n')
    with pytest.raises(DataFormatError, match="no integer 'step'"):
        build_report(bad)
    (bad / "metrics.jsonl").unlink()
    (bad / "summary.json").write_text(json.dumps({"methods": {"a": 3}}))
    with pytest.raises(DataFormatError, match="'methods' must map"):
        build_report(bad)


def test_cli_writes_report_and_exits_2_on_bad_dir(tmp_path: Path):
    from typer.testing import CliRunner

    from sleuth.cli import app

    run = tmp_path / "run"
    write_eval_dir(run / "eval", ANSWERS, {"s3": 2.0, "search_r1": 1.0})
    out = tmp_path / "cli.html"
    result = CliRunner().invoke(
        app,
        ["report", str(run), "--out", str(out), "--title", "My <run>", "--note", "first", "--note", "second"],
    )
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "<title>My &lt;run&gt;</title>" in page and "<p>first</p>" in page and "<p>second</p>" in page
    result = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "does not exist" in " ".join(result.output.split())


def test_dynamic_sampling_runs_show_the_reward_of_every_rollout():
    from sleuth.eval.report import filtered_steps
    from sleuth.rl.step_metrics import format_line

    base = {
        "retrieval_count": 1.0,
        "response_length/policy_tokens": 10.0,
        "time/rollout": 1.0,
        "time/reward": 0.0,
        "time/update": 1.0,
    }
    # DAPO kept the mixed groups (mean 0.5); over every rollout the policy scored 0.25
    filtered = {**base, "reward/mean": 0.5, "reward/mean_before_filter": 0.25}
    line = format_line(3, 10, filtered)
    assert "reward +0.250" in line and "(kept groups +0.500)" in line
    plain = {**base, "reward/mean": 0.5, "reward/mean_before_filter": 0.5}
    assert "reward +0.500" in format_line(3, 10, plain) and "kept groups" not in format_line(3, 10, plain)
    assert "reward +0.500" in format_line(3, 10, {**base, "reward/mean": 0.5})  # older metrics: one mean
    assert filtered_steps([plain, {"step": 2, **filtered}]) is True
    assert filtered_steps([plain, {**base, "reward/mean": 0.1}]) is False


def _write_validation(run_dir: Path, step: int, rewards: dict[str, float], stage: int = 1) -> None:
    (run_dir / "validation").mkdir(exist_ok=True)
    rows = [{"id": qid, "reward": r, "components": {}} for qid, r in rewards.items()]
    (run_dir / "validation" / f"step_{step:06d}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    with open(run_dir / "validation.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "val/reward/mean": sum(rewards.values()) / len(rewards),
                    "val/stage": float(stage),
                }
            )
            + "\n"
        )


def test_validation_change_pairs_questions_by_id_and_the_page_reports_it(tmp_path: Path):
    from sleuth.eval.report import discover, validation_change

    run = tmp_path / "run"
    write_training_run(run)
    _write_validation(run, 0, {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.5})
    _write_validation(run, 2, {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.5})
    # the last validation lists the questions in another order and adds one the first never asked
    _write_validation(run, 4, {"d": 1.0, "c": 0.5, "b": 1.5, "a": 0.5, "e": 9.0})
    data = discover(run)
    (training,) = data.training
    assert [v.step for v in training.validations] == [0, 2, 4]
    change = validation_change(training.validations)
    # every shared question gained exactly 0.5: the difference and both ends of its interval are 0.5
    assert change["n"] == 4 and change["first_step"] == 0 and change["last_step"] == 4
    assert change["diff"] == pytest.approx(0.5) and change["ci"] == pytest.approx([0.5, 0.5])
    assert change["first"] == pytest.approx(0.375) and change["last"] == pytest.approx(
        0.875
    )  # shared questions
    from sleuth.eval.report import render_report

    page = render_report(data)
    assert (
        "Validation reward (the same 4 data.dev questions, greedy): 0.375 after 0 updates → 0.875 after 4"
        in page
    )
    assert "paired difference +0.500 [+0.500, +0.500]" in page
    # steps 0/2/4 weigh the rewards -1/4, 0, +1/4; every shared question's slope is (last - first) / 4 = 0.125
    assert change["slope"]["per_step"] == pytest.approx(0.125) and change["slope"]["ci"] == pytest.approx(
        [0.125, 0.125]
    )
    assert change["slope"]["n"] == 4 and change["slope"]["steps"] == [0, 2, 4]
    assert "Slope over the 3 validations of this stage: +0.1250 per step [+0.1250, +0.1250]" in page


def test_validation_slope_is_the_least_squares_slope_of_the_means(tmp_path: Path):
    from scipy.stats import linregress

    from sleuth.eval.report import Validation, validation_slope

    rng = random.Random(3)
    ids = [f"q{i}" for i in range(30)]
    steps = [0, 5, 10, 20]
    validations = [Validation(s, ids, [rng.random() + 0.01 * s for _ in ids]) for s in steps]
    slope = validation_slope(validations)
    reference = linregress(steps, [v.mean for v in validations]).slope
    assert slope["per_step"] == pytest.approx(reference) and slope["n"] == 30
    assert slope["ci"][0] < slope["per_step"] < slope["ci"][1]
    assert validation_slope(validations[:2]) is None  # two points: the change, not a slope
    # a question one validation did not score is left out of every one
    validations[1] = Validation(5, ids[1:], validations[1].rewards[1:])
    assert validation_slope(validations)["n"] == 29


def test_a_validation_without_its_question_file_is_left_out_with_a_warning(tmp_path: Path):
    from sleuth.eval.report import discover, validation_change

    run = tmp_path / "run"
    write_training_run(run)
    _write_validation(run, 0, {"a": 0.0, "b": 1.0})
    _write_validation(run, 4, {"a": 1.0, "b": 1.0})
    (run / "validation" / "step_000004.jsonl").unlink()
    data = discover(run)
    assert [v.step for v in data.training[0].validations] == [0]
    assert validation_change(data.training[0].validations) is None
    assert any("step 4 has no per-question file" in w for w in data.warnings)


def test_validation_change_compares_validations_of_one_reward_stage(tmp_path: Path):
    from sleuth.eval.report import discover, validation_change

    run = tmp_path / "run"
    write_training_run(run)
    _write_validation(run, 0, {"a": 5.0, "b": 5.0})  # stage 1's reward: another scale
    _write_validation(run, 2, {"a": 0.0, "b": 1.0}, stage=2)
    _write_validation(run, 4, {"a": 1.0, "b": 1.0}, stage=2)
    change = validation_change(discover(run).training[0].validations)
    assert change["first_step"] == 2 and change["diff"] == pytest.approx(0.5)
    _write_validation(run, 6, {"a": 1.0, "b": 1.0}, stage=3)
    assert (
        validation_change(discover(run).training[0].validations) is None
    )  # one validation of the last stage: no change


def test_report_never_overwrites_a_claim_report(tmp_path: Path):
    from typer.testing import CliRunner

    from sleuth.cli import app

    run = tmp_path / "claims"
    write_training_run(run / "arm_a")
    # the head of the page `sleuth reproduce` writes to OUT/report.html (sleuth.claims.report.write_report)
    claim_page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>sleuth reproduce staged: holds</title>"
        "</head><body><div class='banner' id='verdict'>The claim holds.</div></body></html>\n"
    )
    (run / "report.html").write_text(claim_page)
    out = build_report(run)
    assert out == run / "sleuth_report.html" and (run / "report.html").read_text() == claim_page
    assert build_report(run) == out  # its own page it overwrites
    with pytest.raises(
        ConfigError, match=r"report.html exists and was not written by `sleuth report`.*--out"
    ):
        build_report(run, out=run / "report.html")
    assert (run / "report.html").read_text() == claim_page
    result = CliRunner().invoke(app, ["report", str(run)], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "sleuth_report.html" in result.output and "kept" in result.output
    result = CliRunner().invoke(
        app, ["report", str(run), "--out", str(run / "report.html")], terminal_width=400
    )
    assert result.exit_code == 2 and "not written by `sleuth report`" in result.output
    assert (run / "report.html").read_text() == claim_page
    # a directory whose report.html is sleuth report's own keeps being written there
    plain = tmp_path / "plain"
    write_training_run(plain)
    assert build_report(plain) == plain / "report.html" and build_report(plain) == plain / "report.html"
