"""s3 training-set filters on hand-made inputs, and the `sleuth data filter` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.data.filters import drop_yes_no, is_yes_no, keep_hard, normalize_answer
from sleuth.data.formats import QAExample, read_qa_jsonl, write_qa_jsonl
from sleuth.data.score_cache import ScoreCache


def ex(qid: str, *answers: str) -> QAExample:
    return QAExample(qid, f"question {qid}?", list(answers))


def test_normalize_answer():
    assert normalize_answer("  The  Yes! ") == "yes"
    assert normalize_answer("An Apple, a day") == "apple day"


def test_drop_yes_no():
    examples = [
        ex("1", "yes"),
        ex("2", "No."),
        ex("3", "TRUE", "yes"),
        ex("4", "yes", "Paris"),  # a real entity answer keeps it
        ex("5", "Yesterday"),  # word containing "yes" is not yes
        ex("6", "the no"),  # article removed -> "no"
        ex("7", "false"),
    ]
    kept = drop_yes_no(examples)
    assert [e.id for e in kept] == ["4", "5"]
    assert is_yes_no(examples[5])


def test_keep_hard_threshold_and_missing(tmp_path):
    cache = ScoreCache(tmp_path / "scores.jsonl")
    cache.update({"a": 0.0, "b": 1.0, "c": 0.4})
    examples = [ex("a", "x"), ex("b", "x"), ex("c", "x"), ex("d", "x")]

    with pytest.raises(ValueError) as info:
        keep_hard(examples, cache)
    assert "1 of 4 questions" in str(info.value)
    assert str(cache.path) in str(info.value)
    assert "'d'" in str(info.value)

    assert [e.id for e in keep_hard(examples, cache, missing="drop")] == ["a"]
    assert [e.id for e in keep_hard(examples, cache, missing="keep")] == ["a", "d"]
    assert [e.id for e in keep_hard(examples, cache, threshold=0.5, missing="drop")] == ["a", "c"]
    assert [e.id for e in keep_hard(examples[:3], cache, threshold=1.0)] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="missing must be"):
        keep_hard(examples, cache, missing="ignore")  # type: ignore[arg-type]


def test_data_filter_command(tmp_path):
    src = tmp_path / "in.jsonl"
    write_qa_jsonl(src, [ex("a", "yes"), ex("b", "Vrakton"), ex("c", "Zarvonia"), ex("d", "no")])
    scores = tmp_path / "scores.jsonl"
    scores.write_text(
        "".join(json.dumps({"id": k, "score": v}) + "\n" for k, v in {"b": 1.0, "c": 0.0}.items())
    )
    dst = tmp_path / "out.jsonl"
    runner = CliRunner()
    result = runner.invoke(
        app, ["data", "filter", str(src), str(dst), "--drop-yes-no", "--hard-from", str(scores)]
    )
    assert result.exit_code == 0, result.output
    assert [e.id for e in read_qa_jsonl(dst)] == ["c"]
    assert "2 yes/no dropped, 1 easy dropped, 1 written" in result.output

    # Without --drop-yes-no, "a" and "d" have no score: a clear error, exit 2.
    result = runner.invoke(app, ["data", "filter", str(src), str(dst), "--hard-from", str(scores)])
    assert result.exit_code == 2
    assert "2 of 4 questions have no baseline score" in result.output

    result = runner.invoke(
        app, ["data", "filter", str(src), str(dst), "--hard-from", str(tmp_path / "none.jsonl")]
    )
    assert result.exit_code == 2
    assert "does not exist" in result.output
