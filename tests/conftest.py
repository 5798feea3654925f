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


@pytest.fixture(scope="session")
def one_layer_minilm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded MiniLM cut to its first transformer layer, saved as a sentence-transformers model dir
    (built once a worker, in its own temporary folder; nothing shared). Same tokenizer, pooling,
    normalisation and 384-dim vectors at about a fifth of the encoding cost: for tests of what the
    encoding pipeline does with vectors (files, indexes, servers), not of MiniLM's retrieval quality."""
    from sentence_transformers import SentenceTransformer

    from sleuth.retrieval.encoders import resolve_encoder_path

    model = SentenceTransformer(resolve_encoder_path("minilm"), device="cpu")
    bert = model[0].auto_model
    bert.encoder.layer = bert.encoder.layer[:1]
    bert.config.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("minilm-one-layer") / "model"
    model.save(str(out))
    return str(out)
