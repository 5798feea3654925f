"""A world with a knowledge boundary: `synth --known-fraction`, knowledge injection, the boundary check."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sleuth.claims.knowledge import (
    InjectionSettings,
    boundary_check,
    inject_knowledge,
    injection_records,
    read_statements,
)
from sleuth.cli import app
from sleuth.data.synth import KNOWLEDGE_FILE, generate_world, write_world
from sleuth.data.synth_questions import knowledge_statements, knowledge_type
from sleuth.data.world_schema import ENTITY_TYPES, RELATIONS_BY_SUBJECT
from sleuth.eval.baselines import DIRECT_PROMPT


def _all_facts(world):
    for etype in ENTITY_TYPES:
        for gid in range(world.type_start[etype], world.type_start[etype] + world.type_count[etype]):
            for relation in RELATIONS_BY_SUBJECT[etype]:
                yield relation, gid


def test_knowledge_type_of_hops():
    assert knowledge_type([True]) == "all-known"
    assert knowledge_type([True, True, True]) == "all-known"
    assert knowledge_type([False, False]) == "all-unknown"
    assert knowledge_type([True, False]) == "mixed"
    assert knowledge_type([False, True, True, True]) == "mixed"


def test_known_fraction_labels_every_hop_and_states_exactly_the_known_facts():
    world = generate_world(400, 300, hops=(1, 4), seed=2, known_fraction=0.3)
    facts = list(_all_facts(world))
    known = [(r, g) for r, g in facts if world.is_known(r.name, g)]
    assert abs(len(known) / len(facts) - 0.3) < 0.05  # ~900 facts: the drawn share is near 0.3
    kinds = set()
    for q in world.questions:
        hops = q.metadata["known_hops"]
        assert len(hops) == len(q.metadata["supporting_ids"]) == q.metadata["hops"]
        assert q.metadata["knowledge"] == knowledge_type(hops)
        kinds.add(q.metadata["knowledge"])
    assert kinds == {"all-known", "mixed", "all-unknown"}
    # a single-hop question's label is its fact's side of the boundary
    single = [q for q in world.questions if q.metadata["type"] == "single"]
    for q in single[:20]:
        relation = q.metadata["relations"][0]
        subject = world.names.index(q.metadata["chain"][0])
        assert q.metadata["known_hops"] == [world.is_known(relation, subject)]
    statements = list(knowledge_statements(world))
    assert len(statements) == sum(len(r.questions) for r, _ in known)
    assert {(s["relation"], s["subject"]) for s in statements} == {(r.name, world.names[g]) for r, g in known}
    # a known single-hop question is word for word one of the statements, with its answer
    known_single = [q for q in single if q.metadata["knowledge"] == "all-known"]
    by_question = {s["question"]: s["answers"] for s in statements}
    assert known_single and all(by_question[q.question] == q.golden_answers for q in known_single)


def test_fact_sides_do_not_depend_on_the_number_of_questions():
    small = generate_world(200, 20, seed=4, known_fraction=0.5)
    large = generate_world(200, 150, seed=4, known_fraction=0.5)
    assert [small.is_known(r.name, g) for r, g in _all_facts(small)] == [
        large.is_known(r.name, g) for r, g in _all_facts(large)
    ]


def test_a_world_without_a_boundary_keeps_its_format(tmp_path):
    summary = write_world(generate_world(200, 40, seed=1), tmp_path)
    assert not (tmp_path / KNOWLEDGE_FILE).exists()
    assert "known_fraction" not in summary and "knowledge_distribution" not in summary
    row = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert "known_hops" not in row["metadata"] and "knowledge" not in row["metadata"]


def test_synth_known_fraction_option(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(
        app,
        [
            "synth",
            "--out",
            str(tmp_path / "bad"),
            "--passages",
            "60",
            "--questions",
            "10",
            "--known-fraction",
            "1.5",
        ],
    )
    assert bad.exit_code == 2 and "--known-fraction must be between 0 and 1, got 1.5" in bad.output
    ok = runner.invoke(
        app,
        [
            "synth",
            "--out",
            str(tmp_path / "w"),
            "--passages",
            "60",
            "--questions",
            "20",
            "--known-fraction",
            "0.5",
        ],
    )
    assert ok.exit_code == 0, ok.output
    summary = json.loads((tmp_path / "w" / "world.json").read_text())
    assert summary["known_fraction"] == 0.5 and sum(summary["knowledge_distribution"].values()) == 20
    assert summary["known_statements"] == len(read_statements(tmp_path / "w")) > 0


def test_read_statements_names_the_missing_file(tmp_path):
    with pytest.raises(Exception, match="--known-fraction"):
        read_statements(tmp_path)


def test_injection_records_train_only_the_answer_after_the_direct_prompt():
    from transformers import AutoTokenizer

    from sleuth.llm.registry import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    [record] = injection_records(
        [{"id": "f", "question": "Who founded Zvex?", "answers": ["Kvar Dzul"]}], tokenizer
    )
    assert DIRECT_PROMPT.format(question="Who founded Zvex?") in record.prompt_text
    assert record.response_text == "<answer> Kvar Dzul </answer>"
    assert record.loss_mask == [1] * len(record.response_ids)
    assert record.response_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(record.response_ids[:-1]) == "<answer> Kvar Dzul </answer>"


def test_injection_makes_the_boundary_real(tmp_path):
    """Tiny model, 40-passage world, single-hop questions, half the facts known: after the closed-book SFT the
    direct EM on all-known questions is far above all-unknown (measured: 93.3% vs 10.0% on 30 + 30 questions)."""
    world = tmp_path / "world"
    write_world(
        generate_world(40, 60, hops=(1, 1), seed=0, known_fraction=0.5), world, splits=(0.0, 0.0, 1.0)
    )
    settings = InjectionSettings(model="tiny", epochs=40, lr=3e-3, batch_size=8, lora=False)
    before = boundary_check(world, "tiny", tmp_path / "base")
    ckpt = inject_knowledge(world, tmp_path / "inject", settings)
    after = boundary_check(world, str(ckpt), tmp_path / "inject")
    assert before["all-known"]["em"] == 0.0  # the random base knows nothing
    assert after["all-known"]["n"] == 30 and after["all-unknown"]["n"] == 30
    assert after["all-known"]["em"] >= 0.8
    assert after["known_minus_unknown"] >= 0.6
    assert after["all-known"]["em_ci"][0] > after["all-unknown"]["em_ci"][1]  # the intervals do not overlap
    saved = json.loads((tmp_path / "inject" / "boundary.json").read_text())
    assert saved["all-known"]["em"] == after["all-known"]["em"]
    assert inject_knowledge(world, tmp_path / "inject", settings) == ckpt  # a finished injection is reused
