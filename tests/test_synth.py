"""The synthetic world: determinism, answerability from supporting passages, hop counts, CLI."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.data.filters import is_yes_no
from sleuth.data.formats import iter_corpus, read_qa_jsonl
from sleuth.data.names import RARE_ONSETS
from sleuth.data.synth import (
    GENERATOR_VERSION,
    generate_world,
    parse_hops,
    split_sizes,
    write_world,
)


@pytest.fixture(scope="module")
def world():
    return generate_world(1500, 600, hops=(1, 4), seed=11)


@pytest.fixture(scope="module")
def passages(world):
    return {p.id: p for p in world.iter_passages()}


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_arguments_give_byte_identical_files(tmp_path):
    for name in ("a", "b"):
        write_world(generate_world(300, 80, hops=(1, 4), seed=5), tmp_path / name)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert set(_digest(tmp_path / "a")) == {
        "corpus.jsonl",
        "train.jsonl",
        "dev.jsonl",
        "test.jsonl",
        "world.json",
    }
    write_world(generate_world(300, 80, hops=(1, 4), seed=6), tmp_path / "c")
    assert _digest(tmp_path / "a")["corpus.jsonl"] != _digest(tmp_path / "c")["corpus.jsonl"]


def test_exact_counts_and_unique_ids(world, passages):
    assert len(passages) == 1500
    assert set(passages) == {str(i) for i in range(1500)}
    assert len(world.questions) == 600
    assert len({q.id for q in world.questions}) == 600
    assert len({q.question for q in world.questions}) == 600
    assert len(set(world.names)) == len(world.names)
    # Some entities have a second passage ("Name (early life)" ...): titles repeat only as those.
    titles = Counter(p.title.split(" (")[0] for p in passages.values())
    assert 0 < sum(1 for c in titles.values() if c == 2) == len(world.extra_passage)


def test_names_are_fictional_by_construction(world):
    # Every made-up word carries a cluster English never starts a word with; whole names are
    # made-up words plus (for titles/orgs) common nouns, so each name has at least one.
    for name in world.names:
        assert any(onset in name.lower() for onset in RARE_ONSETS), name


def test_every_question_is_answerable_from_its_supporting_passages(world, passages):
    for q in world.questions:
        meta = q.metadata
        support = [passages[pid] for pid in meta["supporting_ids"]]
        assert meta["hops"] == len(support), q
        assert not is_yes_no(q)
        if meta["type"] in ("single", "compositional"):
            chain = meta["chain"]
            assert len(chain) == meta["hops"] + 1 == len(meta["relations"]) + 1
            assert chain[0] in q.question
            assert chain[-1] == q.golden_answers[0]
            for hop, passage in enumerate(support):
                # hop i's passage is about chain[i] and names chain[i+1] (the bridge, finally the answer)
                assert passage.title.startswith(chain[hop]), (q.question, hop, passage.title)
                assert chain[hop + 1] in passage.text, (q.question, hop, passage.text)
            # No bridge entity or answer is named in the question itself.
            for later in chain[1:]:
                assert later not in q.question
        else:
            a, b = (meta["chain"][0], meta["chain"][len(meta["chain"]) // 2])
            assert a in q.question and b in q.question
            year_a, year_b = meta["values"]
            assert year_a != year_b
            half = len(support) // 2
            assert str(year_a) in support[half - 1].text and str(year_b) in support[-1].text
            if half == 2:  # via a person: entity passage names the person whose passage gives the year
                assert meta["chain"][1] in support[0].text and meta["chain"][3] in support[2].text
            want_a = (year_a < year_b) == (meta["compare"] == "earlier")
            assert q.golden_answers == [a if want_a else b]
            assert meta["compare"] in q.question


def test_hop_and_type_mix(world):
    hops = Counter(q.metadata["hops"] for q in world.questions)
    assert set(hops) == {1, 2, 3, 4}
    assert min(hops.values()) > 600 / 4 * 0.6  # roughly uniform over the range
    types = Counter(q.metadata["type"] for q in world.questions)
    assert types["single"] == hops[1]
    assert types["comparison"] > 0 and types["compositional"] > 0
    assert all(q.metadata["hops"] in (2, 4) for q in world.questions if q.metadata["type"] == "comparison")


def test_hop_range_is_respected():
    world = generate_world(400, 60, hops=(3, 3), seed=2)
    assert {q.metadata["hops"] for q in world.questions} == {3}
    assert {q.metadata["type"] for q in world.questions} == {"compositional"}
    world = generate_world(400, 40, hops=(5, 5), seed=2)
    assert {len(q.metadata["supporting_ids"]) for q in world.questions} == {5}


def test_country_answers_include_official_name(world, passages):
    country_qs = [q for q in world.questions if len(q.golden_answers) == 2]
    assert country_qs
    for q in country_qs:
        name, official = q.golden_answers
        assert official.endswith(f" of {name}")
        country_passage = next(p for p in passages.values() if p.title == name)
        assert official in country_passage.text


def test_write_world_splits_and_summary(tmp_path, world):
    summary = write_world(world, tmp_path, splits=(0.5, 0.25, 0.25))
    train, dev, test = (read_qa_jsonl(tmp_path / f"{s}.jsonl") for s in ("train", "dev", "test"))
    assert (len(train), len(dev), len(test)) == (300, 150, 150)
    assert [q.id for q in train + dev + test] == [q.id for q in world.questions]
    assert sum(1 for _ in iter_corpus(tmp_path / "corpus.jsonl")) == 1500
    on_disk = json.loads((tmp_path / "world.json").read_text())
    assert on_disk == summary
    assert on_disk["generator_version"] == GENERATOR_VERSION
    assert on_disk["seed"] == 11
    assert sum(on_disk["hop_distribution"].values()) == 600
    assert on_disk["splits"] == {"train": 300, "dev": 150, "test": 150}


def test_bad_arguments():
    assert parse_hops("1-4") == (1, 4)
    assert parse_hops(" 2 ") == (2, 2)
    for bad in ("5-2", "x", "0-3", "1-9", "1-"):
        with pytest.raises(ValueError):
            parse_hops(bad)
    with pytest.raises(ValueError, match="at least"):
        generate_world(10, 5)
    with pytest.raises(ValueError, match="distinct questions"):
        generate_world(40, 500, hops=(1, 1))
    with pytest.raises(ValueError, match="sum"):
        split_sizes(10, (0.5, 0.5, 0.5))
    assert split_sizes(11, (0.8, 0.1, 0.1)) == (9, 1, 1)


def test_synth_and_convert_commands(tmp_path):
    runner = CliRunner()
    out = tmp_path / "w"
    result = runner.invoke(
        app,
        [
            "synth",
            "--out",
            str(out),
            "--passages",
            "200",
            "--questions",
            "50",
            "--hops",
            "1-3",
            "--seed",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "3-hop" in result.output
    assert json.loads((out / "world.json").read_text())["hops"] == [1, 3]

    for bad in ("5-2", "x"):
        result = runner.invoke(app, ["synth", "--out", str(tmp_path / "bad"), "--hops", bad])
        assert result.exit_code == 2
        assert "--hops" in result.output
    assert not (tmp_path / "bad").exists()

    parquet = tmp_path / "train.parquet"
    back = tmp_path / "back.jsonl"
    assert runner.invoke(app, ["data", "convert", str(out / "train.jsonl"), str(parquet)]).exit_code == 0
    assert runner.invoke(app, ["data", "convert", str(parquet), str(back)]).exit_code == 0
    assert back.read_bytes() == (out / "train.jsonl").read_bytes()
    result = runner.invoke(app, ["data", "convert", str(out / "train.jsonl"), str(tmp_path / "x.csv")])
    assert result.exit_code == 2 and "unknown QA file extension" in result.output
