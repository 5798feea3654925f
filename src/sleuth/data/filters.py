"""Training-set filters from s3: drop yes/no questions, keep questions naive RAG gets wrong.

s3 trains only on questions whose naive-RAG baseline accuracy is 0 (so Gain-Beyond-RAG has
something to gain) and drops yes/no questions: a generator answers those right half of the
time by chance and `span_check` finds "yes"/"no" inside almost any response, so their reward
is noise rather than signal about the searcher.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from sleuth.data.formats import QAExample
from sleuth.data.score_cache import ScoreCache
from sleuth.text import normalize_answer

# "true"/"false" are included because boolean datasets (StrategyQA, BoolQ-style) phrase the
# same binary answer that way; the chance-level problem is identical.
YES_NO_ANSWERS = frozenset({"yes", "no", "true", "false"})


def is_yes_no(example: QAExample) -> bool:
    """True when every golden answer normalises to yes/no/true/false.

    "All" rather than "any": a question with answers ["yes", "Paris"] has a real entity answer.
    """
    return bool(example.golden_answers) and all(
        normalize_answer(a) in YES_NO_ANSWERS for a in example.golden_answers
    )


def drop_yes_no(examples: Iterable[QAExample]) -> list[QAExample]:
    return [ex for ex in examples if not is_yes_no(ex)]


MissingPolicy = Literal["error", "keep", "drop"]


def keep_hard(
    examples: Iterable[QAExample],
    cache: ScoreCache,
    threshold: float = 0.0,
    missing: MissingPolicy = "error",
) -> list[QAExample]:
    """Keep questions whose cached baseline score is <= `threshold` (s3: naive RAG got them wrong).

    `missing` decides what happens to a question with no cached score: "error" (default: a
    partially computed cache would silently bias the training set), "keep" or "drop".
    """
    if missing not in ("error", "keep", "drop"):
        raise ValueError(f"missing must be 'error', 'keep' or 'drop', got {missing!r}")
    examples = list(examples)
    if missing == "error":
        absent = cache.missing([ex.id for ex in examples])
        if absent:
            shown = ", ".join(repr(q) for q in absent[:5]) + (", ..." if len(absent) > 5 else "")
            raise ValueError(
                f"{len(absent)} of {len(examples)} questions have no baseline score in {cache.path} "
                f"(e.g. {shown}); compute the baseline for them first, or pass missing='keep'/'drop'"
            )
    kept = []
    for ex in examples:
        score = cache.get(ex.id)
        if score is None:
            if missing == "keep":
                kept.append(ex)
        elif score <= threshold:
            kept.append(ex)
    return kept
