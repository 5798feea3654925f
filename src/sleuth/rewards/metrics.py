"""Answer metrics shared by rewards and evaluation.

Conventions (see methods.md, "Shared conventions"):
- `normalize_answer`: lowercase, drop ASCII punctuation, drop the articles a/an/the,
  collapse whitespace (the SQuAD / Search-R1 / FlashRAG normaliser).
- `exact_match`: normalised prediction equals some normalised gold.
- `cover_exact_match` (sub-EM, FlashRAG "acc"): some normalised gold is a *substring* of the
  normalised prediction (character level, so "paris" covers "parisian").
- `span_check` (s3 / pyserini `has_answers`): some normalised gold's token sequence is a
  contiguous run of the normalised prediction's tokens (token level, so "paris" does not
  match "parisian", and "obama barack" does not match "barack obama"). Tokens are pyserini's:
  NFD-normalised text, SimpleTokenizer's regex, lowercased.
- `f1_score`: token F1 with FlashRAG's special case (see its docstring).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import regex

from sleuth import tags
from sleuth.text import as_gold_list, normalize_answer
from sleuth.text import exact_match as exact_match  # written in sleuth.text: the oracle (agent/) uses it too

# pyserini's SimpleTokenizer (pyserini/eval/evaluate_dpr_retrieval.py): a run of letters, digits and
# combining marks, or one character that is neither a separator (Z) nor a control/format char (C).
# Unicode property classes need the `regex` module; `re`'s \w leaves combining marks out and keeps
# soft hyphens (Cf) as tokens, which splits or joins words differently from pyserini.
_SIMPLE_TOKENIZER_RE = regex.compile(
    r"([\p{L}\p{N}\p{M}]+)|([^\p{Z}\p{C}])", flags=regex.IGNORECASE | regex.UNICODE | regex.MULTILINE
)
_SPECIAL_F1_ANSWERS = frozenset({"yes", "no", "noanswer"})


def cover_exact_match(pred: str | None, golds: str | Iterable[str]) -> float:
    """Sub-EM: 1.0 if any normalised gold answer is a substring of the normalised prediction.
    Empty golds (after normalisation) never match, since "" is a substring of everything."""
    if pred is None:
        return 0.0
    norm_pred = normalize_answer(pred)
    for g in as_gold_list(golds):
        norm_gold = normalize_answer(g)
        if norm_gold and norm_gold in norm_pred:
            return 1.0
    return 0.0


def _tokens(text: str) -> list[str]:
    """s3's `answer_span_check` tokens: normalise_answer, then pyserini's has_answers (NFD, tokenise, lower)."""
    nfd = unicodedata.normalize("NFD", normalize_answer(text))
    return [m.group().lower() for m in _SIMPLE_TOKENIZER_RE.finditer(nfd)]


def _contains_run(haystack: Sequence[str], needle: Sequence[str]) -> bool:
    n = len(needle)
    if n == 0 or n > len(haystack):
        return False
    first = needle[0]
    return any(
        haystack[i] == first and list(haystack[i : i + n]) == list(needle)
        for i in range(len(haystack) - n + 1)
    )


def span_check(pred: str | None, golds: str | Iterable[str]) -> float:
    """s3's span check: 1.0 if some gold's normalised token sequence occurs as a contiguous token
    span of the normalised prediction. Both sides go through `normalize_answer`, then pyserini's
    `has_answers` (NFD normalisation, SimpleTokenizer, lowercase), as s3's `answer_span_check` does.

    One deliberate difference: a gold with no tokens after normalisation ("", "the", "!") never
    matches, where `has_answers` matches it against every prediction (an empty run is in any list).
    """
    if pred is None:
        return 0.0
    pred_tokens = _tokens(pred)
    return float(any(_contains_run(pred_tokens, _tokens(g)) for g in as_gold_list(golds)))


def f1_score(
    pred: str | None, golds: str | Iterable[str], *, yes_no_rule: bool = True, digits: int | None = None
) -> float:
    """Token-level F1 over normalised whitespace tokens, max over gold answers.

    Follows FlashRAG's `F1_Score.token_level_scores` (also what Search-R1-family evaluations use):
    if either the normalised prediction or the normalised gold is one of "yes", "no", "noanswer"
    and the two differ, that gold scores 0 -- so "yes" vs "yes it is" is 0, not 0.5.
    `yes_no_rule=False, digits=2` is R-Search's `F1_check` (qa_f1.py): no yes/no rule, and the
    maximum rounded with `round(score, 2)` (2/3 -> 0.67).
    """
    if pred is None:
        return 0.0
    best = _f1_max(pred, golds, yes_no_rule)
    return round(best, digits) if digits is not None else best


def _f1_max(pred: str, golds: str | Iterable[str], yes_no_rule: bool) -> float:
    norm_pred = normalize_answer(pred)
    pred_tokens = norm_pred.split()
    best = 0.0
    for g in as_gold_list(golds):
        norm_gold = normalize_answer(g)
        special = norm_pred in _SPECIAL_F1_ANSWERS or norm_gold in _SPECIAL_F1_ANSWERS
        if yes_no_rule and special and norm_pred != norm_gold:
            continue
        gold_tokens = norm_gold.split()
        num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if num_same == 0:
            continue
        precision = num_same / len(pred_tokens)
        recall = num_same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_tags(text: str, tag: str) -> list[str]:
    """Contents of every complete `<tag>...</tag>` block, in order (non-greedy, not nested; exact
    tags only, as Search-R1's `<answer>(.*?)</answer>`)."""
    return tags.blocks(text, tag)


def extract_tag(text: str, tag: str, last: bool = True) -> str | None:
    """Content of the last (or first) complete `<tag>...</tag>` block, stripped; None if none."""
    blocks = extract_tags(text, tag)
    if not blocks:
        return None
    return (blocks[-1] if last else blocks[0]).strip()


# How an answer is read out of text: "sleuth" (the last block of the policy's own text) or "upstream" (Search-R1's
# `extract_solution`, verl/utils/reward_score/qa_em.py and qa_em_format.py: over the decoded prompt + response,
# None for fewer than two blocks, since the prompt holds two of its own, else the last one stripped)
ANSWER_RULES = ("sleuth", "upstream")


def extract_answer(text: str, rule: str = "sleuth") -> str | None:
    """The answer in `text` read with one of `ANSWER_RULES`.

    "sleuth": the last `<answer>...</answer>`, stripped; None if there is none. Callers must pass *policy* text
    only: a prompt's few-shot example or an `<answer>` that happens to sit in a retrieved document must never be
    taken for the agent's answer. "upstream": pass the whole decoded prompt + response, as Search-R1 does; one
    block (the prompt's, or a response's lone answer in a prompt without examples) reads as no answer."""
    if rule == "upstream":
        found = extract_tags(text, "answer")
        return found[-1].strip() if len(found) >= 2 else None
    if rule != "sleuth":
        raise ValueError(f"answer rule {rule!r}: choose one of {list(ANSWER_RULES)}")
    return extract_tag(text, "answer", last=True)


def aggregate(
    records: Sequence[Mapping[str, Any]], keys: Sequence[str], by: str = "dataset"
) -> dict[str, dict[str, float | int | None]]:
    """Mean of each metric in `keys`, per value of the `by` field and "overall".

    "overall" is the mean over all records (micro average), matching how the papers report a
    single-dataset score. `None` values (a metric not computed for that record, e.g. no judge)
    are skipped; a group where every value is None reports None. Each group also has "n".
    """
    if "overall" in {str(r.get(by)) for r in records}:
        raise ValueError(f"a record's {by!r} is 'overall', which collides with the overall row; rename it")
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for i, rec in enumerate(records):
        if by not in rec:
            raise ValueError(f"record {i} has no {by!r} field to group by (fields: {sorted(rec)})")
        for k in keys:
            if k not in rec:
                raise ValueError(f"record {i} has no metric {k!r} (fields: {sorted(rec)})")
        groups.setdefault(str(rec[by]), []).append(rec)

    def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {"n": len(rows)}
        for k in keys:
            vals = [float(r[k]) for r in rows if r[k] is not None]
            out[k] = sum(vals) / len(vals) if vals else None
        return out

    result = {name: summarise(rows) for name, rows in sorted(groups.items())}
    result["overall"] = summarise(records)
    return result
