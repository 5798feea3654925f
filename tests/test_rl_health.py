"""Health metrics of a step, on hand-built trajectories with hand-computed values."""

from __future__ import annotations

import pytest
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.rl.dist import DistContext
from sleuth.rl.health import health_counts, health_metrics, slope, trends


def _traj(group: int, queries: list[str], docs: list[list[str]], answer: str | None, *, initial: int = 0,
          invalid: int = 0, turns: int = 1, finish: str = "answer") -> Trajectory:  # fmt: skip
    return Trajectory(
        question_id=str(group),
        question="q",
        golden_answers=["x"],
        method="any",
        queries=queries,
        retrieved=[[{"doc_id": "d", "title": "T", "text": text} for text in texts] for texts in docs],
        answer=answer,
        initial_queries=initial,
        invalid_actions=invalid,
        num_turns=turns,
        finish_reason=finish,
        group=group,
    )


def _step() -> tuple[list[Trajectory], list[float]]:
    trajs = [
        # group 0: three queries, one a repeat (case and spaces differ); the answer is in a served document
        _traj(
            0,
            ["Paris capital", "paris  Capital", "France"],
            [["Paris is the capital"], [], ["x"]],
            "Paris",
            turns=3,
        ),
        # group 0: no search, an answer no document holds, one invalid turn
        _traj(0, [], [], "London", invalid=1, turns=2),
        # group 1: the loop's own first search (s3-like) then one policy query; hit the token budget
        _traj(
            1, ["q init", "who wrote x"], [["foo"], ["bar baz"]], None, initial=1, turns=2, finish="length"
        ),
        # group 1: only the loop's own search: the policy did not search; answer found in that document
        _traj(1, ["q init"], [["bar"]], "bar", initial=1, invalid=1, turns=1),
    ]
    return trajs, [1.0, 0.0, 0.5, 0.5]


def test_health_values_by_hand() -> None:
    trajs, rewards = _step()
    stats = {"actor/skipped_nonfinite_grad": [1.0, 0.0, 1.0], "critic/skipped_nonfinite_grad": [1.0]}
    got = health_metrics(trajs, rewards, stats, DistContext())
    assert got == pytest.approx(
        {
            "health/no_search": 2 / 4,  # trajectories 1 and 3
            "health/repeated_query": 1 / 4,  # 1 repeat among 3 + 0 + 1 + 0 policy queries
            "health/invalid_action": 2 / 8,  # 0 + 1 + 0 + 1 invalid over 3 + 2 + 2 + 1 turns
            "health/unsupported_answer": 1 / 3,  # London, among Paris, London, bar
            "health/truncated": 1 / 4,
            "health/distinct_queries": (2 + 1) / 2,  # {paris capital, france}, {who wrote x}
            "health/zero_advantage_groups": 1 / 2,  # group 1: 0.5, 0.5
            "health/nonfinite_skips": 3.0,
        }
    )


def test_health_is_a_global_ratio_over_ranks() -> None:
    """Two ranks with different counts give the ratio of the summed counts, not the mean of the ratios
    (the samples of a question, a group, are always on one rank)."""
    trajs, rewards = _step()
    mine, other = (trajs[:2], rewards[:2]), (trajs[2:], rewards[2:])
    other_counts = health_counts(*other)

    class TwoRanks(DistContext):
        def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
            keys = sorted(other_counts)
            return t + torch.tensor([float(x) for k in keys for x in other_counts[k]], dtype=t.dtype)

    both = health_metrics(*mine, {}, TwoRanks(world_size=2))
    alone = health_metrics(trajs, rewards, {}, DistContext())
    assert both == pytest.approx(alone)
    assert both["health/repeated_query"] == pytest.approx(1 / 4)  # the mean of the ratios: (1/3 + 0/1) / 2


def test_zero_advantage_share_is_absent_without_groups() -> None:
    trajs, rewards = _step()
    single = [trajs[0], trajs[2]]  # one sample per question (n = 1)
    assert "health/zero_advantage_groups" not in health_metrics(single, [1.0, 0.5], {}, DistContext())


def test_trends_are_least_squares_slopes_of_the_last_window() -> None:
    assert slope([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert slope([0.0, 2.0, 1.0]) == pytest.approx(0.5)  # x = -1, 0, 1; sum x (y - 1) / sum x^2 = 1 / 2
    assert slope([4.0]) == 0.0
    rows = [
        {"actor/entropy": 9.0},
        {"actor/entropy": 3.0, "response_length/policy_tokens": 10.0},
        {"actor/entropy": 2.0, "response_length/policy_tokens": 14.0},
    ]
    got = trends(rows, window=2)
    assert got == pytest.approx({"health/entropy_trend": -1.0, "health/response_length_trend": 4.0})
