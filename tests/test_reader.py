"""`sleuth train-reader`: a frozen reader SFT'd on (question + gold passages -> answer), in the hand-over's prompt."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sleuth.claims.reader import (
    READER_FILE,
    ReaderSettings,
    gold_questions,
    reader_check,
    reader_documents,
    reader_records,
    train_reader,
)
from sleuth.cli import app
from sleuth.data.formats import QAExample
from sleuth.data.synth import generate_world, write_world
from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit
from sleuth.rewards.answerer import document_prompt


def _world(path, questions=60, splits=(0.5, 0.0, 0.5)):
    from sleuth.retrieval import build_index

    write_world(generate_world(40, questions, hops=(1, 1), seed=0), path, splits=splits)
    build_index(path / "corpus.jsonl", "bm25", path / "bm25")
    return path


def test_reader_records_are_the_hand_over_prompt_then_the_answer():
    from transformers import AutoTokenizer

    from sleuth.llm.registry import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    ex = QAExample(id="q1", question="Who founded Zvex?", golden_answers=["Kvar Dzul", "K. Dzul"])
    docs = [Hit("7", "Zvex", "Zvex was founded by Kvar Dzul.", 1.0)]
    s3, qagent = reader_records([ex], [docs], tokenizer, ("s3", "qagent"))
    for record, template in ((s3, "s3"), (qagent, "qagent")):
        expected = tokenizer.apply_chat_template(
            document_prompt("Who founded Zvex?", docs, template), tokenize=False, add_generation_prompt=True
        )
        assert record.prompt_text == expected
        assert record.prompt_ids == tokenizer.encode(expected, add_special_tokens=False)
        assert record.response_text == "Kvar Dzul" and record.source == f"reader-{template}"
        assert record.response_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(record.response_ids[:-1]) == "Kvar Dzul"
        assert record.loss_mask == [1] * len(record.response_ids)
    assert "Zvex was founded by Kvar Dzul." in s3.prompt_text and s3.prompt_text != qagent.prompt_text


def test_reader_documents_hold_the_gold_passages_and_non_gold_distractors(tmp_path):
    from sleuth.eval.harness import resolve_retriever

    world = _world(tmp_path / "w")
    questions = gold_questions(world / "train.jsonl", 10)
    retriever = resolve_retriever(world / "bm25")
    docs = reader_documents(retriever, questions, 2, seed=0)
    for ex, group in zip(questions, docs, strict=True):
        ids = [h.doc_id for h in group]
        gold = [str(d) for d in ex.metadata["supporting_ids"]]
        assert set(gold) <= set(ids) and len(ids) == len(set(ids)) == len(gold) + 2
    assert reader_documents(retriever, questions, 2, seed=0) == docs  # seeded: the same documents every run
    only_gold = reader_documents(retriever, questions, 0, seed=0)
    assert [sorted(h.doc_id for h in g) for g in only_gold] == [
        sorted(map(str, ex.metadata["supporting_ids"])) for ex in questions
    ]


def test_trained_reader_beats_the_base_and_loads_as_a_frozen_generator(tmp_path):
    """Tiny model, 40-passage single-hop world, 30 training questions, s3 prompt, gold passages only (about
    25 s on 2 cores). Measured: the base answers 0/30 from gold passages, the trained reader 29/30 (96.7%)
    on its training questions. On the 30 held-out questions it gets 0/30: the tiny random model
    memorises its training prompts, it does not learn to read, so the comparison is made on the training
    questions; what it shows is that the step trains and saves a reader in the hand-over's prompt format."""
    from sleuth.llm.registry import load_generator
    from sleuth.rewards.answerer import answer_from_documents
    from sleuth.rewards.metrics import exact_match

    world = _world(tmp_path / "w")
    settings = ReaderSettings(
        model="tiny", templates=("s3",), distractors=0, epochs=40, lr=3e-3, batch_size=8, lora=False
    )
    reader = train_reader(world, tmp_path / "reader", settings)
    trained = reader_check(world, str(reader), tmp_path / "reader", split="train", templates=("s3",))["s3"]
    base = reader_check(world, "tiny", tmp_path / "base", split="train", templates=("s3",))["s3"]
    assert base["n"] == trained["n"] == 30
    assert base["em"] == 0.0 and trained["em"] >= 0.8
    assert trained["em_ci"][0] > base["em_ci"][1]  # the intervals do not overlap
    saved = json.loads((tmp_path / "reader" / READER_FILE).read_text())
    assert saved["reader"] == str(reader) and saved["questions"] == 30
    assert json.loads((tmp_path / "reader" / "reader_check.json").read_text())["s3"]["em"] == trained["em"]
    # the exported reader loads on the CPU as a plain model spec, the way a recipe's reward.generator does,
    # and answers through the same hand-over the s3 reward and evaluation use
    from sleuth.eval.baselines import gold_passages
    from sleuth.eval.harness import resolve_retriever

    generator = load_generator(str(reader))
    assert str(next(generator.model.parameters()).device) == "cpu"
    questions = gold_questions(world / "train.jsonl", None)
    answers = answer_from_documents(
        generator,
        [q.question for q in questions],
        gold_passages(resolve_retriever(world / "bm25"), questions),
        "s3",
    )
    direct = sum(exact_match(a, q.golden_answers) for a, q in zip(answers, questions, strict=True)) / len(
        questions
    )
    assert direct >= 0.8
    assert train_reader(world, tmp_path / "reader", settings) == reader  # a finished reader is reused


def test_bad_reader_inputs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="train.jsonl does not exist"):
        train_reader(tmp_path / "nowhere", tmp_path / "r", ReaderSettings(model="tiny"))
    with pytest.raises(ConfigError, match="reader templates \\['fancy'\\]"):
        train_reader(tmp_path, tmp_path / "r", ReaderSettings(model="tiny", templates=("fancy",)))
    with pytest.raises(ConfigError, match="--distractors must be >= 0"):
        ReaderSettings(distractors=-1).check()
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.jsonl").write_text(
        json.dumps({"id": "a", "question": "q?", "golden_answers": ["x"]}) + "\n"
    )
    with pytest.raises(ConfigError, match="question a .* has no gold passages"):
        gold_questions(plain / "train.jsonl", None)
    with pytest.raises(ConfigError, match="is not an index: build it with `sleuth index"):
        train_reader(plain, tmp_path / "r", ReaderSettings(model="tiny"))
    result = CliRunner().invoke(
        app,
        [
            "train-reader",
            str(plain),
            "--out",
            str(tmp_path / "r"),
            "--model",
            "tiny",
            "--templates",
            "s3,nope",
        ],
        terminal_width=300,
    )
    assert result.exit_code == 2 and "reader templates ['s3', 'nope']" in result.output
