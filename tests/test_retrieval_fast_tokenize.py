"""sleuth.retrieval.fast_tokenize: the bulk encoder's batch tokenizer gives sentence-transformers' preprocess
features exactly (ASCII fast path and full path, truncation, special-token text), and the vectors the bulk
encoder writes with it are the ones it writes with preprocess."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sleuth.data.formats import Passage
from sleuth.retrieval.bulk_encode import EncodePlan, _tokenizer_for, encode_docstore_parallel
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.fast_tokenize import BatchTokenizer

EDGE_CASES = [
    "Plain ASCII Passage About The Harbour Of Velmora, Founded In 1821.",
    '"Title Line"\nText after a newline,\tand a tab\r\nand CRLF.',
    "Café Ünïcode Ärger naïve façade",  # accents: stripped by the normalizer, full path
    "東京 and 北京 are CJK",  # CJK spacing
    "control\x01char and DEL\x7f inside",  # removed by the normalizer's cleaning
    "literal [CLS] and [SEP] and [PAD] and [MASK] special-token text",
    "[unused1] bracket text",
    "",
    "emoji 🙂 text",
    "word " * 400,  # truncated at max_seq_length
    "MiXeD CaSe WoRdS, punctuation!!! (parentheses) 'quotes' \"double\" -- dashes; semicolons: colons.",
]


@pytest.fixture(scope="module")
def model():
    return Encoder(EncoderConfig(name="minilm")).model


def _synthetic(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [
        "Velmora",
        "harbour",
        "founded",
        "the",
        "of",
        "in",
        "Kestrel",
        "Dunmore",
        "guild",
        "river",
        "1821",
        "was",
        "born",
        "works",
        "for",
        "Orrin",
        "Quay",
        "x",
        "zzyzx",
        "antidisestablishmentarianism",
    ]
    return [
        f'"{words[int(rng.integers(len(words)))]} {i}"\n'
        + " ".join(words[j] for j in rng.integers(0, len(words), int(rng.integers(1, 160))))
        for i in range(n)
    ]


def test_features_equal_sentence_transformers_preprocess(model) -> None:
    tok = BatchTokenizer(model)
    assert tok._ascii is not None  # MiniLM's BertNormalizer lowercases: the ASCII path is in use
    texts = EDGE_CASES + _synthetic(200)
    assert tok.agrees_with(model.preprocess, texts)
    ours, ref = tok(texts), model.preprocess(texts)
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(ours[key], ref[key]), key
    assert (
        ours["input_ids"].shape[1] == 256
    )  # the long row was truncated at max_seq_length, as preprocess does
    for text in EDGE_CASES:  # row by row too (a batch of one pads nothing)
        assert torch.equal(tok([text])["input_ids"], model.preprocess([text])["input_ids"]), text


def test_a_disagreeing_fast_tokenizer_is_not_used(model, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = _synthetic(20)
    assert isinstance(_tokenizer_for(model, texts, True), BatchTokenizer)
    assert not isinstance(_tokenizer_for(model, texts, False), BatchTokenizer)
    monkeypatch.setattr(BatchTokenizer, "_ids", lambda self, t: [[101, 7, 102] for _ in t])
    assert not isinstance(_tokenizer_for(model, texts, True), BatchTokenizer)


def test_bulk_encoder_vectors_equal_the_preprocess_path(tmp_path: Path, one_layer_minilm: str) -> None:
    """Same batches, same token tensors, same model: the float16 files are bit-identical (tolerance 0;
    any difference in padding would show as float32 rounding ~1e-7, below float16's step but able to flip
    a rounding). The model is MiniLM cut to one layer: its tokenizer, the part under test, is MiniLM's."""
    texts = _synthetic(300, seed=1) + EDGE_CASES
    store = DocStore.build(
        [Passage(id=f"p{i}", title="", text=t) for i, t in enumerate(texts)], tmp_path / "ds"
    )
    config = EncoderConfig(name=one_layer_minilm, batch_size=32)
    files = {}
    for fast in (False, True):
        files[fast] = tmp_path / f"fast{fast}.f16"
        encode_docstore_parallel(
            store,
            files[fast],
            config,
            "cpu",
            EncodePlan(chunk=128, range_chunks=1, cores=1, fast_tokenizer=fast),
        )
    old, new = (np.fromfile(files[f], np.float16).reshape(len(texts), -1) for f in (False, True))
    assert np.array_equal(old, new)
    direct = Encoder(config).encode_passages(texts[:50])  # and both are sentence-transformers' encode
    np.testing.assert_allclose(new[:50].astype(np.float32), direct, atol=2e-3)
