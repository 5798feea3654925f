"""Small pure helpers of the report: smoothing, best cells, decimals, metric order, escaped highlighting."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from markupsafe import Markup

from sleuth.rewards.metrics import normalize_answer

MAX_TEXT_CHARS = 20_000  # per text block; a runaway generation must not make the page unusable


# Summary columns shown first, in this order; any other metric follows alphabetically.
METRIC_ORDER = (
    "em",
    "cover_em",
    "f1",
    "span_check",
    "genacc",
    "judge",
    "retrieval_count",
    "input_tokens",
    "output_tokens",
    "latency_s",
)


# Costs: the best value is the smallest. Everything else (accuracy-like) is best when largest.
LOWER_IS_BETTER = frozenset(
    {"retrieval_count", "input_tokens", "output_tokens", "latency_s", "tokens", "turns", "cost"}
)


# Action tags of the supported loops, highlighted in trajectory text.
AGENT_TAGS = (
    "think",
    "search",
    "answer",
    "information",
    "observation",
    "original_evidence",
    "query",
    "important_info",
    "search_complete",
    "reflect",
    "documents",
    "rewritten_query",
)


def ema_smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing).

    s_t = (1-w) * sum_{i<=t} w^(t-i) x_i / (1 - w^(n_t)), with n_t the number of values seen,
    so the first point equals the first value instead of being pulled towards 0.
    NaN inputs (a step where the metric is missing) stay NaN and do not update the average.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out: list[float] = []
    acc = 0.0
    seen = 0
    for x in values:
        if x is None or math.isnan(x):
            out.append(math.nan)
            continue
        acc = weight * acc + (1.0 - weight) * x
        seen += 1
        out.append(acc / (1.0 - weight**seen))
    return out


def smoothing_weight(n_points: int) -> float:
    """More smoothing for longer runs: 0 (none) up to 10 points, 0.9 at 100, capped at 0.95."""
    if n_points <= 10:
        return 0.0
    return min(0.95, 1.0 - 10.0 / n_points)


def best_indices(values: Sequence[float | None], lower_is_better: bool) -> set[int]:
    """Indices holding the best value of a column (ties all win). Empty when fewer than two rows
    have a value or when all values are equal: then nothing stands out and nothing is marked."""
    present = [(i, v) for i, v in enumerate(values) if is_number(v)]
    if len(present) < 2:
        return set()
    target = min(v for _, v in present) if lower_is_better else max(v for _, v in present)
    best = {i for i, v in present if math.isclose(v, target, rel_tol=1e-12, abs_tol=1e-12)}
    return set() if len(best) == len(present) else best


def column_decimals(values: Sequence[Any]) -> int:
    """One number of decimals per table column so values line up: 0 when every value is a whole
    number (counts), else 1 from 100 up (token counts), 2 from 10 up, 4 below (rates, seconds)."""
    nums = [float(v) for v in values if is_number(v)]
    if not nums or all(v.is_integer() for v in nums):
        return 0
    top = max(abs(v) for v in nums)
    return 1 if top >= 100 else 2 if top >= 10 else 4


def order_metrics(keys: Iterable[str]) -> list[str]:
    """Known metrics in METRIC_ORDER, then the others alphabetically; "n" and the intervals
    (`<metric>_ci`, shown inside their metric's cell) are left out."""
    keys = set(keys)
    keys = {k for k in keys if k != "n" and not (k.endswith("_ci") and k[: -len("_ci")] in keys)}
    known = [k for k in METRIC_ORDER if k in keys]
    return known + sorted(keys - set(known))


def highlight_text(
    text: str | None,
    needles: Sequence[str] = (),
    tags: Sequence[str] = AGENT_TAGS,
    max_chars: int = MAX_TEXT_CHARS,
) -> Markup:
    """Escape `text` and wrap agent tags (`<search>`...) and occurrences of `needles` (gold answers).

    Spans are found on the raw text and every segment is escaped on its own, so highlighting
    can never split an HTML entity or let markup from the text through.
    """
    if not text:
        return Markup("")
    truncated = 0
    if len(text) > max_chars:
        truncated = len(text) - max_chars
        text = text[:max_chars]
    spans: list[tuple[int, int, str]] = []
    if tags:
        tag_re = re.compile(r"</?(?:" + "|".join(re.escape(t) for t in tags) + r")>")
        spans += [(m.start(), m.end(), "tag") for m in tag_re.finditer(text)]
    words = [n for n in {n.strip() for n in needles if n} if n]
    if words:
        # Longest first so "New York City" wins over "New York"; word edges so "one" misses "money".
        alternation = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        gold_re = re.compile(rf"(?<!\w)(?:{alternation})(?!\w)", re.IGNORECASE)
        spans += [(m.start(), m.end(), "gold") for m in gold_re.finditer(text)]
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    parts: list[str] = []
    pos = 0
    for start, end, kind in spans:
        if start < pos:  # overlaps a span already taken
            continue
        parts.append(html.escape(text[pos:start], quote=False))
        css = "tag" if kind == "tag" else "gold"
        element = "span" if kind == "tag" else "mark"
        parts.append(f'<{element} class="{css}">{html.escape(text[start:end], quote=False)}</{element}>')
        pos = end
    parts.append(html.escape(text[pos:], quote=False))
    if truncated:
        parts.append(f'<span class="trunc">… ({truncated} more characters not shown)</span>')
    return Markup("".join(parts))


def contains_answer(text: str | None, golds: Sequence[str]) -> bool:
    """Whether a document mentions a gold answer (normalised substring, as cover-EM does)."""
    if not text:
        return False

    hay = f" {normalize_answer(text)} "
    return any(g and f" {normalize_answer(g)} " in hay for g in golds if normalize_answer(g))


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def format_value(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:.1f}"
    return str(v)
