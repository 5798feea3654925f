"""`sleuth reproduce`: the registered claims, the staged claim table, resumable stages, the CPU run."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sleuth.appendlog import read_appended
from sleuth.claims.registry import CLAIMS, get_claim
from sleuth.claims.runner import ClaimRun, reproduce
from sleuth.claims.staged import claim_table
from sleuth.claims.stages import run_seeds, stage, write_claim_file
from sleuth.claims.stats import metric, own_answer_cover_em
from sleuth.claims.stats import paired_on as _paired_on
from sleuth.claims.steps import Arm, arm_recipe, arm_rl_recipe, setting
from sleuth.cli import app
from sleuth.errors import ConfigError
from sleuth.eval.stats import paired_bootstrap
from sleuth.rewards.metrics import cover_exact_match


def _read_predictions(path: str) -> dict[str, dict]:
    return {r["id"]: r for r in read_appended(path).records}


def _claim_run(out, method: str, seed: int = 0, base_seed: int | None = None) -> ClaimRun:
    spec = get_claim(method)
    return ClaimRun(
        out=out,
        spec=spec,
        profile_name="cpu",
        profile=spec.profile("cpu"),
        seed=seed,
        base_seed=seed if base_seed is None else base_seed,
    )


def _preds(rows: list[tuple[str, str, int, float]]) -> dict[str, dict]:
    return {
        qid: {"id": qid, "knowledge": kind, "retrieval_count": rc, "metrics": {"em": em}}
        for qid, kind, rc, em in rows
    }


def test_help_lists_the_four_claims():
    result = CliRunner().invoke(app, ["reproduce", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for method in ("staged", "r_search", "qagent", "s3"):
        assert re.search(rf"^\W*{method}\s", result.output, re.M), method
    assert "not implemented" not in result.output.lower()
    assert set(CLAIMS) == {"staged", "r_search", "qagent", "s3"}
    for claim in (spec.text for spec in CLAIMS.values()):
        assert claim.world and claim.cold_start and claim.arms and claim.evaluation and claim.test


def test_bad_claim_and_profile_are_named(tmp_path):
    with pytest.raises(ConfigError, match="--profile must be cpu or gpu"):
        reproduce("staged", tmp_path, "tpu")
    with pytest.raises(ConfigError, match="no claim registered for 'ircot'; choose one of staged, r_search"):
        reproduce("ircot", tmp_path, "cpu")
    result = CliRunner().invoke(
        app, ["reproduce", "s3", "--profile", "tpu", "--out", str(tmp_path)], terminal_width=300
    )
    assert result.exit_code == 2 and "--profile must be cpu or gpu, got 'tpu'" in result.output


def test_paired_rows_by_hand():
    first = {
        q: {"metrics": {"em": em, "f1": f1}, "golden_answers": ["Oslo"], "extra": {"agent_answer": own}}
        for q, em, f1, own in (("a", 1, 1.0, "Oslo"), ("b", 0, 0.5, "oslo"), ("c", 1, 1.0, "Rome"))
    }
    second = {
        q: {"metrics": {"em": em, "f1": f1}} for q, em, f1 in (("a", 0, 0.0), ("b", 0, 0.5), ("z", 1, 1.0))
    }
    row = _paired_on(first, second, metric("f1"))  # questions a and b only: (1.0, 0.5) vs (0.0, 0.5)
    assert row["n"] == 2 and row["a"] == 0.75 and row["b"] == 0.25 and row["diff"] == 0.5
    assert row["ci"] == list(paired_bootstrap([1.0, 0.5], [0.0, 0.5])[1:])
    # own answers on one side (a 1, b 1 normalised, c 0), the reader's EM on the other (a 1, b 0, c 1)
    mixed = _paired_on(first, first, own_answer_cover_em, metric("em"))
    assert mixed["n"] == 3 and mixed["a"] == pytest.approx(2 / 3) and mixed["b"] == pytest.approx(2 / 3)
    # non-strict EM: a sentence containing the gold counts, a prefix of it does not
    sentence = {"golden_answers": ["Oslo"], "extra": {"agent_answer": "Rome, not Oslo"}}
    assert own_answer_cover_em(sentence) == 1.0
    assert own_answer_cover_em({"golden_answers": ["Oslo"], "extra": {"agent_answer": "Osl"}}) == 0.0
    assert own_answer_cover_em({"golden_answers": ["x"]}) == 0.0
    with pytest.raises(ConfigError, match="no common question"):
        _paired_on(first, {"q": second["z"]}, metric("em"))


def test_arm_recipe_applies_the_arm_and_keeps_the_method_defaults(tmp_path):
    run, world = _claim_run(tmp_path, "r_search"), tmp_path / "world"
    without = arm_rl_recipe(
        run,
        Arm("without_evidence", "r_search", (setting("reward.options.use_evidence_reward", False),)),
        "ck",
    )
    assert without["reward"]["name"] == "r_search" and without["reward"]["generator"] == "policy-base"
    assert without["reward"]["options"] == {"gamma_e": 0.2, "gamma_a": 0.2, "use_evidence_reward": False}
    assert without["model"]["init_from"] == "ck" and "sft" not in without
    assert without["trainer"]["out_dir"] == str(tmp_path / "without_evidence" / "train")
    assert without["trainer"]["save_every"] == 2  # min(total steps, 5) when the arm sets none
    stage2 = arm_rl_recipe(
        run,
        Arm(
            "stage2",
            "qagent",
            (
                setting("reward.name", "qagent_stage2"),
                setting("reward.options.hit_weight", 0.5),
                setting("reward.generator", "R: a path, with a colon"),
                setting("trainer.total_steps", 3),
            ),
        ),
        "ck",
    )
    assert (
        stage2["reward"]["name"] == "qagent_stage2"
        and stage2["reward"]["generator"] == "R: a path, with a colon"
    )
    assert stage2["reward"]["options"]["hit_weight"] == 0.5
    assert stage2["trainer"]["total_steps"] == 3 and stage2["trainer"]["save_every"] == 3
    # the registry's defaults are untouched by an arm's overrides (a later arm gets the method's own options)
    from sleuth.agent.registry import get_method

    assert "use_evidence_reward" not in get_method("r_search").default_reward["options"]
    assert arm_rl_recipe(run, Arm("with_evidence", "r_search"), "ck")["reward"]["options"] == {
        "gamma_e": 0.2,
        "gamma_a": 0.2,
    }
    s3 = arm_rl_recipe(
        run,
        Arm(
            "s3_4",
            "s3",
            (
                setting("reward.generator", "R"),
                setting("trainer.total_steps", 2),
                setting("data.max_train_examples", 4),
            ),
        ),
        "ck",
    )
    assert s3["reward"]["name"] == "s3_gbr" and s3["reward"]["generator"] == "R"
    assert s3["data"]["max_train_examples"] == 4 and s3["data"]["train"] == str(world / "train.jsonl")
    later = _claim_run(tmp_path, "r_search", seed=2, base_seed=0)  # a later seed writes under OUT/seed2
    assert arm_rl_recipe(later, Arm("x", "r_search"), "ck")["trainer"]["out_dir"] == str(
        tmp_path / "seed2" / "x" / "train"
    )
    assert arm_rl_recipe(later, Arm("x", "r_search"), "ck")["seed"] == 2


def test_claim_table_by_hand():
    staged = _preds(
        [
            ("a", "all-known", 0, 1),
            ("b", "all-known", 0, 1),
            ("c", "all-known", 1, 1),
            ("d", "mixed", 1, 0),
            ("e", "all-unknown", 2, 1),
            ("f", "all-known", 0, 1),
        ]
    )
    baseline = _preds(
        [
            ("a", "all-known", 1, 1),
            ("b", "all-known", 1, 1),
            ("c", "all-known", 1, 0),
            ("d", "mixed", 1, 0),
            ("e", "all-unknown", 1, 1),
            ("f", "all-known", 1, 1),
        ]
    )
    table = claim_table(staged, baseline)
    known = table["rows"]["retrievals per question, all-known"]
    # all-known (a, b, c, f): staged 1/4 retrievals per question, search_r1 1; per-question differences
    # -1, -1, 0, -1: a resample reaches 0 only by drawing c four times (p = 1/256 < 2.5%), so the upper end < 0
    assert known["n"] == 4 and known["a"] == 0.25 and known["b"] == 1.0
    assert known["diff"] == -0.75 and known["ci"][1] < 0
    other = table["rows"]["retrievals per question, mixed / all-unknown"]
    assert other["n"] == 2 and other["a"] == 1.5 and other["b"] == 1.0
    em = table["rows"]["EM, all questions"]
    assert (
        em["a"] == pytest.approx(5 / 6)
        and em["b"] == pytest.approx(4 / 6)
        and em["diff"] == pytest.approx(1 / 6)
    )
    assert em["ci"] == list(paired_bootstrap([1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 1, 1])[1:])
    assert em["ci"][0] == 0.0
    with pytest.raises(ConfigError, match="no common question"):
        claim_table(staged, _preds([("z", "all-known", 0, 1)]))


def test_a_finished_stage_is_not_run_again(tmp_path):
    calls = []
    assert stage(tmp_path, "s", lambda: calls.append(1) or {"x": 1}) == {"x": 1}
    assert stage(tmp_path, "s", lambda: calls.append(1) or {"x": 2}) == {"x": 1}
    assert calls == [1]


def test_reproduce_staged_cpu_end_to_end_and_resumes(tmp_path):
    """The whole staged pipeline with the tiny model at two training seeds (about 70 s on 2 cores): the verdict over
    seeds with its noise floor, the premise, one correctness rule; a rerun skips every stage."""
    out = tmp_path / "staged"
    runner = CliRunner()
    argv = ["reproduce", "staged", "--profile", "cpu", "--out", str(out), "--seeds", "2"]
    result = runner.invoke(app, argv, terminal_width=300)
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    claim_html = _claim_html(page)
    for row in (
        "retrievals per question, all-known",
        "retrievals per question, mixed / all-unknown",
        "EM, all questions",
        "95% interval",
    ):
        assert row in claim_html
    report = json.loads((out / "report.json").read_text())
    rows = report["table"]["rows"]
    assert rows["EM, all questions"]["n"] == 30 and isinstance(report["table"]["holds"], bool)
    assert (
        rows["retrievals per question, all-known"]["n"]
        + rows["retrievals per question, mixed / all-unknown"]["n"]
        == 30
    )
    assert report["inject"]["boundary"]["all-known"]["em"] > report["inject"]["boundary"]["mixed"]["em"]
    by_type = page[
        page.index("<table id='knowledge'>") :
    ]  # after the claim table: the boundary and retrieval per type
    assert page.index("<table id='knowledge'>") > page.index("<table id='claim'>")
    assert "<td>all-known</td>" in by_type and "staged over-retrieval %" in by_type
    stages = sorted(p.stem for p in (out / "stages").iterdir())
    arm_stages = ["eval_search_r1", "eval_staged", "train_search_r1", "train_staged"]
    assert stages == sorted(
        [*arm_stages, *(f"{s}.seed1" for s in arm_stages), "inject", "labels", "premise", "world"]
    )
    # two seeds: each seed's paired difference, the pooled one, the noise floor (search_r1 seed 1 vs seed 0)
    seeds = report["table"]["seeds"]
    assert seeds["seeds"] == [0, 1] and report["seeds"] == [0, 1]
    for test in seeds["tests"]:
        assert [r["seed"] for r in test["per_seed"]] == [0, 1] and test["floor"]["seeds"] == [0, 1]
        assert test["verdict"] in ("holds", "not shown", "does not hold") and test["pooled"]["seeds"] == 2
    seed1 = yaml.safe_load((out / "seed1" / "staged" / "rl_recipe.yaml").read_text())
    assert seed1["seed"] == 1 and seed1["trainer"]["out_dir"] == str(out / "seed1" / "staged" / "train")
    # one correctness rule in both arms: exact match
    assert seed1["reward"]["options"]["correctness"] == "em"
    assert (out / "seed1" / "eval" / "search_r1").is_dir()
    # the premise is measured and reported (the cpu profile rehearses; it does not enforce it)
    premise = report["premise"]
    assert [c["check"].split(":")[0] for c in premise["checks"]] == ["stage 1", "stage 2"]
    assert (
        premise["closed_book"] == premise["closed_book_probe"]["em"]
        and premise["closed_book_probe"]["samples"] == 4
    )
    # "known" is what the injected model answers closed-book: the arms train and are evaluated on those labels
    labels = report["labels"]
    assert seed1["data"]["train"] == str(out / "labels" / "train.jsonl")
    known = [json.loads(line) for line in (out / "labels" / "test.jsonl").read_text().splitlines()]
    closed = {
        r["id"]: r["metrics"]["em"]
        for r in map(
            json.loads,
            (out / "labels" / "closed_book_test" / "direct" / "predictions.jsonl").read_text().splitlines(),
        )
    }
    assert all((q["metadata"]["knowledge"] == "all-known") == (closed[q["id"]] > 0) for q in known)
    assert sum(labels["relabelled"]["test"].values()) == len(known) and premise["probe"]["n"] == premise[
        "closed_book_probe"
    ]["n"] == sum(q["metadata"]["knowledge"] == "all-known" for q in known[:30])
    assert "id='premise-check'" in page and report["table"]["seeds"]["seeds"] == [0, 1]
    assert result.output.strip().splitlines()[-1].startswith("verdict: the staged claim ")
    again = runner.invoke(
        app, ["reproduce", "staged", "--profile", "cpu", "--out", str(out)], terminal_width=300
    )
    assert (
        again.exit_code == 0 and again.output.count("done earlier, skipped") == 12
    )  # its two seeds, from claim.json
    assert report["seed"] == 0 and "Training seed of the arms: 0." in page
    assert yaml.safe_load((out / "staged" / "rl_recipe.yaml").read_text())["seed"] == 0
    other = runner.invoke(
        app, ["reproduce", "staged", "--profile", "cpu", "--out", str(out), "--seed", "1"], terminal_width=300
    )
    assert other.exit_code == 2 and "seed 0 (asked: 1)" in other.output and "done earlier" not in other.output


def test_seed_is_the_run_directory_s_and_reaches_every_arm_recipe(tmp_path):
    """--seed and --seeds land in OUT/claim.json; a directory holding another claim, profile or first seed is
    refused, more seeds are not (they add stages); a claim.json from before seeds were recorded counts as seed 0 of
    one. The run's seed reaches every arm's SFT and RL recipe."""
    write_claim_file(tmp_path, "r_search", "cpu", 7)
    assert json.loads((tmp_path / "claim.json").read_text()) == {
        "method": "r_search",
        "profile": "cpu",
        "seed": 7,
        "seeds": 1,
    }
    run = _claim_run(tmp_path, "r_search", seed=7)
    assert arm_recipe(run, "r_search", None)["seed"] == 7
    assert arm_rl_recipe(run, Arm("with_evidence", "r_search"), "init")["seed"] == 7
    write_claim_file(tmp_path, "r_search", "cpu", 7)  # the same run again: resumes
    write_claim_file(tmp_path, "r_search", "cpu", 7, 3)  # more seeds: the same run, grown
    assert run_seeds(tmp_path) == range(7, 10)
    for method, prof, seed, named in (
        ("r_search", "cpu", 8, "seed 7 (asked: 8)"),
        ("r_search", "gpu", 7, "profile 'cpu' (asked: 'gpu')"),
        ("s3", "cpu", 7, "method 'r_search' (asked: 's3')"),
    ):
        with pytest.raises(ConfigError, match=re.escape(named)):
            write_claim_file(tmp_path, method, prof, seed)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "claim.json").write_text(json.dumps({"method": "s3", "profile": "gpu"}))
    assert run_seeds(legacy) == range(0, 1)
    write_claim_file(legacy, "s3", "gpu", 0)
    with pytest.raises(ConfigError, match=re.escape("seed 0 (asked: 2)")):
        write_claim_file(legacy, "s3", "gpu", 2)
    assert run_seeds(tmp_path / "nowhere") == range(0, 1)
    with pytest.raises(ConfigError, match="--seed -1: give a non-negative"):
        reproduce("staged", tmp_path / "neg", "cpu", seeds=range(-1, 0))
    result = CliRunner().invoke(app, ["reproduce", "staged", "--seed", "-1", "--out", str(tmp_path / "neg")])
    assert result.exit_code == 2 and not (tmp_path / "neg").exists()


def test_an_unknown_claim_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["reproduce", "ircot", "--out", str(tmp_path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: no claim registered for 'ircot'; choose one of staged, r_search, qagent, s3"]


def _run_twice(tmp_path, method: str, done: Path | None = None) -> tuple[str, dict, list[str], str]:
    """`sleuth reproduce METHOD --profile cpu` twice: the report page, report.json, the stages, the rerun's output.
    `done`: the first run's OUT, made by a session fixture (the same command); only the rerun happens here."""
    out = tmp_path / method if done is None else done
    runner = CliRunner()
    argv = ["reproduce", method, "--profile", "cpu", "--out", str(out)]
    if done is None:
        result = runner.invoke(app, argv, terminal_width=300)
        assert result.exit_code == 0, result.output
    stages = sorted(p.stem for p in (out / "stages").iterdir())
    again = runner.invoke(app, argv, terminal_width=300)
    assert again.exit_code == 0 and again.output.count("done earlier, skipped") == len(stages), again.output
    return (
        (out / "report.html").read_text(),
        json.loads((out / "report.json").read_text()),
        stages,
        again.output,
    )


def _claim_html(page: str) -> str:
    """The table of every measure; the page opens with the verdict, then the verdict over seeds."""
    assert page.index("id='verdict'") < page.index("id='seeds'") < page.index("<table id='claim'>")
    start = page.index("<table id='claim'>")
    return page[start : page.index("</table>", start)]


@pytest.mark.slow
def test_reproduce_r_search_cpu_end_to_end_and_resumes(tmp_path, r_search_cpu_claim):
    """Three GRPO arms (r_search; the paper's ablation without the evidence block, from its own cold start; the
    evidence reward term off), evaluation, report; a rerun skips every stage."""
    page, report, stages, _ = _run_twice(tmp_path, "r_search", done=r_search_cpu_claim)
    claim = _claim_html(page)
    decisive = "F1 vs the paper's ablation (no evidence block)"
    assert html.escape(decisive) in claim and "F1 vs the evidence reward term off (block kept)" in claim
    rows = report["table"]["rows"]
    assert all(row["n"] == 30 for row in rows.values()) and len(rows) == 4
    assert report["table"]["seeds"]["tests"][0]["baseline"] == "eval_no_evidence_block"
    assert stages == [
        "eval_no_evidence_block",
        "eval_with_evidence",
        "eval_without_evidence",
        "premise",
        "reader",
        "sft_no_evidence_block",
        "sft_r_search",
        "train_no_evidence_block",
        "train_with_evidence",
        "train_without_evidence",
        "world",
    ]
    # the premise ran before the arms (the evidence probe on the test questions) and is in the report
    premise = report["premise"]
    assert [c["check"] for c in premise["checks"]] == [
        "the evidence model's answer F1 from the gold evidence",
        "... minus its F1 from another question's evidence",
    ]
    assert premise["probe"]["n"] == 30 and 0 <= premise["probe"]["other_evidence_f1"] <= 1
    out = r_search_cpu_claim
    recipe = (out / "without_evidence" / "rl_recipe.yaml").read_text()
    assert "use_evidence_reward: false" in recipe
    ablation = yaml.safe_load((out / "no_evidence_block" / "rl_recipe.yaml").read_text())
    assert ablation["agent"]["options"] == {"evidence_block": False}
    assert ablation["reward"]["options"]["use_evidence_format"] is False
    # its cold start learned trajectories without the block, and its evaluation ran the loop it learned
    sft_data = (out / "sft_no_evidence_block" / "trajectories.jsonl").read_text()
    assert "<answer>" in sft_data and "original_evidence" not in sft_data
    evaluated = _read_predictions(str(out / "eval" / "no_evidence_block" / "r-search" / "predictions.jsonl"))
    assert all("original_evidence" not in r["trajectory"]["prompt_text"] for r in evaluated.values())
    with_block = _read_predictions(str(out / "eval" / "with_evidence" / "r-search" / "predictions.jsonl"))
    assert all("original_evidence" in r["trajectory"]["prompt_text"] for r in with_block.values())
    # every arm's evidence model is the trained reader, not the policy's base
    reader = json.loads((out / "stages" / "reader.json").read_text())["result"]["reader"]
    for arm in ("with_evidence", "without_evidence", "no_evidence_block"):
        recipe = yaml.safe_load((out / arm / "rl_recipe.yaml").read_text())
        assert recipe["reward"]["generator"] == reader != "policy-base"


@pytest.mark.slow
def test_reproduce_qagent_cpu_end_to_end_and_resumes(tmp_path, qagent_cpu_claim):
    """Reader, SFT, stage 1 (2 steps), stage 2 from stage 1's step 1 (1 step), four evaluations (about 25 s; the
    session's run, `qagent_cpu_claim`, rerun here)."""
    out = qagent_cpu_claim.parent
    page, report, stages, _ = _run_twice(tmp_path, "qagent", done=out)
    claim = _claim_html(page)
    assert "non-strict EM read by the other reader (trained on another world)" in claim
    assert "non-strict EM read by the base model (tiny)" in claim and "stage 2" in claim
    rows = report["table"]["rows"]
    assert len(rows) == 6 and all(row["n"] == 30 for row in rows.values())
    other_reader = report["other_reader"]
    assert other_reader["world_seed"] == 1 and other_reader["reader"] != report["reader"]["reader"]
    assert {c["check"] for c in report["premise"]["checks"]} == {
        "the other reader's gold-passage EM here vs on its own world",
        "the other reader's gold-passage EM here",
    }
    # the claim row is non-strict EM (a gold answer inside the reader's answer), recomputed from the predictions
    evals = out / "eval"
    other = [
        _read_predictions(str(evals / f"{arm}_other_reader" / "qagent" / "predictions.jsonl"))
        for arm in ("stage2", "stage1")
    ]
    claim_row = rows["non-strict EM read by the other reader (trained on another world)"]
    for arm, side in zip(other, ("a", "b"), strict=True):
        assert claim_row[side] == pytest.approx(
            sum(cover_exact_match(r["prediction"], r["golden_answers"]) for r in arm.values()) / len(arm)
        )
    assert stages == [
        "eval_stage1_base_reader",
        "eval_stage1_other_reader",
        "eval_stage1_trained_reader",
        "eval_stage2_base_reader",
        "eval_stage2_other_reader",
        "eval_stage2_trained_reader",
        "other_reader",
        "premise",
        "reader",
        "sft_qagent",
        "train_stage1",
        "train_stage2",
        "world",
    ]
    assert report["train_stage2"]["steps"] == 1 and report["train_stage1"]["steps"] == 2
    stage2 = (out / "stage2" / "rl_recipe.yaml").read_text()
    assert (
        "qagent_stage2" in stage2 and str(out / "stage1" / "train" / "checkpoints" / "step_000001") in stage2
    )
    assert f"generator: {out / 'reader' / 'reader'}" in stage2
    summary = json.loads((out / "eval" / "stage1_base_reader" / "summary.json").read_text())
    assert "generator" in json.dumps(summary) and str(out / "reader" / "reader") not in json.dumps(summary)


@pytest.mark.slow
def test_reproduce_s3_cpu_end_to_end_and_resumes(tmp_path):
    """Reader, SFT per method, s3 and search_r1 on 2 and 4 RL training questions, report with a plot (about 40 s)."""
    page, report, stages, _ = _run_twice(tmp_path, "s3")
    claim = _claim_html(page)
    for row in (
        "EM: s3 on 2 questions vs search_r1 on 4",
        "EM after RL on 2 training questions",
        "EM after RL on 4 training questions",
    ):
        assert row in claim
    assert page.index("<img") > page.index("</table>")  # the curve follows the claim table
    curve = report["table"]["curve"]
    assert [p["questions"] for p in curve["s3"]] == [p["questions"] for p in curve["search_r1"]] == [2, 4]
    assert {d: report[f"train_{d}"]["steps"] for d in ("s3_2", "s3_4", "search_r1_2", "search_r1_4")} == {
        "s3_2": 1,
        "s3_4": 2,
        "search_r1_2": 1,
        "search_r1_4": 2,
    }  # one pass over the questions, 2 per step
    reader = str(tmp_path / "s3" / "reader" / "reader")
    for size in (2, 4):  # the same trained reader trains and reads s3 at every size
        assert f"generator: {reader}" in (tmp_path / "s3" / f"s3_{size}" / "rl_recipe.yaml").read_text()
        assert reader in (tmp_path / "s3" / "eval" / f"s3_{size}" / "summary.json").read_text()
    assert "reader" in stages and "sft_s3" in stages and "rag_baseline" in stages and len(stages) == 17
    assert {"eval_s3_noselect_2", "eval_search_r1_docs_read_4"} <= set(stages)
    noselect = yaml.safe_load((tmp_path / "s3" / "s3_noselect_2" / "rl_recipe.yaml").read_text())
    assert noselect["agent"]["options"] == {"use_selection": False}
    # search_r1's documents read by the trained reader: its answers are the reader's, its own kept beside them
    read = _read_predictions(
        str(tmp_path / "s3" / "eval" / "search_r1_docs_read_4" / "search-r1" / "predictions.jsonl")
    )
    assert all(r["answer_source"] == "generator" and "agent_answer" in r["extra"] for r in read.values())
    report_s3 = yaml.safe_load((tmp_path / "s3" / "s3_4" / "rl_recipe.yaml").read_text())["data"]
    assert report_s3["skip_train_examples"] == 12 and report_s3["hard_from"].endswith(
        "naive_rag_scores.jsonl"
    )
    premise = report["premise"]
    assert premise["checks"][0]["value"] == 0 and premise["met"] is False  # disjoint, but 1 step is not 20


def test_knowledge_table_by_hand():
    """The staged report's per-type table: closed-book EM, then per arm EM, retrievals, over- and under-retrieval
    with their intervals, in points (retrievals as counts); a type neither side measured is left out."""
    from sleuth.claims.report import knowledge_table

    boundary = {
        "all-known": {"n": 4, "em": 0.5, "em_ci": [0.25, 0.75]},
        "mixed": {"n": 2, "em": 0.0, "em_ci": [0, 0]},
    }
    arm = {
        "all-known": {
            "n": 4,
            "em": 0.75,
            "em_ci": [0.5, 1.0],
            "retrieval_count": 1.25,
            "retrieval_count_ci": [1.0, 1.5],
            "over_retrieval": 0.5,
            "over_retrieval_ci": [0.0, 1.0],
            "under_retrieval": None,
        },
        "mixed": {
            "n": 2,
            "em": 0.5,
            "em_ci": None,
            "retrieval_count": 2.0,
            "under_retrieval": 0.0,
            "under_retrieval_ci": [0.0, 0.0],
        },
    }
    page = knowledge_table(boundary, {"staged": arm, "search_r1": None})
    assert (
        "<tr><td>all-known</td><td>4</td><td>50.0 [25.0, 75.0]</td><td>75.0 [50.0, 100.0]</td>"
        "<td>1.25 [1.00, 1.50]</td><td>50.0 [0.0, 100.0]</td><td>-</td><td>-</td><td>-</td><td>-</td><td>-</td></tr>"
    ) in page
    assert (
        "<tr><td>mixed</td><td>2</td><td>0.0 [0.0, 0.0]</td><td>50.0</td><td>2.00</td><td>-</td><td>0.0 [0.0, 0.0]</td>"
        in page
    )
    assert "all-unknown" not in page.split("</caption>")[1]
