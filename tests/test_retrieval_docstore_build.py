"""sleuth.retrieval.docstore_build: the parallel docstore build writes DocStore.build's files byte for
byte (same ids, titles and texts at the same rows) and raises iter_corpus' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.data.formats import iter_corpus
from sleuth.errors import DataFormatError
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.docstore_build import build_docstore_parallel, line_ranges

FILES = ("strings.bin", "offsets.npy", "docstore.json")


def _corpus(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        if i % 7 == 3:  # title/text records, non-ASCII text, an empty title
            lines.append(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "title": "" if i % 2 else f"Tïtle {i}",
                        "text": f"Ünïcode text {i} " * (i % 5 + 1),
                    },
                    ensure_ascii=False,
                )
            )
        else:
            lines.append(
                json.dumps({"id": f"p{i}", "contents": f'"Title {i}"\nbody {i} ' + "word " * (i % 13)})
            )
        if i % 50 == 10:
            lines.append("   ")  # blank lines are skipped
    path.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_parallel_build_writes_the_serial_build_files(tmp_path: Path, workers: int) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 997)
    serial = DocStore.build(iter_corpus(corpus, unique_ids=True), tmp_path / "serial")
    parallel = build_docstore_parallel(corpus, tmp_path / "parallel", workers)
    for name in FILES:
        assert (tmp_path / "parallel" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes(), name
    assert parallel.num_docs == serial.num_docs == 997
    assert parallel.get(range(997)) == serial.get(range(997))
    assert sorted(p.name for p in (tmp_path / "parallel").iterdir()) == sorted(FILES)  # no parts left


def test_line_ranges_start_at_line_starts_and_cover_the_file(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 300)
    data = corpus.read_bytes()
    for parts in (1, 2, 5, 64, 10_000):
        ranges = line_ranges(corpus, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(data) and len(ranges) <= parts
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(data[a - 1 : a] == b"\n" for a, _ in ranges[1:])


def test_errors_name_the_same_line_as_the_serial_reader(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 400)
    lines = corpus.read_text(encoding="utf-8").splitlines()
    lines[350] = '{"id": "bad", "contents": '  # invalid JSON late in the file: in the last range
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError) as serial:
        DocStore.build(iter_corpus(corpus, unique_ids=True), tmp_path / "serial")
    with pytest.raises(DataFormatError) as parallel:
        build_docstore_parallel(corpus, tmp_path / "parallel", 3)
    assert str(parallel.value) == str(serial.value) and parallel.value.line == 351
    assert not (tmp_path / "parallel").exists() and not list(tmp_path.glob(".parallel.building-*"))


def test_a_repeated_id_across_ranges_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 400)
    with open(corpus, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "p5", "contents": "again"}) + "\n")
    with pytest.raises(DataFormatError, match="duplicate id 'p5'"):
        build_docstore_parallel(corpus, tmp_path / "parallel", 3)


def test_an_empty_corpus_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="holds no passages"):
        build_docstore_parallel(tmp_path / "c.jsonl", tmp_path / "d", 2)


def test_a_docstore_index_feeds_a_dense_build_and_is_not_searchable(tmp_path: Path) -> None:
    from sleuth.data.formats import corpus_fingerprint
    from sleuth.errors import IndexMismatchError
    from sleuth.retrieval.docstore_build import build_docstore_index
    from sleuth.retrieval.index import build_index, load_retriever

    corpus = _corpus(tmp_path / "c.jsonl", 120)
    manifest = build_docstore_index(corpus, tmp_path / "store", 2)
    assert manifest["kind"] == "docstore" and manifest["num_docs"] == 120
    assert manifest["corpus_fingerprint"] == corpus_fingerprint(corpus)
    with pytest.raises(IndexMismatchError, match="holds only a docstore"):
        load_retriever(tmp_path / "store")
    dense = build_index(
        None, "dense", tmp_path / "flat", docstore_from=tmp_path / "store", show_progress=False
    )
    assert dense["num_docs"] == 120 and dense["corpus_fingerprint"] == manifest["corpus_fingerprint"]
    hits = load_retriever(tmp_path / "flat").search(["Title 17 body 17"], 3)[0]
    passages = {p.id: (p.title, p.text) for p in iter_corpus(corpus)}
    assert len(hits) == 3 and all(passages[h.doc_id] == (h.title, h.text) for h in hits)
