"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-passage synthetic world (60 questions, 1-2 hops, seed 0) with its BM25 index; read-only."""
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    out = tmp_path_factory.mktemp("world")
    write_world(generate_world(300, 60, hops=(1, 2), seed=0), out)
    build_index(out / "corpus.jsonl", "bm25", out / "bm25")
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny test model's tokenizer (built once a worker)."""
    from transformers import AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))
