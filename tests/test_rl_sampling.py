"""DAPO dynamic sampling and overlong handling, against hand-worked cases."""

from __future__ import annotations

import pytest
import torch

from sleuth.rl.sampling import DynamicBatchFiller, filter_groups, overlong_mask, overlong_penalty


def test_filter_groups_drops_zero_variance_and_singletons():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0]
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    # a all 1 -> drop; b {0, 1} -> keep; c all 0.5 -> drop; d single sample -> drop
    keep = filter_groups(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_filter_groups_tolerance_and_interleaved_ids():
    rewards = torch.tensor([0.30, 0.0, 0.31, 1.0])
    groups = torch.tensor([5, 9, 5, 9])  # samples of a group need not be adjacent
    assert filter_groups(rewards, groups).tolist() == [True, True, True, True]
    # spread 0.01 in group 5 is within tol 0.05; group 9 spread 1.0 is not
    assert filter_groups(rewards, groups, tol=0.05).tolist() == [False, True, False, True]


def test_filter_groups_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        filter_groups([float("nan"), 1.0], ["a", "a"])


def test_dynamic_batch_filler_drops_and_refills():
    filler = DynamicBatchFiller(target_groups=3, max_rounds=3)
    # round 1: x {1, 0} keep, y {1, 1} drop, z {0, 1} keep -> 2 groups
    kept = filler.add(
        ["r1x0", "r1x1", "r1y0", "r1y1", "r1z0", "r1z1"], [1, 0, 1, 1, 0, 1], ["x", "x", "y", "y", "z", "z"]
    )
    assert kept == 2 and not filler.done and filler.groups_needed == 1
    # round 2: prompt "x" drawn again forms a new group; x {0, 1} and w {1, 0} both informative, room for 1
    kept = filler.add(["r2x0", "r2x1", "r2w0", "r2w1"], [0, 1, 1, 0], ["x", "x", "w", "w"])
    assert kept == 1
    assert filler.done and filler.reached_target
    assert filler.groups() == [["r1x0", "r1x1"], ["r1z0", "r1z1"], ["r2x0", "r2x1"]]
    assert filler.items() == ["r1x0", "r1x1", "r1z0", "r1z1", "r2x0", "r2x1"]
    assert filler.stats() == {
        "rounds": 2.0,
        "groups_seen": 5.0,
        "groups_kept": 3.0,
        "groups_dropped": 1.0,
        "groups_surplus": 1.0,
        "reached_target": 1.0,
        "kept_fraction": 3 / 5,
    }
    with pytest.raises(RuntimeError, match="done"):
        filler.add(["a", "b"], [0, 1], ["g", "g"])


def test_dynamic_batch_filler_gives_up_after_max_rounds():
    filler = DynamicBatchFiller(target_groups=2, max_rounds=2)
    filler.add(["a", "b", "c", "d"], [1, 1, 0, 0], [0, 0, 1, 1])  # nothing informative
    filler.add(["e", "f"], [0, 1], [0, 0])  # one group
    assert filler.done and not filler.reached_target
    assert filler.groups() == [["e", "f"]]
    assert filler.stats()["rounds"] == 2.0 and filler.stats()["groups_dropped"] == 2.0


def test_dynamic_batch_filler_checks_inputs():
    with pytest.raises(ValueError, match="target_groups"):
        DynamicBatchFiller(target_groups=0, max_rounds=1)
    filler = DynamicBatchFiller(target_groups=1, max_rounds=1)
    with pytest.raises(ValueError, match="3 items but 2 values"):
        filler.add(["a", "b", "c"], [0, 1], ["g", "g", "g"])


def test_overlong_mask_from_finish_reasons_and_flags():
    assert overlong_mask(["stop", "length", "eos"]).tolist() == [True, False, True]
    assert overlong_mask([False, True]).tolist() == [True, False]
    assert overlong_mask(torch.tensor([1, 0])).tolist() == [False, True]
    with pytest.raises(ValueError, match="mix"):
        overlong_mask(["stop", True])


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16, then (16 - L) / 4, -1 beyond 20
    got = overlong_penalty([10, 16, 17, 18, 20, 21], max_len=20, cache_len=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty([18], 20, 4, factor=2.0), torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty([1], max_len=4, cache_len=8)
