"""Readers/writers in sleuth.data.formats and the score cache: round trips and bad-input errors."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sleuth.data.formats import (
    SEARCH_R1_TEMPLATE,
    Passage,
    QAExample,
    iter_corpus,
    iter_qa_jsonl,
    load_qa,
    read_qa_jsonl,
    read_searchr1_parquet,
    save_qa,
    write_corpus,
    write_qa_jsonl,
    write_searchr1_parquet,
)
from sleuth.data.score_cache import ScoreCache
from sleuth.errors import DataFormatError

EXAMPLES = [
    QAExample("q1", "Who wrote Zvorek Lantern?", ["Ana Kvell"], {"hops": 1, "supporting_ids": ["7"]}),
    QAExample("q2", "In which year was Vrakton founded?", ["1987", "in 1987"]),
    QAExample("q3", "Ünïcode question «x»?", ["Zürich"], {"nested": {"a": [1, 2]}}),
]


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- FlashRAG jsonl -----------------------------------------------------------


def test_qa_jsonl_round_trip(tmp_path):
    path = tmp_path / "qa.jsonl"
    assert write_qa_jsonl(path, EXAMPLES) == 3
    assert read_qa_jsonl(path) == EXAMPLES
    assert list(iter_qa_jsonl(path)) == EXAMPLES
    # No temp files are left behind by the atomic writer.
    assert sorted(os.listdir(tmp_path)) == ["qa.jsonl"]


def test_qa_jsonl_accepts_int_id_single_string_answer_and_blank_lines(tmp_path):
    path = _write_lines(
        tmp_path / "qa.jsonl",
        [
            json.dumps({"id": 5, "question": "Q?", "golden_answers": "Paris"}),
            "",
            json.dumps({"id": "b", "question": "R?", "golden_answers": ["x"], "metadata": None}),
        ],
    )
    got = read_qa_jsonl(path)
    assert got == [QAExample("5", "Q?", ["Paris"], {}), QAExample("b", "R?", ["x"], {})]


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"question": "Q?", "golden_answers": ["a"]}', "missing field 'id'"),
        ('{"id": "x", "golden_answers": ["a"]}', "missing field 'question'"),
        ('{"id": "x", "question": "Q?"}', "missing field 'golden_answers'"),
        ('{"id": "x", "question": "Q?", "golden_answers": []}', "empty list"),
        ('{"id": "x", "question": "Q?", "golden_answers": [1987]}', "'golden_answers'[0] must be a string"),
        (
            '{"id": "x", "question": "Q?", "golden_answers": ["a", " "]}',
            "'golden_answers'[1] is an empty string",
        ),
        ('{"id": "x", "question": "  ", "golden_answers": ["a"]}', "'question' must be a non-empty string"),
        (
            '{"id": "x", "question": "Q?", "golden_answers": ["a"], "metadata": [1]}',
            "'metadata' must be an object",
        ),
        ('{"id": true, "question": "Q?", "golden_answers": ["a"]}', "'id' must be a string or integer"),
    ],
)
def test_qa_jsonl_bad_record_names_line(tmp_path, bad_line, needle):
    good = json.dumps({"id": "ok", "question": "Q?", "golden_answers": ["a"]})
    path = _write_lines(tmp_path / "qa.jsonl", [good, "", bad_line])
    with pytest.raises(DataFormatError) as info:
        read_qa_jsonl(path)
    assert info.value.line == 3
    assert needle in info.value.message
    assert f"{path}:3:" in str(info.value)


def test_qa_jsonl_duplicate_id_names_both_lines(tmp_path):
    rec = json.dumps({"id": "dup", "question": "Q?", "golden_answers": ["a"]})
    other = json.dumps({"id": "z", "question": "Q?", "golden_answers": ["a"]})
    path = _write_lines(tmp_path / "qa.jsonl", [rec, other, rec])
    with pytest.raises(
        DataFormatError, match=r"duplicate id 'dup' \(first at line 1, again at line 3\)"
    ) as info:
        read_qa_jsonl(path)
    assert info.value.line == 3


def test_missing_file_is_a_data_format_error(tmp_path):
    with pytest.raises(DataFormatError, match="does not exist"):
        read_qa_jsonl(tmp_path / "nope.jsonl")


# --- Search-R1 parquet ---------------------------------------------------------


def test_searchr1_parquet_round_trip_and_columns(tmp_path):
    path = tmp_path / "train.parquet"
    assert write_searchr1_parquet(path, EXAMPLES, split="test") == 3
    assert read_searchr1_parquet(path) == EXAMPLES  # sleuth's own metadata column round-trips as is
    assert {r["data_source"] for r in pq.read_table(path).to_pylist()} == {"sleuth"}  # no dataset named
    # `data_source` is the dataset of questions that name none: in their metadata too, so it is read back
    assert write_searchr1_parquet(path, EXAMPLES, data_source="nq", split="test") == 3
    assert read_searchr1_parquet(path) == [
        QAExample(e.id, e.question, e.golden_answers, {**e.metadata, "dataset": "nq"}) for e in EXAMPLES
    ]

    rows = pq.read_table(path).to_pylist()
    row = rows[1]
    assert row["data_source"] == "nq"
    assert row["ability"] == "fact-reasoning"
    assert row["prompt"] == [
        {"role": "user", "content": SEARCH_R1_TEMPLATE.replace("{question}", EXAMPLES[1].question)}
    ]
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": ["1987", "in 1987"]}}
    assert row["extra_info"] == {"split": "test", "index": 1}
    assert row["prompt"][0]["content"].endswith("Question: In which year was Vrakton founded?\n")


def test_searchr1_parquet_without_flashrag_columns(tmp_path):
    """Files with only Search-R1's own columns: question from the prompt, answers from the target."""
    table = pa.Table.from_pylist(
        [
            {
                "data_source": "nq",
                "prompt": [{"role": "user", "content": "Answer it. Question: where is Vrakton?\n"}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": ["Zarvonia"]}},
                "extra_info": {"split": "train", "index": 7},
            }
        ]
    )
    path = tmp_path / "bare.parquet"
    pq.write_table(table, path)
    assert read_searchr1_parquet(path) == [
        QAExample("train_7", "where is Vrakton?", ["Zarvonia"], {"dataset": "nq"})
    ]


def test_searchr1_parquet_bad_rows_name_row_number(tmp_path):
    good = {
        "prompt": [{"role": "user", "content": "Question: a?"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["x"]}},
    }
    no_question = {
        "prompt": [{"role": "user", "content": "no marker here"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["x"]}},
    }
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([good, good, no_question]), path)
    with pytest.raises(
        DataFormatError, match=r"row 3: no 'question' column, and the user message .* no 'Question:'"
    ):
        read_searchr1_parquet(path)

    empty_target = dict(good, reward_model={"style": "rule", "ground_truth": {"target": []}})
    pq.write_table(pa.Table.from_pylist([good, empty_target]), path)
    with pytest.raises(DataFormatError, match=r"row 2: 'golden_answers' is an empty list"):
        read_searchr1_parquet(path)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("hello")
    with pytest.raises(DataFormatError, match="not a readable parquet file"):
        read_searchr1_parquet(path)


def test_template_must_have_question_slot(tmp_path):
    with pytest.raises(ValueError, match=r"\{question\}"):
        write_searchr1_parquet(tmp_path / "x.parquet", EXAMPLES, template="no slot")


# --- dispatch --------------------------------------------------------------------


def test_load_and_save_dispatch_on_extension(tmp_path):
    for name in ("a.jsonl", "a.json", "a.parquet"):
        save_qa(tmp_path / name, EXAMPLES)
        assert load_qa(tmp_path / name) == EXAMPLES
    array = tmp_path / "array.json"
    array.write_text(json.dumps([e.to_dict() for e in EXAMPLES]))
    assert load_qa(array) == EXAMPLES
    array.write_text(json.dumps([EXAMPLES[0].to_dict(), {"id": "b", "question": "Q"}]))
    with pytest.raises(DataFormatError, match=r"record 1 \(0-based\): missing field 'golden_answers'"):
        load_qa(array)
    for bad in ("a.csv", "noext"):
        with pytest.raises(DataFormatError, match="unknown QA file extension"):
            load_qa(tmp_path / bad)
        with pytest.raises(DataFormatError, match="unknown QA file extension"):
            save_qa(tmp_path / bad, EXAMPLES)


# --- corpus --------------------------------------------------------------------------


def test_write_corpus_streams_and_round_trips(tmp_path):
    passages = [
        Passage("0", "Vrakton", "Vrakton is a city."),
        Passage("p-1", 'Say "hi"', "Line\nwith newline"),
    ]

    def gen():
        yield from passages

    path = tmp_path / "corpus.jsonl"
    assert write_corpus(path, gen()) == 2
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"id": "0", "contents": '"Vrakton"\nVrakton is a city.'}
    got = list(iter_corpus(path))
    assert [(p.id, p.title) for p in got] == [("0", "Vrakton"), ("p-1", 'Say "hi"')]
    assert got[1].text == "Line\nwith newline"


def test_write_corpus_failure_leaves_old_file_and_no_temp(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("old\n")

    def broken():
        yield Passage("0", "A", "a")
        raise RuntimeError("generator died")

    with pytest.raises(RuntimeError):
        write_corpus(path, broken())
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["corpus.jsonl"]


# --- score cache -----------------------------------------------------------------------


def test_score_cache_persists_and_reloads(tmp_path):
    path = tmp_path / "scores.jsonl"
    cache = ScoreCache(path)
    assert len(cache) == 0 and cache.get("a") is None and "a" not in cache
    cache.set("a", 1)
    cache.update({"b": 0.25, "c": 0.0})
    cache.save()
    again = ScoreCache(path)
    assert dict(again.items()) == {"a": 1.0, "b": 0.25, "c": 0.0}
    assert "b" in again and again.get("b") == 0.25
    assert again.missing(["a", "zz", "c", "yy"]) == ["zz", "yy"]


def test_score_cache_later_line_wins(tmp_path):
    path = _write_lines(tmp_path / "s.jsonl", ['{"id": "a", "score": 0}', "", '{"id": "a", "score": 1}'])
    assert ScoreCache(path).get("a") == 1.0


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{oops", "invalid JSON"),
        ('{"id": "a"}', '"score"'),
        ('{"id": "a", "score": "high"}', "must be a number"),
        ('{"id": "a", "score": true}', "must be a number"),
        ('{"id": "a", "score": NaN}', "must be finite"),
    ],
)
def test_score_cache_bad_line(tmp_path, line, needle):
    path = _write_lines(tmp_path / "s.jsonl", ['{"id": "ok", "score": 0.5}', line])
    with pytest.raises(DataFormatError) as info:
        ScoreCache(path)
    assert info.value.line == 2
    assert needle in info.value.message


def test_score_cache_rejects_bad_values_in_memory(tmp_path):
    cache = ScoreCache(tmp_path / "s.jsonl")
    with pytest.raises(ValueError, match="finite"):
        cache.set("a", float("inf"))
    with pytest.raises(ValueError, match="number"):
        cache.update({"a": 0.5, "b": None})  # type: ignore[dict-item]
    assert "a" not in cache  # update is all-or-nothing


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temp(tmp_path):
    from sleuth.utils import atomic_open, atomic_path, atomic_write_text

    path = tmp_path / "out.jsonl"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError), atomic_open(path, "w") as f:
        f.write("half a new fi")
        raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("also half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]


def _search_r1_row(data_source: str, qid: str, question: str, answers: list[str], index: int) -> dict:
    """A row of Search-R1's scripts/data_process/qa_search_test_merge.py output: FlashRAG columns kept."""
    return {
        "id": qid,
        "question": question,
        "golden_answers": answers,
        "data_source": data_source,
        "prompt": [{"role": "user", "content": SEARCH_R1_TEMPLATE.replace("{question}", question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "test", "index": index},
    }


def test_merged_multi_dataset_parquet_gets_ids_unique_per_data_source(tmp_path):
    rows = [
        _search_r1_row("nq", "test_0", "where is Vrakton?", ["Zarvonia"], 0),
        _search_r1_row("nq", "test_1", "who founded Vrakton?", ["Mara Ilves"], 1),
        _search_r1_row("triviaqa", "test_0", "which river flows through Quellstad?", ["the Vell"], 2),
        _search_r1_row("hotpotqa", "test_0", "what is north of Tarsk?", ["Varonia"], 3),
    ]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    examples = read_searchr1_parquet(path)
    assert [ex.id for ex in examples] == ["nq/test_0", "nq/test_1", "triviaqa/test_0", "hotpotqa/test_0"]
    assert [ex.metadata for ex in examples] == [
        {"dataset": "nq", "source_id": "test_0"},
        {"dataset": "nq", "source_id": "test_1"},
        {"dataset": "triviaqa", "source_id": "test_0"},
        {"dataset": "hotpotqa", "source_id": "test_0"},
    ]
    # a repeat inside one data_source is still an error naming the rows
    pq.write_table(pa.Table.from_pylist(rows + [_search_r1_row("nq", "test_1", "again?", ["x"], 4)]), path)
    with pytest.raises(DataFormatError, match=r"duplicate id 'nq/test_1' \(first at row 2, again at row 5\)"):
        read_searchr1_parquet(path)


def test_merged_flashrag_jsonl_with_data_source_field(tmp_path):
    path = tmp_path / "merged.jsonl"
    _write_lines(
        path,
        [
            json.dumps({"id": "test_0", "question": "a?", "golden_answers": ["x"], "data_source": "nq"}),
            json.dumps({"id": "test_0", "question": "b?", "golden_answers": ["y"], "data_source": "popqa"}),
        ],
    )
    assert [(ex.id, ex.metadata["dataset"]) for ex in load_qa(path)] == [
        ("nq/test_0", "nq"),
        ("popqa/test_0", "popqa"),
    ]


def test_merged_file_reports_each_data_source_as_its_own_dataset(tmp_path):
    from sleuth.eval.harness import load_eval_data

    rows = [
        _search_r1_row("nq", "test_0", "q1?", ["a"], 0),
        _search_r1_row("triviaqa", "test_0", "q2?", ["b"], 1),
    ]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [ex.metadata["dataset"] for ex in load_eval_data([path])] == ["nq", "triviaqa"]


def test_r_search_parquet_loads(tmp_path):
    """R-Search's src/pre_data/*.py rows: system + user prompt (the user message is the bare question),
    the answer as one string, extra_info with only an index, no id or question column."""
    system = "You are a helpful assistant that can solve the given question step by step ..."
    rows = [
        {
            "data_source": "2wikimultihopqa",
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "ability": "qa_serach",
            "reward_model": {"style": "rule", "ground_truth": {"target": a}},
            "extra_info": {"index": i},
        }
        for i, (q, a) in enumerate(
            [("Who directed Blue Harbor?", "Mara Ilves"), ("Is Tarsk in Varonia?", "yes")]
        )
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_searchr1_parquet(path) == [
        QAExample("data_0", "Who directed Blue Harbor?", ["Mara Ilves"], {"dataset": "2wikimultihopqa"}),
        QAExample("data_1", "Is Tarsk in Varonia?", ["yes"], {"dataset": "2wikimultihopqa"}),
    ]


def test_converted_files_merged_keep_their_data_sources(tmp_path):
    """Two FlashRAG test files converted with `sleuth data convert --data-source`, then concatenated as
    Search-R1's qa_search_test_merge.py does: each row keeps its dataset, so the colliding ids load apart."""
    from typer.testing import CliRunner

    from sleuth.cli import app

    parts = []
    for name, question in (("nq", "a?"), ("popqa", "b?")):
        (tmp_path / name).mkdir()
        src = _write_lines(
            tmp_path / name / "test.jsonl",
            [
                json.dumps({"id": f"test_{i}", "question": f"{question} {i}", "golden_answers": ["x"]})
                for i in range(2)
            ],
        )
        dst = tmp_path / f"{name}.parquet"
        result = CliRunner().invoke(
            app, ["data", "convert", str(src), str(dst), "--data-source", name, "--split", "test"]
        )
        assert result.exit_code == 0, result.output
        parts.append(pq.read_table(dst))
        assert {r["data_source"] for r in parts[-1].to_pylist()} == {name}
    merged = tmp_path / "test.parquet"
    pq.write_table(pa.concat_tables(parts), merged)
    examples = load_qa(merged)
    assert [e.id for e in examples] == ["nq/test_0", "nq/test_1", "popqa/test_0", "popqa/test_1"]
    assert {e.metadata["dataset"] for e in examples} == {"nq", "popqa"}
    # to jsonl and back: the dataset stays with each question
    result = CliRunner().invoke(app, ["data", "convert", str(merged), str(tmp_path / "merged.jsonl")])
    assert result.exit_code == 0, result.output
    assert [e.metadata["dataset"] for e in load_qa(tmp_path / "merged.jsonl")] == [
        "nq",
        "nq",
        "popqa",
        "popqa",
    ]

    # files sleuth wrote before (the data source only in the column, metadata "{}") merge too
    old = [
        t.set_column(t.schema.get_field_index("metadata"), "metadata", pa.array(["{}"] * t.num_rows))
        for t in parts
    ]
    pq.write_table(pa.concat_tables(old), merged)
    assert [e.id for e in load_qa(merged)] == ["nq/test_0", "nq/test_1", "popqa/test_0", "popqa/test_1"]
    # without a data source, the duplicate is named with the way out
    pq.write_table(
        pa.concat_tables(
            [
                t.set_column(
                    t.schema.get_field_index("data_source"), "data_source", pa.array(["sleuth"] * t.num_rows)
                )
                for t in old
            ]
        ),
        merged,
    )
    with pytest.raises(DataFormatError, match=r"duplicate id 'test_0'.*--data-source NAME"):
        load_qa(merged)
