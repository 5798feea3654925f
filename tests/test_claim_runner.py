"""The claims runner with a fifth claim registered from this test (one module's worth of code, no edit to sleuth):
seeds, the noise floor, the pooled verdict, the premise check and its refusal, --arms, resume and the report.

The toy claim's arms write per-question scores drawn from their seed, so every number below is known in advance.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from sleuth.claims import staged
from sleuth.claims.base import ClaimSpec, ClaimText, DecisiveTest, Stage, premise_stage
from sleuth.claims.profiles import CPU_PIPELINE, ClaimProfile
from sleuth.claims.registry import CLAIMS, register_claim
from sleuth.claims.runner import PremiseUnmet, RunPart, reproduce, stage_plan
from sleuth.claims.staged import expected_rewards, premise_checks
from sleuth.claims.stages import ArmsPending
from sleuth.claims.stats import metric
from sleuth.errors import ConfigError

QUESTIONS = 40


def _write_arm(run: Any, arm: str) -> dict[str, Any]:
    """Question i is right for the treated arm when i < 30 (75%); for the baseline when i < 20 + 2 * (seed % 2),
    so two baseline seeds differ by 2 questions (5 points): the noise floor."""
    right = 30 if arm == "treated" else 20 + 2 * (run.seed % 2)
    path = run.root / "eval" / arm / "predictions.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i:02d}", "metrics": {"em": float(i < right)}}) + "\n"
            for i in range(QUESTIONS)
        )
    )
    return {"predictions": str(path), "seed": run.seed}


class ToyClaim(ClaimSpec):
    premise_met = True

    def arms(self, profile: str) -> tuple[str, ...]:
        return ("treated", "baseline")

    def stages(self, profile: str) -> list[Stage]:
        return [
            Stage("world", lambda run: {"world": str(run.world)}),
            premise_stage(),
            *[
                Stage(f"eval_{arm}", lambda run, a=arm: _write_arm(run, a), arms=(arm,), per_seed=True)
                for arm in ("treated", "baseline")
            ],
        ]

    def premise(self, run: Any) -> dict[str, Any]:
        return {
            "met": self.premise_met,
            "checks": [{"check": "toy", "value": 1, "needed": 2, "met": self.premise_met}],
            "note": "a toy premise",
        }

    def tests(self, profile: str) -> list[DecisiveTest]:
        return [DecisiveTest("EM", "eval_treated", "eval_baseline", metric("em"), "above", 0.0)]

    def table(self, run: Any) -> dict[str, Any]:
        return {"rows": {}, "questions": QUESTIONS, "rule": "toy"}


PROFILE = ClaimProfile(
    pipeline=CPU_PIPELINE, splits=(0.6, 0.1, 0.3), lora=False, test_questions=QUESTIONS, accuracy_margin=0.02
)


@pytest.fixture
def toy():
    spec = register_claim(
        ToyClaim(
            text=ClaimText("toy", "treated beats baseline", "w", "c", "a", "e", "t"),
            profiles={"cpu": PROFILE},
            columns=("treated", "baseline"),
        )
    )
    yield spec
    del CLAIMS["toy"]


def test_three_seeds_pool_with_a_noise_floor_and_the_claim_holds(toy, tmp_path):
    report_page = reproduce("toy", tmp_path, "cpu", seeds=range(0, 3))
    report = json.loads((tmp_path / "report.json").read_text())
    test = report["table"]["seeds"]["tests"][0]
    # treated 75%; baseline 50% at seeds 0 and 2, 55% at seed 1: differences +25, +20, +25 points
    assert [round(r["diff"], 4) for r in test["per_seed"]] == [0.25, 0.2, 0.25]
    assert test["pooled"]["diff"] == pytest.approx((0.25 + 0.2 + 0.25) / 3)
    assert test["floor"]["seeds"] == [0, 1] and test["floor"]["diff"] == pytest.approx(
        0.05
    )  # seed 1 minus seed 0
    assert test["pooled"]["ci"][0] > 0 and test["verdict"] == "holds" and report["verdict"] == "holds"
    assert report["seeds"] == [0, 1, 2]
    # the first seed writes OUT/eval, seed s OUT/seed<s>/eval, each under its own stage record
    assert (tmp_path / "seed2" / "eval" / "treated" / "predictions.jsonl").is_file()
    assert sorted(p.stem for p in (tmp_path / "stages").glob("*.json")) == [
        "eval_baseline",
        "eval_baseline.seed1",
        "eval_baseline.seed2",
        "eval_treated",
        "eval_treated.seed1",
        "eval_treated.seed2",
        "premise",
        "world",
    ]
    page = report_page.read_text()
    assert "The claim holds." in page and "noise floor: baseline seed 1 vs seed 0" in page
    assert page.index("id='verdict'") < page.index("id='seeds'") < page.index("id='premise-check'")
    assert stage_plan("toy", "cpu", range(0, 2))["eval_treated.seed1"] == ()


def test_one_seed_has_no_floor_and_cannot_hold(toy, tmp_path):
    reproduce("toy", tmp_path, "cpu")
    report = json.loads((tmp_path / "report.json").read_text())
    test = report["table"]["seeds"]["tests"][0]
    assert test["floor"] is None and test["verdict"] == "not shown" and "no noise floor" in test["why"]
    # a rerun with more seeds grows the same run directory
    reproduce("toy", tmp_path, "cpu", seeds=range(0, 2))
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "holds"
    assert json.loads((tmp_path / "claim.json").read_text())["seeds"] == 2


def test_an_effect_within_the_noise_floor_is_not_shown(toy, tmp_path, monkeypatch):
    """The treated arm 2 questions above baseline seed 0: +5 points, no more than two baseline seeds differ."""

    def close(run: Any, arm: str) -> dict[str, Any]:
        path = run.root / "eval" / arm / "predictions.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        right = {"treated": 22 + 2 * (run.seed % 2), "baseline": 20 + 2 * (run.seed % 2)}[arm]
        path.write_text(
            "".join(
                json.dumps({"id": f"q{i:02d}", "metrics": {"em": float(i < right)}}) + "\n"
                for i in range(QUESTIONS)
            )
        )
        return {"predictions": str(path)}

    monkeypatch.setattr(f"{__name__}._write_arm", close)
    reproduce("toy", tmp_path, "cpu", seeds=range(0, 2))
    test = json.loads((tmp_path / "report.json").read_text())["table"]["seeds"]["tests"][0]
    assert test["pooled"]["diff"] == pytest.approx(0.05) and test["pooled"]["ci"][0] > 0
    assert test["verdict"] == "not shown" and "does not exceed the noise floor" in test["why"]


def test_an_unmet_premise_refuses_the_arms_unless_forced(toy, tmp_path):
    toy.premise_met = False
    with pytest.raises(PremiseUnmet, match=r"toy: 1 \(needed: 2\).*--force"):
        reproduce("toy", tmp_path, "cpu", seeds=range(0, 2))
    assert not (tmp_path / "stages" / "eval_treated.json").exists()  # no arm trained
    assert (tmp_path / "stages" / "premise.json").exists()  # the check is kept: --force goes on from it
    reproduce("toy", tmp_path, "cpu", seeds=range(0, 2), force=True)
    report = json.loads((tmp_path / "report.json").read_text())
    # the arms measure what they measure, but the verdict cannot be more than "not shown"
    assert report["table"]["seeds"]["tests"][0]["verdict"] == "holds" and report["verdict"] == "not shown"
    assert report["premise"]["met"] is False
    assert "The premise is not met" in (tmp_path / "report.html").read_text()


def test_arms_split_over_runs_and_the_last_writes_the_report(toy, tmp_path):
    with pytest.raises(ArmsPending, match="eval_baseline, eval_baseline.seed1"):
        reproduce("toy", tmp_path, "cpu", part=RunPart(["treated"]), seeds=range(0, 2))
    reproduce("toy", tmp_path, "cpu", part=RunPart(["baseline"]), seeds=range(0, 2))
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "holds"
    with pytest.raises(ConfigError, match="--arms nope: the toy claim's arms are treated, baseline"):
        reproduce("toy", tmp_path, "cpu", part=RunPart(["nope"]), seeds=range(0, 2))


def test_seeds_split_over_runs_and_the_last_writes_the_report(toy, tmp_path):
    """Runs sharing OUT take one seed each (`--only-seed`): each runs the shared stages once and its own seed's,
    leaves the rest pending, and the run that finds every seed recorded writes the same report as one run."""
    with pytest.raises(ArmsPending, match="eval_treated.seed1, eval_baseline.seed1"):
        reproduce("toy", tmp_path / "split", "cpu", part=RunPart(seed=0), seeds=range(0, 2))
    assert not (tmp_path / "split" / "report.json").exists()
    with pytest.raises(ArmsPending, match="^stages left to other runs: eval_baseline.seed1;"):
        reproduce("toy", tmp_path / "split", "cpu", part=RunPart(["treated"], 1), seeds=range(0, 2))
    reproduce("toy", tmp_path / "split", "cpu", part=RunPart(["baseline"], 1), seeds=range(0, 2))
    reproduce("toy", tmp_path / "whole", "cpu", seeds=range(0, 2))
    split, whole = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("split", "whole"))
    assert split["verdict"] == whole["verdict"] and split["table"]["seeds"] == whole["table"]["seeds"]
    with pytest.raises(ConfigError, match="--only-seed 5: this run's training seeds are 0..1"):
        reproduce("toy", tmp_path / "split", "cpu", part=RunPart(seed=5), seeds=range(0, 2))


def test_cli_prints_the_verdict_last(toy, tmp_path):
    from sleuth.cli import app

    result = CliRunner().invoke(
        app, ["reproduce", "staged", "--seeds", "0", "--out", str(tmp_path / "x")], terminal_width=200
    )
    assert (
        result.exit_code == 2
        and "greater than or equal to 1" in result.output
        and not (tmp_path / "x").exists()
    )
    from sleuth.claims.commands import _verdict_line

    reproduce("toy", tmp_path, "cpu", seeds=range(0, 3))
    line = _verdict_line(tmp_path / "report.json")
    assert (
        line.startswith("verdict: the toy claim holds (EM: +23.33 points [")
        and "over 3 seed(s), holds" in line
    )


@pytest.mark.parametrize(
    ("closed_book", "searched", "met"),
    [
        # the 2026-11-28 H200 staged world: 45.8% closed-book on all-known questions, ~60% after searching. Stage 1:
        # skip 2(0.458) - 1 = -0.084; search 0.6 - 0.4 * 0.7 = +0.32. Searching is optimal there: the premise fails
        (0.458, 0.60, False),
        # a model that knows its known questions: skip 0.9 >= 0.32 (stage 1) and 0.9 > 0.6 * 0.7 - 0.4 = 0.02 (stage 2)
        (0.95, 0.60, True),
        # stage 1 met exactly at equality (skip 2p - 1 = search 1.7 * 0.6 - 0.7 = 0.32 at p = 0.66), stage 2 met
        (0.66, 0.60, True),
    ],
)
def test_staged_premise_by_hand(closed_book, searched, met):
    premise = premise_checks(closed_book, searched, beta=0.3)
    assert premise["met"] is met
    e = expected_rewards(closed_book, searched, 0.3)
    assert e["stage1_skip"] == pytest.approx(2 * closed_book - 1)
    assert e["stage1_search"] == pytest.approx(searched - (1 - searched) * 0.7)
    assert e["stage2_search"] == pytest.approx(searched * 0.7 - (1 - searched))


def test_s3_rl_questions_are_disjoint_from_the_sft_questions(tmp_path):
    """s3's premise reads what each arm's recipe trains on: SFT on the first sft_questions training questions, RL on
    those after them (s3's only on those naive RAG gets wrong); a protocol that draws RL questions from the start
    of the split again (landed main's) shares them with the SFT set and fails the check."""
    from sleuth.claims import s3
    from sleuth.claims.base import ClaimRun
    from sleuth.claims.registry import get_claim
    from sleuth.claims.steps import build_world
    from sleuth.data.formats import read_qa_jsonl

    spec = get_claim("s3")
    run = ClaimRun(out=tmp_path, spec=spec, profile_name="cpu", profile=spec.profile("cpu"))
    build_world(run.world, run.profile)
    train = read_qa_jsonl(run.world / "train.jsonl")
    sft_n = run.profile.pipeline.sft_questions
    cache = tmp_path / "scores.jsonl"  # naive RAG right on every third question after the SFT ones
    cache.write_text(
        "".join(
            json.dumps({"id": q.id, "score": float(i % 3 == 0)}) + "\n" for i, q in enumerate(train[sft_n:])
        )
    )
    run.results.update(
        {
            "reader": {"reader": "tiny"},
            s3.RAG_BASELINE: {
                "cache": str(cache),
                "naive_rag_wrong": sum(1 for i in range(len(train) - sft_n) if i % 3),
            },
        }
    )
    premise = s3.premise_checks(run)
    assert premise["checks"][0]["value"] == 0 and premise["checks"][0]["met"]
    assert premise["rl_questions"] == {"s3_2": 2, "search_r1_2": 2, "s3_4": 4, "search_r1_4": 4}
    assert premise["checks"][2] == {
        "check": "GRPO steps at the smallest size",
        "value": 1,
        "needed": ">= 20 (the paper's)",
        "met": False,
    }  # the cpu rehearsal's 1 step
    s3_recipe = s3._arm(run, "s3", 4).overrides
    assert (
        f"data.hard_from={json.dumps(str(cache))}" in s3_recipe and "data.skip_train_examples=12" in s3_recipe
    )

    def from_the_start(
        run: Any, method: str, size: int
    ):  # landed main's pool: the first N training questions
        arm = original(run, method, size)
        return s3.Arm(
            arm.name,
            arm.method,
            tuple(
                o for o in arm.overrides if not o.startswith(("data.skip_train_examples", "data.hard_from"))
            ),
        )

    original = s3._arm
    s3._arm = from_the_start
    try:
        shared = s3.premise_checks(run)["checks"][0]
    finally:
        s3._arm = original
    assert shared["value"] == 4 and not shared["met"]


def test_the_command_line_lists_the_claims_without_loading_torch():
    """`sleuth --help` registers every claim's command: that must not load the recipe schema's torch."""
    import subprocess
    import sys

    code = "import sys, sleuth.cli; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_each_evaluation_is_read_once_for_the_table_the_verdict_and_the_figures(toy, tmp_path, monkeypatch):
    import sleuth.claims.base as base

    reads: list[str] = []
    real = base.read_appended
    monkeypatch.setattr(base, "read_appended", lambda path: reads.append(str(path)) or real(path))
    reproduce("toy", tmp_path, "cpu", seeds=range(0, 2))
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 4  # two arms, two seeds


@pytest.mark.parametrize(
    ("gold", "other", "met"),
    [
        (0.80, 0.10, True),  # reads the evidence (0.80 >= 0.5) and tells it apart (+0.70 >= 0.25)
        (0.40, 0.05, False),  # cannot read: the evidence term pays little even for gold evidence
        (
            0.80,
            0.60,
            False,
        ),  # answers about as well from unrelated evidence (+0.20): it pays for memory, not evidence
        (0.50, 0.25, True),  # both at their bounds exactly
    ],
)
def test_r_search_premise_by_hand(gold, other, met):
    from sleuth.claims.r_search import premise_checks as r_search_premise

    premise = r_search_premise({"n": 10, "gold_evidence_f1": gold, "other_evidence_f1": other})
    assert premise["met"] is met
    assert [c["met"] for c in premise["checks"]] == [gold >= 0.5, gold - other >= 0.25]


def test_r_search_evidence_probe_pays_the_gold_evidence_not_another_questions(tmp_path, monkeypatch):
    """The probe hands each question its own gold passages and then the next question's, in the evidence reward's
    prompt: a fake evidence model that answers with whichever gold answer it finds in the evidence scores F1 1 on
    the first and 0 on the second (the world's answers are distinct entities)."""
    from sleuth.claims import r_search
    from sleuth.claims.base import ClaimRun
    from sleuth.claims.registry import get_claim
    from sleuth.claims.steps import build_world
    from sleuth.data.formats import read_qa_jsonl
    from sleuth.eval import harness
    from sleuth.llm.base import Generation

    spec = get_claim("r_search")
    run = ClaimRun(out=tmp_path, spec=spec, profile_name="cpu", profile=spec.profile("cpu"))
    build_world(run.world, run.profile)
    questions = read_qa_jsonl(run.world / "test.jsonl")[:6]
    answers = {q.question: q.golden_answers[0] for q in questions}
    assert len(set(answers.values())) == len(answers)  # the premise of this test: distinct answers

    class AnswersFromEvidence:
        def generate(self, batch, stop=None, params=None):
            out = []
            for messages in batch:
                prompt = messages[-1]["content"]
                found = [a for a in answers.values() if a in prompt.split("Question:")[0]]
                question = next(q for q in answers if q in prompt)
                text = answers[question] if answers[question] in found else "no idea"
                out.append(Generation(text=text))
            return out

    monkeypatch.setattr(harness, "resolve_generator", lambda name: AnswersFromEvidence())
    probe = r_search.evidence_probe(run.world, "fake", tmp_path / "premise", 6)
    # from the world's files: how many questions' answers occur in the next question's gold passages (multi-hop
    # chains share entities, so not always none)
    corpus = {
        str(row["id"]): row["contents"]
        for row in map(json.loads, (run.world / "corpus.jsonl").read_text().splitlines())
    }
    gold_text = [" ".join(corpus[str(d)] for d in q.metadata["supporting_ids"]) for q in questions]
    shared = sum(q.golden_answers[0] in gold_text[(i + 1) % 6] for i, q in enumerate(questions))
    assert probe == {"n": 6, "gold_evidence_f1": 1.0, "other_evidence_f1": pytest.approx(shared / 6)}
    assert shared < 6
    assert json.loads((tmp_path / "premise" / "evidence_probe.json").read_text())["evidence_model"] == "fake"
    assert r_search.premise_checks(probe)["met"]


def test_the_staged_premise_again_after_the_arms_uses_the_trained_policys_own_search() -> None:
    """Hand-computed: closed-book 0.82 before the arms; the trained policy searched 9 of 10 known questions once
    (8 right, 0.889) and skipped one; mixed questions do not count. Stage 1: skipping 2 x 0.82 - 1 = +0.64 against one
    search 0.889 x 1 + 0.111 x (-0.7) = +0.811, so the premise fails after the arms; stage 2: +0.64 against
    0.889 x 0.7 + 0.111 x (-1) = +0.511, met. With the probe's 0.31 instead it would pass both."""
    rows = {
        f"k{i}": {"knowledge": "all-known", "retrieval_count": 1, "metrics": {"em": float(i < 8)}}
        for i in range(9)
    }
    rows["k9"] = {"knowledge": "all-known", "retrieval_count": 0, "metrics": {"em": 1.0}}
    rows["m0"] = {"knowledge": "mixed", "retrieval_count": 3, "metrics": {"em": 0.0}}
    after = staged.premise_as_trained(rows, 0.82, beta=0.3)
    assert after["known"] == 10 and after["searched_known"] == 9
    e = after["expected"]
    assert e["stage1_skip"] == pytest.approx(0.64) and e["stage1_search"] == pytest.approx(8 / 9 - 0.7 / 9)
    assert e["stage2_search"] == pytest.approx(0.7 * 8 / 9 - 1 / 9)
    assert [c["met"] for c in after["checks"]] == [False, True] and not after["met"]
    assert premise_checks(0.82, 0.31, beta=0.3)["met"]
    assert staged.premise_as_trained({"m0": rows["m0"]}, 0.82, beta=0.3) is None  # no known question searched
