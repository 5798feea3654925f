"""The step's metrics about the machinery rather than the policy: decode compiles and graph captures, the
retriever's time and cache, the adaptive KL coefficient and device memory (the trainer logs them with the rest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sleuth.retrieval.cache import cache_stats
from sleuth.rl.step_metrics import memory_metrics

if TYPE_CHECKING:
    from sleuth.rl.run import Run


def machinery_metrics(run: Run) -> dict[str, float]:
    metrics = cache_stats(run.retriever)  # replayed / searched queries with retriever.cache
    if run.recipe.algorithm.kl.type == "adaptive":
        metrics["actor/kl_coef_next"] = run.kl_coef  # what adaptive KL set for the next step
    # one-time compiles of new decode shapes, or the decode engine's graph captures (part of time/rollout)
    compiled = getattr(run.generator, "compile_seconds", 0.0) + getattr(run.generator, "capture_seconds", 0.0)
    metrics["time/decode_compile"] = compiled - run.compile_seconds_logged
    run.compile_seconds_logged = compiled
    # the step's searches (its rollout's, and a reward's that searches; part of time/rollout and time/reward)
    seconds, queries = run.retriever.totals()
    metrics["time/retrieval"] = seconds - run.retrieval_logged[0]
    metrics["retrieval/queries"] = float(queries - run.retrieval_logged[1])
    run.retrieval_logged = (seconds, queries)
    failures = getattr(run.generator, "graph_failures", 0)
    if failures:  # batches the decode engine decoded eagerly since the run began (several times slower)
        metrics["decode/graph_failures"] = float(failures)
    metrics.update(memory_metrics(run.ctx.device))
    return metrics
