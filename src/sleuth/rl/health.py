"""Health of a training run: what the agent's search behaviour and the optimisation look like at each step.

Every value is computed from the engine's trajectories and the update's statistics, the same way for every
loop (no method is named here), over every rollout of the step on every rank (before DAPO's filter: what the
policy did, not what the update kept). Shares are global ratios: numerators and denominators are summed over
ranks before dividing, so a step on W ranks logs what one process would.

    health/no_search            trajectories in which the policy ran no search (a loop's own searches before
                                the first generation, s3's, do not count)
    health/repeated_query       the policy's queries that repeat an earlier query of the same trajectory
                                (compared lowercased, whitespace collapsed), over all its queries
    health/invalid_action       turns that held no recognised action, over all turns
    health/unsupported_answer   answered trajectories whose answer is in none of the documents they were
                                served (token span check, as s3's), over answered trajectories
    health/truncated            trajectories that hit the response token budget (finish reason "length")
    health/distinct_queries     distinct policy queries per question, over the n samples of that question
    health/zero_advantage_groups groups of >= 2 samples whose rewards are all equal (no GRPO signal); absent
                                when no group has two samples (n = 1)
    health/nonfinite_skips      optimizer steps skipped this step for a non-finite loss or gradient
    health/response_length_trend, health/entropy_trend
                                least-squares slope per step of response_length/policy_tokens and
                                actor/entropy over the last `TREND_WINDOW` logged steps (`trends`)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from sleuth.agent.trajectory import Trajectory
from sleuth.rewards.metrics import span_check
from sleuth.rl.dist import DistContext

PREFIX = "health/"
TREND_WINDOW = 10
TREND_SOURCES = {
    "health/response_length_trend": "response_length/policy_tokens",
    "health/entropy_trend": "actor/entropy",
}
_SKIP_STATS = ("actor/skipped_nonfinite_grad", "critic/skipped_nonfinite_grad")


def policy_queries(traj: Trajectory) -> list[str]:
    """The queries the policy wrote (the loop's initial searches left out)."""
    return traj.queries[traj.initial_queries :]


def _query_key(query: str) -> str:
    return " ".join(query.lower().split())


def repeated_queries(traj: Trajectory) -> int:
    """How many of the policy's queries repeat an earlier one of the same trajectory."""
    keys = [_query_key(q) for q in policy_queries(traj)]
    return len(keys) - len(set(keys))


def answer_supported(traj: Trajectory) -> bool:
    """Whether the answer's tokens occur as a contiguous span of some served document (title and text)."""
    answer = traj.answer or ""
    docs = [f"{h.get('title', '')} {h.get('text', '')}" for hits in traj.retrieved for h in hits]
    return any(span_check(doc, [answer]) for doc in docs)


def health_counts(trajs: Sequence[Trajectory], rewards: Sequence[float]) -> dict[str, tuple[float, float]]:
    """(numerator, denominator) of each share, for one rank's rollouts of one step."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault((t.sampling_round, t.group), []).append(i)
    multi = [idx for idx in groups.values() if len(idx) >= 2]
    answered = [t for t in trajs if t.answer is not None]
    n = float(len(trajs))
    return {
        "health/no_search": (sum(not policy_queries(t) for t in trajs), n),
        "health/repeated_query": (
            sum(repeated_queries(t) for t in trajs),
            sum(len(policy_queries(t)) for t in trajs),
        ),
        "health/invalid_action": (sum(t.invalid_actions for t in trajs), sum(t.num_turns for t in trajs)),
        "health/unsupported_answer": (sum(not answer_supported(t) for t in answered), len(answered)),
        "health/truncated": (sum(t.finish_reason == "length" for t in trajs), n),
        "health/distinct_queries": (
            sum(
                len({_query_key(q) for i in idx for q in policy_queries(trajs[i])}) for idx in groups.values()
            ),
            len(groups),
        ),
        "health/zero_advantage_groups": (
            sum(len({rewards[i] for i in idx}) == 1 for idx in multi),
            len(multi),
        ),
    }


def health_metrics(trajs: Sequence[Trajectory], rewards: Sequence[float], stats: Mapping[str, list[float]],
                   ctx: DistContext) -> dict[str, float]:  # fmt: skip
    """The step's health shares over every rank's rollouts (a collective: every rank calls it), and the
    optimizer steps skipped for non-finite values (the same on every rank: the gradient norm is global)."""
    counts = health_counts(trajs, rewards)
    keys = sorted(counts)
    summed = ctx.all_reduce_sum(
        torch.tensor([float(x) for k in keys for x in counts[k]], dtype=torch.float64)
    )
    values = summed.tolist()
    out: dict[str, float] = {}
    for i, key in enumerate(keys):
        num, den = values[2 * i], values[2 * i + 1]
        if den > 0:
            out[key] = num / den
        elif key != "health/zero_advantage_groups":  # nothing to count (no query, no answer): nothing wrong
            out[key] = 0.0
    out["health/nonfinite_skips"] = float(sum(sum(stats.get(k, [])) for k in _SKIP_STATS))
    return out


def slope(values: Sequence[float]) -> float:
    """Least-squares slope per step of equally spaced values (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    x = np.arange(len(values), dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    x -= x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def trends(history: Sequence[Mapping[str, float]], window: int = TREND_WINDOW) -> dict[str, float]:
    """Slopes of response length and entropy over the last `window` rows of `history` (the current step
    last); a source metric a run does not log gives no trend."""
    out = {}
    for name, source in TREND_SOURCES.items():
        values = [float(r[source]) for r in history[-window:] if source in r]
        if values:
            out[name] = slope(values)
    return out
