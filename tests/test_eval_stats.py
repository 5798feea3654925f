"""Bootstrap intervals (sleuth.eval.stats) and paired differences of prediction records (sleuth.eval.compare),
checked against a bootstrap written out by hand, exact bootstrap distributions and analytic properties."""

from __future__ import annotations

import math

import numpy as np
import pytest

import sleuth.eval.stats as stats
from sleuth.errors import ConfigError
from sleuth.eval.compare import compare_records, format_difference, paired_difference
from sleuth.eval.stats import bootstrap_ci, paired_bootstrap, resample_means


def hand_percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between order statistics at position q * (B - 1)."""
    pos = q * (len(sorted_values) - 1)
    below = math.floor(pos)
    above = min(below + 1, len(sorted_values) - 1)
    return sorted_values[below] + (pos - below) * (sorted_values[above] - sorted_values[below])


def hand_bootstrap(
    values: list[float], resamples: int, seed: int, rows_per_block: int
) -> tuple[float, float]:
    """The same draws as the module docstring describes, every mean summed in a Python loop."""
    rng = np.random.default_rng(seed)
    n = len(values)
    means = []
    drawn = 0
    while drawn < resamples:
        rows = min(rows_per_block, resamples - drawn)
        for row in rng.integers(0, n, size=(rows, n)).tolist():
            total = 0.0
            for i in row:
                total += values[i]
            means.append(total / n)
        drawn += rows
    means.sort()
    return hand_percentile(means, 0.025), hand_percentile(means, 0.975)


def test_interval_equals_a_hand_computed_bootstrap_on_a_tiny_sample():
    values = [0.2, 1.0, 0.0, 0.5, 0.4]  # F1-like scores of five questions
    expected = hand_bootstrap(values, resamples=7, seed=3, rows_per_block=7)
    assert bootstrap_ci(values, resamples=7, seed=3) == pytest.approx(expected, abs=1e-12)
    expected = hand_bootstrap(values, resamples=2000, seed=11, rows_per_block=2000)
    assert bootstrap_ci(values, resamples=2000, seed=11) == pytest.approx(expected, abs=1e-12)


def test_large_samples_are_drawn_in_blocks_of_whole_resamples(monkeypatch):
    monkeypatch.setattr(stats, "_MAX_DRAWS", 10)  # n = 5: two resamples per block
    values = [1.0, 0.0, 0.0, 1.0, 1.0]
    expected = hand_bootstrap(values, resamples=9, seed=5, rows_per_block=2)
    assert bootstrap_ci(values, resamples=9, seed=5) == pytest.approx(expected, abs=1e-12)


def test_interval_matches_the_exact_bootstrap_distribution():
    # n = 3, one correct: the resample mean is k/3 with k ~ Binomial(3, 1/3):
    # P(0) = 8/27 > 2.5% and P(<= 2/3) = 26/27 < 97.5%, so the exact interval is [0, 1].
    assert bootstrap_ci([0, 0, 1], resamples=4000, seed=0) == (0.0, 1.0)
    # n = 4, two correct: k ~ Binomial(4, 1/2), P(0) = 1/16 > 2.5%, so both ends are the extremes.
    assert bootstrap_ci([1, 0, 1, 0], resamples=4000, seed=1) == (0.0, 1.0)
    # n = 10, all but one correct: P(k = 10) = 0.9^10 = 0.349 and P(k <= 7) = 0.070, P(k <= 6) = 0.013:
    # the 2.5% quantile is 0.7 and the 97.5% quantile 1.0.
    assert bootstrap_ci([1] * 9 + [0], resamples=4000, seed=2) == pytest.approx((0.7, 1.0))


def test_constant_samples_give_a_point_interval():
    assert bootstrap_ci([0.0] * 17) == (0.0, 0.0)
    assert bootstrap_ci([1.0] * 17) == (1.0, 1.0)
    assert bootstrap_ci([1.0]) == (1.0, 1.0)


@pytest.mark.parametrize("seed", range(5))
def test_interval_contains_the_mean_and_is_ordered(seed):
    rng = np.random.default_rng(100 + seed)
    values = rng.random(40).round(2)
    lo, hi = bootstrap_ci(values, seed=seed)
    assert lo <= values.mean() <= hi and lo < hi
    assert lo >= 0.0 and hi <= 1.0


def test_width_shrinks_like_one_over_sqrt_n_and_matches_the_normal_width():
    widths = {}
    for n in (100, 400, 1600):
        values = [1.0] * (n // 2) + [0.0] * (n // 2)  # p = 0.5
        lo, hi = bootstrap_ci(values, seed=0)
        widths[n] = hi - lo
        normal = 2 * 1.959964 * math.sqrt(0.25 / n)
        assert widths[n] == pytest.approx(normal, rel=0.12)
    assert widths[100] / widths[400] == pytest.approx(2.0, rel=0.15)
    assert widths[400] / widths[1600] == pytest.approx(2.0, rel=0.15)


def test_higher_confidence_widens_and_seed_reproduces():
    values = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0]
    lo90, hi90 = bootstrap_ci(values, confidence=0.90, seed=4)
    lo99, hi99 = bootstrap_ci(values, confidence=0.99, seed=4)
    assert lo99 <= lo90 and hi90 <= hi99 and (lo99, hi99) != (lo90, hi90)
    assert bootstrap_ci(values, seed=4) == bootstrap_ci(values, seed=4)
    assert len(set(resample_means(values, 50, seed=4)) | set(resample_means(values, 50, seed=5))) > 1


def test_paired_bootstrap_is_the_bootstrap_of_the_differences():
    a = [1, 1, 0, 1, 0, 1, 1, 0]
    b = [0, 1, 0, 0, 0, 1, 0, 0]
    diff, lo, hi = paired_bootstrap(a, b, seed=7)
    assert diff == pytest.approx(3 / 8)
    assert (lo, hi) == bootstrap_ci([1, 0, 0, 1, 0, 0, 1, 0], seed=7)
    # every question improved by exactly 1: no spread, a point interval
    assert paired_bootstrap([1, 1, 1], [0, 0, 0]) == (1.0, 1.0, 1.0)


def test_pairing_removes_the_spread_both_methods_share():
    rng = np.random.default_rng(0)
    base = rng.random(200)  # question difficulty both methods feel
    a, b = base + 0.05, base  # A is better by 0.05 on every question
    _, lo, hi = paired_bootstrap(a, b)
    unpaired_lo, unpaired_hi = bootstrap_ci(a)
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    assert unpaired_hi - unpaired_lo > 0.05


@pytest.mark.parametrize(
    "values,match",
    [([], "empty"), ([0.5, float("nan")], "NaN"), ([[1, 0]], "flat")],
)
def test_bad_samples_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        bootstrap_ci(values)


def test_bad_settings_and_unpaired_lengths_are_refused():
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_ci([1, 0], resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1, 0], confidence=1.0)
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap([1, 0], [1])


# ---------------------------------------------------------------------------------------------------
# paired differences of prediction records


def rec(qid: str, dataset: str, **metrics: float | None) -> dict:
    return {"id": qid, "dataset": dataset, "metrics": metrics}


def test_paired_difference_matches_questions_by_dataset_and_id():
    a = [rec("1", "x", em=1.0), rec("2", "x", em=1.0), rec("1", "y", em=0.0), rec("3", "x", em=1.0)]
    # B in another order, one question A lacks, and ("1", "y") is not ("1", "x")
    b = [rec("1", "y", em=1.0), rec("2", "x", em=0.0), rec("1", "x", em=1.0), rec("9", "x", em=0.0)]
    result = paired_difference(a, b, "em", seed=2)
    assert result["n"] == 3 and result["only_a"] == 1 and result["only_b"] == 1
    assert result["mean_a"] == pytest.approx(2 / 3) and result["mean_b"] == pytest.approx(2 / 3)
    assert result["diff"] == pytest.approx(0.0)
    # A's order of the shared questions: (x,1) 1-1, (x,2) 1-0, (y,1) 0-1
    assert result["ci"] == list(bootstrap_ci([0.0, 1.0, -1.0], seed=2))
    assert format_difference(result).startswith("+0.0 [")


def test_paired_difference_restricted_to_keys_and_missing_scores():
    a = [rec("1", "d", f1=0.5, judge=None), rec("2", "d", f1=1.0, judge=None)]
    b = [rec("1", "d", f1=0.25, judge=None), rec("2", "d", f1=0.5, judge=None)]
    only_first = paired_difference(a, b, "f1", keys=[("d", "1")])
    assert (
        only_first["n"] == 1
        and only_first["diff"] == pytest.approx(0.25)
        and only_first["ci"] == [0.25, 0.25]
    )
    assert set(compare_records(a, b, ["f1", "judge"])) == {"f1"}  # no judge: judge is skipped
    with pytest.raises(ConfigError, match="'judge' score"):
        paired_difference(a, b, "judge")
    with pytest.raises(ConfigError, match="no question is in both"):
        paired_difference(a, [rec("7", "d", f1=1.0)], "f1")
    with pytest.raises(ConfigError, match="record 1 has no 'id'"):
        paired_difference([{"metrics": {}}], b, "f1")


def test_joint_intervals_equal_each_column_alone():
    columns = {"em": [1, 0, 0, 1, 1], "f1": [1.0, 0.3, 0.0, 0.8, 1.0], "span": [1, 1, 0, 1, 1]}
    joint = stats.bootstrap_cis(columns, resamples=500, seed=9)
    assert list(joint) == ["em", "f1", "span"]
    for name, values in columns.items():
        assert joint[name] == bootstrap_ci(values, resamples=500, seed=9)
    assert stats.bootstrap_cis({}) == {}
    with pytest.raises(ValueError, match="lengths differ"):
        stats.bootstrap_cis({"em": [1, 0], "f1": [1.0]})


def test_compare_records_equals_paired_difference_per_metric():
    rng = np.random.default_rng(3)
    a = [
        rec(str(i), "d", em=float(x), f1=float(f), judge=None)
        for i, (x, f) in enumerate(zip(rng.random(30) < 0.6, rng.random(30), strict=True))
    ]
    b = [
        rec(str(i), "d", em=float(x), f1=float(f), judge=None)
        for i, (x, f) in enumerate(zip(rng.random(30) < 0.4, rng.random(30), strict=True))
    ]
    b[4]["metrics"]["f1"] = None  # one question without an F1 on one side: F1 has its own resamples
    both = compare_records(a, b, ["em", "f1", "judge"], seed=5)
    assert set(both) == {"em", "f1"} and both["f1"]["n"] == 29 and both["em"]["n"] == 30
    for metric in ("em", "f1"):
        assert both[metric] == paired_difference(a, b, metric, seed=5)


def test_summary_interval_of_a_metric_scored_on_some_questions_only():
    from sleuth.eval.harness import summarise_records

    records = [
        {
            "id": str(i),
            "dataset": "d",
            "retrieval_count": 0,
            "input_tokens": 1,
            "output_tokens": 1,
            "latency_s": 0.0,
            "metrics": {"em": em, "cover_em": em, "f1": em, "span_check": em, "genacc": em, "judge": judge},
        }
        for i, (em, judge) in enumerate([(1.0, 1.0), (0.0, None), (1.0, 0.0), (0.0, 1.0), (1.0, None)])
    ]
    overall = summarise_records(records, seed=4)["overall"]
    assert overall["judge"] == pytest.approx(2 / 3)
    assert overall["judge_ci"] == list(bootstrap_ci([1.0, 0.0, 1.0], seed=4))
    assert overall["em_ci"] == list(bootstrap_ci([1.0, 0.0, 1.0, 0.0, 1.0], seed=4))
