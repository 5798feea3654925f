"""DAPO dynamic sampling and overlong handling, against hand-worked cases."""

from __future__ import annotations

import pytest
import torch

from sleuth.rl.sampling import filter_groups, overlong_mask


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


def test_overlong_mask_from_finish_reasons_and_flags():
    assert overlong_mask(["stop", "length", "eos"]).tolist() == [True, False, True]
    assert overlong_mask([False, True]).tolist() == [True, False]
    assert overlong_mask(torch.tensor([1, 0])).tolist() == [False, True]
    with pytest.raises(ValueError, match="mix"):
        overlong_mask(["stop", True])
