"""The metrics a run can log, so that a guard watching a metric no step ever logs (a typo such as
`health/no_serach`) is refused when the recipe loads, instead of never firing while the report calls the run
"healthy (no guard fired)".

Which metrics a step logs depends on the recipe: the loop (whether it answers: `accuracy/em`), the reward (its
declared `components`, as `reward/<name>`), the algorithm (a critic, a KL term, the policy loss's declared
stats as `actor/<stat>`) and the retriever (a cache). The names here are the trainer's (sleuth.rl.trainer
`_log_step`, sleuth.rl.step_metrics, sleuth.rl.run_metrics, sleuth.rl.health);
`tests/test_guard_metrics.py::test_every_logged_metric_is_known` trains a step and checks every logged name
is among them. A reward or policy loss that declares nothing leaves its prefix open.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import sleuth.rewards  # noqa: F401 - registers the built-in rewards, whose components are looked up
from sleuth.agent.registry import find_method
from sleuth.errors import ConfigError
from sleuth.rewards.base import reward_class
from sleuth.rl.config import Recipe
from sleuth.rl.health import TREND_SOURCES
from sleuth.rl.losses import POLICY_LOSS_STATS

# logged at every step, whatever the recipe
ALWAYS = (
    "reward/mean",
    "reward/std",
    "reward/mean_before_filter",
    "retrieval_count",
    "turns",
    "response_length/policy_tokens",
    "response_length/total_tokens",
    "answered",
    "stage",
    "sampling_rounds",
    "time/rollout",
    "time/reward",
    "time/update",
    "time/step",
    "tokens/policy_per_s",
    "rollout/errors",
    "lr",
    "time/decode_compile",
    "time/retrieval",
    "retrieval/queries",
    "actor/entropy",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/skipped_nonfinite_grad",
    "health/no_search",
    "health/repeated_query",
    "health/invalid_action",
    "health/unsupported_answer",
    "health/truncated",
    "health/distinct_queries",
    "health/zero_advantage_groups",
    "health/nonfinite_skips",
    # the machine's: the GPU ones only on CUDA, the graph failures only when the decode engine had some
    "memory/host_peak_rss_gib",
    "memory/peak_allocated_gib",
    "memory/device_in_use_gib",
    "decode/graph_failures",
    # how the update ran, and whether the rollouts decoded with the trainer's weights (issue 43)
    "memory/checkpointed_layers",
    "update/packed",
    "update/micro_batch_tokens",
    "update/micro_batches",
    "update/tokens",
    "time/make_batch",
    "time/weight_sync",
    # where the update's time goes: its passes (all, mean, first, slowest micro-batch) and the optimizer step
    "time/micro_batches",
    "time/micro_batch",
    "time/micro_batch_first",
    "time/micro_batch_max",
    "time/optimizer",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
    "rollout/logprob_diff_tokens",
)
CRITIC = ("critic/value_loss", "critic/clipfrac", "critic/skipped_nonfinite_grad")
CACHE = ("retriever/cache_hits", "retriever/cache_misses")


@dataclass(frozen=True)
class Loggable:
    """The metric names a run logs, and the prefixes under which any name may appear (an undeclared reward's
    components, an undeclared policy loss's stats)."""

    names: frozenset[str]
    open_prefixes: tuple[str, ...] = ()

    def __contains__(self, metric: str) -> bool:
        return metric in self.names or metric.startswith(self.open_prefixes)


def loggable_metrics(recipe: Recipe) -> Loggable:
    """What a step of this recipe's run can log."""
    names = {*ALWAYS, *TREND_SOURCES, *(CACHE if recipe.retriever.cache else ())}
    open_prefixes: list[str] = []
    method = find_method(recipe.agent.loop)
    if method is None or method.answers:
        names.add("accuracy/em")
    algo = recipe.algorithm
    if algo.uses_critic:
        names.update(CRITIC)
    if algo.kl.coef > 0:
        names.add("actor/kl")
        if algo.kl.mode == "loss":
            names.add("actor/kl_loss")
    if algo.kl.type == "adaptive":
        names.add("actor/kl_coef_next")
    stats = POLICY_LOSS_STATS.get(algo.policy_loss)
    if stats is None:
        open_prefixes.append("actor/")
    else:
        names.update(f"actor/{s}" for s in stats)
    reward = reward_class(recipe.reward.name)
    if reward is None or reward.components is None:  # an unknown reward is refused when the run builds it
        open_prefixes.append("reward/")
    else:
        names.update(f"reward/{c}" for c in reward.components)
    return Loggable(frozenset(names), tuple(open_prefixes))


def check_guard_metrics(recipe: Recipe, source: str = "recipe") -> None:
    """Refuse, in one line, a guard whose metric this run never logs, naming the closest one it does."""
    loggable = loggable_metrics(recipe)
    for guard in recipe.trainer.guards:
        metric = getattr(guard, "metric", None)  # a validation_drop guard watches validation, not a metric
        if metric is None or metric in loggable:
            continue
        raise ConfigError(
            f"{source}: trainer.guards: guard {guard.name!r} watches metric {metric!r}, which a run with "
            f"agent.loop={recipe.agent.loop}, reward.name={recipe.reward.name} and "
            f"algorithm.name={recipe.algorithm.name} never logs; {_suggestion(metric, loggable)}"
        )


def _suggestion(metric: str, loggable: Loggable) -> str:
    close = difflib.get_close_matches(metric, sorted(loggable.names), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    section = metric.split("/")[0] + "/"
    same = sorted(n for n in loggable.names if n.startswith(section)) or sorted(loggable.names)
    return f"name one it logs: {', '.join(same)}"
