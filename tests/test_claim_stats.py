"""The claim verdict's numbers: the pooled two-level bootstrap and the verdict rule, against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from sleuth.claims.stats import (
    DOES_NOT_HOLD,
    HOLDS,
    NOT_SHOWN,
    claim_verdict,
    pooled_paired_bootstrap,
    verdict_of_test,
)
from sleuth.eval.stats import bootstrap_ci, paired_bootstrap


def test_one_seed_of_constant_differences_has_a_point_interval():
    assert pooled_paired_bootstrap([[0.5, 0.5, 0.5]]) == (0.5, 0.5, 0.5)


def test_two_seeds_that_disagree_widen_the_interval_to_both():
    """Seed A: every question +1; seed B: every question -1. A resample draws (A, A), (A, B), (B, A) or (B, B)
    with probability 1/4 each, so the pooled means are +1, 0, 0, -1: the 2.5% and 97.5% quantiles are -1 and +1,
    the point estimate 0. A question-level bootstrap of the pooled questions would have said [-0.25, +0.25] or so."""
    diff, lo, hi = pooled_paired_bootstrap([[1.0] * 40, [-1.0] * 40])
    assert diff == 0.0 and lo == -1.0 and hi == 1.0
    naive = bootstrap_ci([1.0] * 40 + [-1.0] * 40)
    assert naive[1] - naive[0] < 0.6  # what ignoring the seeds would claim


def test_seeds_of_constant_differences_pool_like_a_bootstrap_of_the_seed_means():
    """With no question-level spread, the two-level bootstrap is a bootstrap over the seeds' means: its interval
    matches the plain percentile bootstrap of those means (an independent computation) to a resampling error."""
    means = [0.1, 0.3, 0.2, 0.6, 0.4, 0.0, 0.5, 0.3]
    diff, lo, hi = pooled_paired_bootstrap([[m] * 25 for m in means], resamples=20000)
    ref_lo, ref_hi = bootstrap_ci(means, resamples=20000, seed=7)
    assert diff == pytest.approx(np.mean(means))
    assert lo == pytest.approx(ref_lo, abs=0.02) and hi == pytest.approx(ref_hi, abs=0.02)


def test_one_seed_pools_to_its_paired_bootstrap_distribution():
    """A single seed: the pooled interval is that seed's question bootstrap (its own draws, so to a tolerance)."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2, 300).astype(float), rng.integers(0, 2, 300).astype(float)
    diff, lo, hi = pooled_paired_bootstrap([list(a - b)], resamples=20000)
    ref = paired_bootstrap(a, b, resamples=20000)
    assert (
        diff == pytest.approx(ref[0])
        and lo == pytest.approx(ref[1], abs=0.01)
        and hi == pytest.approx(ref[2], abs=0.01)
    )


def test_pooled_bootstrap_refuses_empty_input():
    with pytest.raises(ValueError, match="at least one seed"):
        pooled_paired_bootstrap([])
    with pytest.raises(ValueError, match="at least one question"):
        pooled_paired_bootstrap([[1.0], []])


@pytest.mark.parametrize(
    ("diff", "ci", "side", "threshold", "floor", "verdict", "why"),
    [
        # clears 0 and 0.05 > |0.01|: holds
        (0.05, (0.02, 0.08), "above", 0.0, 0.01, HOLDS, "exceeds the noise floor"),
        # clears 0, but two seeds of the baseline differ by 0.06: within the floor
        (0.05, (0.02, 0.08), "above", 0.0, -0.06, NOT_SHOWN, "does not exceed the noise floor"),
        # straddles 0
        (0.02, (-0.01, 0.05), "above", 0.0, 0.0, NOT_SHOWN, "is not entirely above +0"),
        # entirely below 0 where above was claimed
        (-0.05, (-0.08, -0.02), "above", 0.0, 0.0, DOES_NOT_HOLD, "wrong side"),
        # one seed: clears, but no floor to exceed
        (0.05, (0.02, 0.08), "above", 0.0, None, NOT_SHOWN, "no noise floor"),
        # non-inferiority at -0.02: -0.01 lies 0.01 beyond it, and the floor is 0.005
        (-0.01, (-0.015, -0.005), "above", -0.02, 0.005, HOLDS, "exceeds"),
        # fewer retrievals claimed: interval below 0 by more than the floor
        (-0.5, (-0.7, -0.3), "below", 0.0, 0.2, HOLDS, "exceeds"),
        (-0.5, (-0.7, -0.3), "below", 0.0, -0.6, NOT_SHOWN, "does not exceed"),
        (0.3, (0.1, 0.5), "below", 0.0, 0.0, DOES_NOT_HOLD, "wrong side"),
        # an interval touching the threshold has not cleared it
        (0.05, (0.0, 0.1), "above", 0.0, 0.0, NOT_SHOWN, "not entirely above"),
    ],
)
def test_verdict_rule_by_hand(diff, ci, side, threshold, floor, verdict, why):
    got, reason = verdict_of_test(diff, ci, side, threshold, floor)
    assert got == verdict and why in reason


def test_a_claim_holds_only_when_every_test_holds():
    assert claim_verdict([HOLDS, HOLDS]) == HOLDS
    assert claim_verdict([HOLDS, NOT_SHOWN]) == NOT_SHOWN
    assert claim_verdict([HOLDS, DOES_NOT_HOLD, NOT_SHOWN]) == DOES_NOT_HOLD
    assert claim_verdict([]) == NOT_SHOWN
