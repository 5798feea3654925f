"""Tokenize passages for bulk encoding with the model's Rust tokenizer called directly.

sentence-transformers' `preprocess` goes through transformers' tokenizer call: the Rust `encode_batch`
(with character offsets nobody uses), one Python `Encoding` conversion per row, and `torch.tensor` over
nested lists for three tensors. Profiled on the development box (bench/encode_rate.py, 512-passage
batches of ~230 tokens): the Rust call is ~70% of the time, the tensor building ~22%. Here:

- `encode_batch_fast` (no offsets) on a private copy of the Rust tokenizer, truncating at the model's
  max length (`max_seq_length`) as sentence-transformers does, no padding in Rust;
- one flat id array per batch (numpy), padded on the right with the pad id; the attention mask from
  the lengths; token type ids as zeros (one segment);
- for a BERT-style normalizer that lowercases (MiniLM, e5): a row that is plain ASCII, with no control
  character and no `[` (so no special-token text), is lowercased in Python (C speed) and given to a
  copy of the tokenizer without its normalizer. For such text the normalizer only lowercases (accent
  stripping and CJK spacing do nothing to ASCII; cleaning maps tab/newline/CR to a space, which the
  pre-tokenizer splits on anyway), so the ids are the same; the normalizer was ~1/3 of the Rust time.
  Other rows take the full tokenizer.

`BatchTokenizer.agrees_with(preprocess, texts)` compares its tensors with sentence-transformers' on
real passages; the bulk encoder uses it only when they are equal (else it keeps `preprocess`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class UnsupportedTokenizer(ValueError):
    """The model has no Rust fast tokenizer, or one this module does not reproduce."""


def _lowercasing_bert_normalizer(spec: dict[str, Any]) -> bool:
    norm = spec.get("normalizer") or {}
    return (
        norm.get("type") == "BertNormalizer"
        and norm.get("lowercase") is True
        and norm.get("strip_accents") in (None, True)
    )


class BatchTokenizer:
    """texts -> the feature dict a sentence-transformers text model's forward takes, as `preprocess` makes it."""

    def __init__(self, model: Any):
        from tokenizers import Tokenizer  # deferred: only dense encoding needs it

        hf = getattr(model, "tokenizer", None)
        backend = getattr(hf, "_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise UnsupportedTokenizer(f"{type(hf).__name__} is not a Rust fast tokenizer")
        if getattr(hf, "padding_side", "right") != "right":
            raise UnsupportedTokenizer(f"padding side {hf.padding_side!r} (only right padding is reproduced)")
        spec = json.loads(backend.to_str())
        self.max_length = int(getattr(model, "max_seq_length", None) or hf.model_max_length)
        direction = getattr(hf, "truncation_side", "right")
        self._full = self._copy(Tokenizer, spec, direction)
        self._ascii = None
        if _lowercasing_bert_normalizer(spec):
            self._ascii = self._copy(Tokenizer, {**spec, "normalizer": None}, direction)
        self.pad_id = int(hf.pad_token_id or 0)
        self._extra: dict[str, Any] = {}  # non-tensor entries of preprocess' output (e.g. "modality")
        self._type_ids = True

    def _copy(self, tokenizer_cls: Any, spec: dict[str, Any], direction: str) -> Any:
        tok = tokenizer_cls.from_str(json.dumps({**spec, "truncation": None, "padding": None}))
        tok.enable_truncation(self.max_length, strategy="longest_first", direction=direction)
        tok.no_padding()
        return tok

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        if self._ascii is None:
            return [e.ids for e in _encode(self._full, texts)]
        plain = [t.isascii() and "[" not in t and _CONTROL.search(t) is None for t in texts]
        rows: list[list[int] | None] = [None] * len(texts)
        fast = [i for i, ok in enumerate(plain) if ok]
        slow = [i for i, ok in enumerate(plain) if not ok]
        for tok, picked, prepare in ((self._ascii, fast, str.lower), (self._full, slow, None)):
            if picked:
                batch = [texts[i] for i in picked]
                for i, enc in zip(
                    picked, _encode(tok, [prepare(t) for t in batch] if prepare else batch), strict=True
                ):
                    rows[i] = enc.ids
        return rows  # type: ignore[return-value]

    def __call__(self, texts: Sequence[str]) -> dict[str, Any]:
        import torch  # deferred: heavy

        rows = self._ids(texts)
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        width = int(lengths.max()) if len(rows) else 0
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        # Boolean-mask assignment fills row after row, left to right: the flat ids in order.
        ids[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        features: dict[str, Any] = {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        }
        if self._type_ids:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        features.update(self._extra)
        return features

    def agrees_with(self, preprocess: Callable[[list[str]], dict[str, Any]], texts: Sequence[str]) -> bool:
        """True when this tokenizer's features equal `preprocess`'s for `texts` (tensors equal, the same keys).
        Learns preprocess' non-tensor entries and whether it returns token type ids."""
        import torch  # deferred: heavy

        reference = preprocess(list(texts))
        tensors = {k for k, v in reference.items() if isinstance(v, torch.Tensor)}
        if not {"input_ids", "attention_mask"} <= tensors or tensors - {
            "input_ids",
            "attention_mask",
            "token_type_ids",
        }:
            return False
        self._type_ids = "token_type_ids" in tensors
        if self._type_ids and bool(reference["token_type_ids"].any()):
            return False
        self._extra = {k: v for k, v in reference.items() if k not in tensors}
        ours = self(texts)
        return set(ours) == set(reference) and all(torch.equal(ours[k], reference[k]) for k in tensors)


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[Any]:
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets; older versions have only encode_batch.
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    return encode(list(texts), add_special_tokens=True)
