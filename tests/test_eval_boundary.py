"""Over- and under-retrieval per knowledge type, against hand-computed values."""

from __future__ import annotations

import json

import pytest

from sleuth.eval.boundary import UNKNOWN, boundary_markdown, retrieval_boundary
from sleuth.eval.stats import bootstrap_ci


def _rec(kind: str, rc: int, em: float) -> dict:
    return {"knowledge": kind, "retrieval_count": rc, "metrics": {"em": em}}


RECORDS = (
    [_rec("all-known", rc, em) for rc, em in ((0, 1), (2, 1), (1, 0), (0, 1))]
    + [_rec("mixed", rc, em) for rc, em in ((1, 1), (0, 0))]
    + [_rec("all-unknown", rc, em) for rc, em in ((0, 0), (0, 0), (3, 1))]
)


def test_over_and_under_retrieval_by_hand():
    rows = retrieval_boundary(RECORDS, seed=0)
    known, mixed, unknown, anyu = rows["all-known"], rows["mixed"], rows["all-unknown"], rows[UNKNOWN]
    # all-known: searched on 2 of 4 (rc 2 and 1) -> over-retrieval 0.5; rc mean 3/4; EM 3/4
    assert known["n"] == 4 and known["over_retrieval"] == 0.5 and known["under_retrieval"] is None
    assert known["retrieval_count"] == 0.75 and known["em"] == 0.75
    # mixed: answered without searching 1 of 2 -> under-retrieval 0.5
    assert mixed["under_retrieval"] == 0.5 and mixed["over_retrieval"] is None
    # all-unknown: 2 of 3 without a search
    assert unknown["under_retrieval"] == pytest.approx(2 / 3) and unknown["retrieval_count"] == 1.0
    # any-unknown pools mixed and all-unknown: 3 of 5 without a search, rc (1+0+0+0+3)/5
    assert anyu["n"] == 5 and anyu["under_retrieval"] == 0.6 and anyu["retrieval_count"] == 0.8
    assert anyu["em"] == 0.4
    # the intervals are sleuth's seeded percentile bootstrap of the per-question 0/1 values
    assert known["over_retrieval_ci"] == list(bootstrap_ci([0.0, 1.0, 1.0, 0.0], seed=0))
    assert anyu["under_retrieval_ci"] == list(bootstrap_ci([0.0, 1.0, 1.0, 1.0, 0.0], seed=0))
    lo, hi = known["over_retrieval_ci"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0


def test_a_constant_share_has_a_point_interval_and_unlabelled_records_are_ignored():
    rows = retrieval_boundary(
        [_rec("all-known", 2, 1.0)] * 3 + [{"retrieval_count": 0, "metrics": {"em": 1}}]
    )
    assert rows["all-known"]["n"] == 3
    assert rows["all-known"]["over_retrieval"] == 1.0 and rows["all-known"]["over_retrieval_ci"] == [1.0, 1.0]
    assert set(rows) == {"all-known"}
    assert retrieval_boundary([{"retrieval_count": 1, "metrics": {"em": 0}}]) is None


def test_markdown_table_shows_each_type():
    text = boundary_markdown({"staged": retrieval_boundary(RECORDS)})
    assert "| staged | all-known | 4 | 50.0 [" in text
    assert "| staged | any-unknown | 5 | - | 60.0 [" in text


def test_evaluate_reports_the_boundary_for_direct_and_naive_rag(tmp_path):
    """direct never searches (over-retrieval 0%, under-retrieval 100%); naive RAG always retrieves once
    (over-retrieval 100%, under-retrieval 0%): the extremes, known without running a model's judgement."""
    from sleuth.claims.knowledge import boundary_questions
    from sleuth.data.synth import generate_world, write_world
    from sleuth.eval.harness import EvalConfig, evaluate
    from sleuth.retrieval import build_index

    write_world(
        generate_world(60, 20, hops=(1, 2), seed=1, known_fraction=0.5), tmp_path, splits=(0.0, 0.0, 1.0)
    )
    build_index(tmp_path / "corpus.jsonl", "bm25", tmp_path / "bm25")
    questions = boundary_questions(tmp_path, "test", 12)
    summary = evaluate(
        ["direct", "naive-rag"],
        questions,
        retriever=tmp_path / "bm25",
        model="tiny",
        out_dir=tmp_path / "eval",
        config=EvalConfig(answer_max_new_tokens=4, max_new_tokens=4),
    )
    direct, rag = summary["retrieval_boundary"]["direct"], summary["retrieval_boundary"]["naive-rag"]
    kinds = {q.metadata["knowledge"] for q in questions}
    assert "all-known" in kinds and kinds - {"all-known"}
    assert direct["all-known"]["over_retrieval"] == 0.0 and direct[UNKNOWN]["under_retrieval"] == 1.0
    assert rag["all-known"]["over_retrieval"] == 1.0 and rag[UNKNOWN]["under_retrieval"] == 0.0
    assert "over-retrieval % [95% CI]" in (tmp_path / "eval" / "summary.md").read_text()
    stored = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert stored["retrieval_boundary"]["direct"]["all-known"]["n"] == sum(
        q.metadata["knowledge"] == "all-known" for q in questions
    )
