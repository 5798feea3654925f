"""Distractor passages (issue 24): streaming over processes equals the in-memory stream, bounded
memory, no fact about a world entity, and the world's answers stay findable."""

from __future__ import annotations

import json
import tracemalloc
from itertools import chain

import pytest
from typer.testing import CliRunner

from sleuth.cli import app
from sleuth.data.distractors import (
    BLOCK,
    corpus_line,
    distractor_pools,
    iter_distractors,
    write_distractors,
)
from sleuth.data.formats import iter_corpus, write_corpus
from sleuth.data.synth import generate_world, write_world


@pytest.fixture(scope="module")
def world():
    return generate_world(400, 60, hops=(1, 2), seed=5)


def test_streaming_writer_over_processes_equals_in_memory_corpus(world, tmp_path) -> None:
    size = world.num_passages + 2 * BLOCK + 123  # two full blocks and a partial one
    write_world(world, tmp_path / "streamed", corpus_size=size, workers=2)
    reference = tmp_path / "reference.jsonl"
    write_corpus(
        reference, chain(world.iter_passages(), iter_distractors(distractor_pools(world), size - 400, 400))
    )
    streamed = (tmp_path / "streamed" / "corpus.jsonl").read_bytes()
    assert streamed == reference.read_bytes()
    assert streamed.count(b"\n") == size
    summary = json.loads((tmp_path / "streamed" / "world.json").read_text())
    assert summary["corpus"] == {
        "num_passages": size,
        "world_passages": 400,
        "distractor_passages": size - 400,
        "distractor_block": BLOCK,
    }
    # The world's own files are those of a world written without distractors.
    write_world(world, tmp_path / "plain")
    for name in ("train.jsonl", "dev.jsonl", "test.jsonl"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    plain = (tmp_path / "plain" / "corpus.jsonl").read_bytes()
    assert streamed.startswith(plain)


def test_distractors_name_no_world_entity_and_share_its_names(world) -> None:
    pools = distractor_pools(world)
    passages = list(iter_distractors(pools, 3000, world.num_passages))
    assert [p.id for p in passages] == [str(world.num_passages + i) for i in range(3000)]
    titles = {p.title for p in passages}
    assert not titles & set(world.names)  # no distractor is about a world entity
    words = [len(p.text.split()) + len(p.title.split()) for p in passages]
    assert 85 <= sum(words) / len(words) <= 115  # Wikipedia-like ~100-word passages
    # World entity names and relation wording appear in distractors (they compete with gold passages).
    text = " ".join(p.text for p in passages)
    mentioned = sum(1 for n in world.names if n in text)
    assert mentioned > len(world.names) // 4
    assert " was born in " in text and " works for " in text


def test_memory_of_the_writer_does_not_grow_with_the_corpus(world) -> None:
    pools = distractor_pools(world)

    def peak(n: int) -> int:
        tracemalloc.start()
        write_distractors(_Sink(), pools, n, 0, workers=1)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(2 * BLOCK), peak(8 * BLOCK)
    assert large < 1.3 * small, (small, large)


class _Sink:
    """A file that keeps nothing (the written bytes must not count as the writer's memory)."""

    def write(self, text: str) -> int:
        return len(text)


def test_world_answers_stay_findable_with_bm25(world, tmp_path) -> None:
    from sleuth.retrieval.index import build_index, load_retriever

    write_world(world, tmp_path / "w", corpus_size=world.num_passages + 5000, workers=1)
    build_index(tmp_path / "w" / "corpus.jsonl", "bm25", tmp_path / "idx", show_progress=False)
    retriever = load_retriever(tmp_path / "idx")
    singles = [q for q in world.questions if q.metadata["hops"] == 1][:20]
    hits = retriever.search([q.question for q in singles], 5)
    found = sum(
        q.metadata["supporting_ids"][0] in {h.doc_id for h in hs} for q, hs in zip(singles, hits, strict=True)
    )
    assert found >= 0.7 * len(singles)
    # The distractors are competition: they take some of the top-5 places.
    distractor_hits = sum(int(h.doc_id) >= world.num_passages for hs in hits for h in hs)
    assert distractor_hits > 0


def test_cli_corpus_size_and_errors(tmp_path) -> None:
    runner = CliRunner()
    out = tmp_path / "w"
    result = runner.invoke(
        app,
        [
            "synth",
            "--out",
            str(out),
            "--passages",
            "100",
            "--questions",
            "10",
            "--hops",
            "1",
            "--corpus-size",
            "700",
            "--workers",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert sum(1 for _ in iter_corpus(out / "corpus.jsonl")) == 700
    bad = runner.invoke(app, ["synth", "--out", str(out), "--passages", "100", "--corpus-size", "50"])
    assert bad.exit_code == 2 and "--corpus-size" in bad.output
    assert corpus_line(next(iter_corpus(out / "corpus.jsonl"))).startswith('{"id": "0"')
