"""Answer normalisation and exact match, shared by every metric, data filter and the oracle."""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, remove punctuation, remove articles, collapse whitespace (in that order)."""
    text = text.lower().translate(_PUNCT_TABLE)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def as_gold_list(golds: str | Iterable[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    gold_list = [g for g in golds]
    for g in gold_list:
        if not isinstance(g, str):
            raise TypeError(f"golden answers must be strings, got {type(g).__name__}: {g!r}")
    return gold_list


def exact_match(pred: str | None, golds: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0.
    A missing prediction (None) scores 0."""
    if pred is None:
        return 0.0
    norm_pred = normalize_answer(pred)
    return float(any(norm_pred == normalize_answer(g) for g in as_gold_list(golds)))


# C0 and C1 control characters other than tab, newline and carriage return
_CONTROL_CHARS = dict.fromkeys([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0)])
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def unusable_text(text: str) -> str | None:
    """Why `text` cannot be served (it would fail or waste a batch), or None. A lone surrogate (JSON's
    "\\ud800" escapes decode to one) is not Unicode: tokenizers and encoders raise on it. Text that is
    mostly control characters (NULs and the like) is noise that costs a batch its time. Both checks run
    in C (regex, str.translate), so a 4,096-query request is checked in milliseconds."""
    found = _SURROGATE_RE.search(text)
    if found is not None:
        return f"is not valid Unicode (a lone surrogate at character {found.start()}); send UTF-8 text"
    controls = len(text) - len(text.translate(_CONTROL_CHARS))
    if controls and 2 * controls > len(text):
        return f"is mostly control characters ({controls} of {len(text)}); send readable text"
    return None
