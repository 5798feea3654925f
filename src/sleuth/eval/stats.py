"""Uncertainty of evaluation scores: percentile bootstrap intervals of a mean, and of a paired difference.

A score on n questions is the mean of n per-question values (0/1 for EM, a fraction for F1).
Its 95% interval is the percentile bootstrap (Efron & Tibshirani, 1993, ch. 13): draw B
resamples of n questions with replacement, take each resample's mean, report the 2.5% and
97.5% quantiles of those B means (numpy's default linear interpolation between order
statistics). Two methods answered the same questions, so their difference is judged on the
per-question differences a_i - b_i (a paired bootstrap): resampling questions keeps each
question's pair together, and the question-to-question spread that both methods share cancels.

Resampling is seeded (numpy's PCG64 `default_rng(seed)`), so a summary is reproducible. Index
draws come in blocks of whole resamples (`_MAX_DRAWS` indices at most) so memory stays bounded
for large n; below that size a single `rng.integers(0, n, size=(B, n))` call draws them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95
_MAX_DRAWS = 1 << 22  # indices drawn per block (32 MiB of int64)


def _as_sample(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    sample = np.asarray(values, dtype=np.float64)
    if sample.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of numbers, got shape {sample.shape}")
    if sample.size == 0:
        raise ValueError(f"{what} is empty: a bootstrap needs at least one value")
    if not np.all(np.isfinite(sample)):
        raise ValueError(f"{what} holds a NaN or infinite value; drop the questions without a score first")
    return sample


def _check_settings(resamples: int, confidence: float) -> None:
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 1:
        raise ValueError(f"resamples must be a positive integer, got {resamples!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def resample_means(values: Sequence[float] | np.ndarray, resamples: int = DEFAULT_RESAMPLES,
                   seed: int = 0) -> np.ndarray:  # fmt: skip
    """The means of `resamples` bootstrap resamples of `values` (drawn as the module docstring says)."""
    return _joint_resample_means([_as_sample(values, "values")], resamples, seed)[0]


def _joint_resample_means(samples: list[np.ndarray], resamples: int, seed: int) -> list[np.ndarray]:
    """Resample means of several samples of one set of questions, from the same index draws."""
    _check_settings(resamples, DEFAULT_CONFIDENCE)
    n = samples[0].size
    rng = np.random.default_rng(seed)
    rows_per_block = max(1, _MAX_DRAWS // n)
    means = [np.empty(resamples, dtype=np.float64) for _ in samples]
    for start in range(0, resamples, rows_per_block):
        rows = min(rows_per_block, resamples - start)
        idx = rng.integers(0, n, size=(rows, n))
        for sample, out in zip(samples, means, strict=True):
            out[start : start + rows] = sample[idx].mean(axis=1)
    return means


def _percentile_interval(means: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval (lo, hi) of the mean of `values`."""
    _check_settings(resamples, confidence)
    return _percentile_interval(resample_means(values, resamples, seed), confidence)


def bootstrap_cis(
    columns: Mapping[str, Sequence[float] | np.ndarray],
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """`bootstrap_ci` of several scores of the same questions (EM, F1... in question order), every one
    from the same resamples: each column's interval equals `bootstrap_ci(column, ..., seed)`, and the
    index draws are made once instead of once per score."""
    _check_settings(resamples, confidence)
    if not columns:
        return {}
    samples = [_as_sample(v, name) for name, v in columns.items()]
    if len({s.size for s in samples}) != 1:
        sizes = {name: s.size for name, s in zip(columns, samples, strict=True)}
        raise ValueError(f"columns must score the same questions; their lengths differ: {sizes}")
    means = _joint_resample_means(samples, resamples, seed)
    return {name: _percentile_interval(m, confidence) for name, m in zip(columns, means, strict=True)}


def paired_bootstrap(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(mean of a - b, lo, hi): the difference of two methods on the same questions, in the same order."""
    first, second = _as_sample(a, "a"), _as_sample(b, "b")
    if first.shape != second.shape:
        raise ValueError(
            f"paired samples differ in length ({first.size} vs {second.size}); pair them by question"
        )
    diff = first - second
    lo, hi = bootstrap_ci(diff, resamples, confidence, seed)
    return float(diff.mean()), lo, hi
