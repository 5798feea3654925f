"""A claim's numbers: paired rows of one seed, the pooled difference over seeds, the noise floor, the verdict.

Paired rows: the arms answered the same held-out questions, so a difference is judged on per-question differences
(`sleuth.eval.stats.paired_bootstrap`).

Pooled over seeds (a two-level bootstrap, the usual one for clustered data: Davison & Hinkley 1997, sec. 3.8): each
resample draws S of the S seeds with replacement, then, for each drawn seed, its questions with replacement, and takes
the mean over the drawn seeds of their mean differences. The 95% percentile interval of those means includes the
seed-to-seed spread of training as well as the question-to-question spread; the point estimate is the mean of the
seeds' mean differences. The inner draws are precomputed per seed (B resample means each); a drawn seed takes one of
its B means at random, so a seed drawn twice gets two independent question resamples.

The noise floor: the claim's baseline arm trained with two seeds and compared with itself as the claim compares its
arms. Two runs of one recipe differ by this much with no effect at all, so an effect must exceed it.

The verdict of one test (a difference claimed to lie above or below a threshold):
- holds: the pooled interval lies entirely on the claimed side of the threshold, and the pooled difference lies
  farther beyond the threshold than the noise floor's difference is from 0;
- does not hold: the pooled interval lies entirely on the other side;
- not shown: anything else (the interval straddles the threshold, the effect is within the floor, or no floor was
  measured because the run has one seed).
A claim of several tests holds when every test holds, does not hold when any test does not, and is not shown
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sleuth.errors import ConfigError
from sleuth.eval.stats import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, paired_bootstrap, resample_means
from sleuth.rewards.metrics import cover_exact_match

HOLDS, NOT_SHOWN, DOES_NOT_HOLD = "holds", "not shown", "does not hold"


def paired(a: Sequence[float], b: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """A paired row: n, each arm's mean, the mean difference a - b and its 95% interval (None when empty)."""
    if not a:
        return {"n": 0, "a": None, "b": None, "diff": None, "ci": None}
    diff, lo, hi = paired_bootstrap(a, b, seed=seed)
    return {"n": len(a), "a": sum(a) / len(a), "b": sum(b) / len(b), "diff": diff, "ci": [lo, hi]}


def common_ids(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """The question ids both arms' predictions hold (sorted): what a paired comparison runs over."""
    ids = sorted(set(first) & set(second))
    if not ids:
        raise ConfigError("the two arms answered no common question; evaluate both on the same test split")
    return ids


def paired_values(first: dict[str, dict], second: dict[str, dict], value_a: Callable[[dict], float],
                  value_b: Callable[[dict], float] | None = None,
                  keep: Callable[[dict], bool] | None = None) -> tuple[list[float], list[float]]:  # fmt: skip
    """value_a of the first and value_b (default value_a) of the second prediction set, over the questions both
    answered that `keep` admits (judged on the first's record), in sorted id order."""
    ids = [i for i in common_ids(first, second) if keep is None or keep(first[i])]
    value_b = value_b or value_a
    return [value_a(first[i]) for i in ids], [value_b(second[i]) for i in ids]


def paired_on(first: dict[str, dict], second: dict[str, dict], value_a: Callable[[dict], float],
              value_b: Callable[[dict], float] | None = None,
              keep: Callable[[dict], bool] | None = None) -> dict[str, Any]:  # fmt: skip
    """A paired row (`paired`) over `paired_values`."""
    return paired(*paired_values(first, second, value_a, value_b, keep))


def metric(key: str) -> Callable[[dict], float]:
    """A prediction record's answer metric (as the evaluator scored the answer it reports)."""
    return lambda record: float(record["metrics"][key])


def own_answer_cover_em(record: dict) -> float:
    """Non-strict EM (a gold answer inside the answer) of the agent's own answer, where the evaluator handed its
    documents to a reader (extra.agent_answer)."""
    return cover_exact_match(record.get("extra", {}).get("agent_answer"), record["golden_answers"])


def pooled_paired_bootstrap(per_seed: Sequence[Sequence[float]], resamples: int = DEFAULT_RESAMPLES,
                            confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:  # fmt: skip
    """(pooled difference, lo, hi) from each seed's per-question differences, by the two-level bootstrap of the
    module docstring. One seed gives that seed's paired bootstrap interval."""
    if not per_seed or any(len(d) == 0 for d in per_seed):
        raise ValueError("pooled_paired_bootstrap needs at least one seed, each with at least one question")
    inner = np.stack(
        [resample_means(diffs, resamples, seed=seed + 1 + s) for s, diffs in enumerate(per_seed)]
    )
    rng = np.random.default_rng(seed)
    seeds = len(per_seed)
    drawn = rng.integers(0, seeds, size=(resamples, seeds))
    column = rng.integers(0, resamples, size=(resamples, seeds))
    pooled = inner[drawn, column].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(pooled, [tail, 1.0 - tail])
    point = float(np.mean([np.mean(d) for d in per_seed]))
    return point, float(lo), float(hi)


def verdict_of_test(diff: float, ci: Sequence[float], side: str, threshold: float,
                 floor: float | None) -> tuple[str, str]:  # fmt: skip
    """(verdict, why) of one test by the rule in the module docstring; `floor`: the noise floor's difference
    (None: not measured)."""
    lo, hi = ci
    if side == "above":
        cleared, wrong, beyond = lo > threshold, hi < threshold, diff - threshold
    else:
        cleared, wrong, beyond = hi < threshold, lo > threshold, threshold - diff
    where = f"{'above' if side == 'above' else 'below'} {threshold:+g}"
    if wrong:
        return (
            DOES_NOT_HOLD,
            f"the pooled interval [{lo:+.4g}, {hi:+.4g}] lies on the wrong side of {threshold:+g}",
        )
    if not cleared:
        return NOT_SHOWN, f"the pooled interval [{lo:+.4g}, {hi:+.4g}] is not entirely {where}"
    if floor is None:
        return NOT_SHOWN, "no noise floor: one seed was run (give --seeds 2 or more)"
    if beyond <= abs(floor):
        return NOT_SHOWN, (
            f"the effect beyond the threshold ({beyond:+.4g}) does not exceed the noise floor "
            f"(two seeds of the baseline differ by {floor:+.4g})"
        )
    return (
        HOLDS,
        f"the pooled interval lies {where} and the effect exceeds the noise floor ({abs(floor):.4g})",
    )


def claim_verdict(verdicts: Sequence[str]) -> str:
    """Every test holds: holds; any does not hold: does not hold; else not shown."""
    if verdicts and all(v == HOLDS for v in verdicts):
        return HOLDS
    return DOES_NOT_HOLD if DOES_NOT_HOLD in verdicts else NOT_SHOWN
