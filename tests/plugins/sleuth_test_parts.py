"""Parts added from outside sleuth, with no edit to it (tests/test_method_plugin.py trains, evaluates and serves
with them): an advantage estimator, a policy loss and a retriever backend. Each counts its calls, so a test
can see the trainer, `sleuth eval` and `sleuth serve-searcher` used it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from sleuth.retrieval.backends import OpenContext, RetrieverBackend, register_backend
from sleuth.retrieval.base import Hit
from sleuth.retrieval.index import load_retriever
from sleuth.rl.advantages import grpo_advantages, register_advantage
from sleuth.rl.losses import get_policy_loss, register_policy_loss

CALLS: Counter[str] = Counter()


@register_advantage("test_counted_grpo")
def counted_grpo(
    scores: torch.Tensor, group_ids: Any, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantage, counted."""
    CALLS["advantage"] += 1
    return grpo_advantages(scores, group_ids, response_mask)


@register_policy_loss("test_counted_ppo")
def counted_ppo(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped loss, counted."""
    CALLS["policy_loss"] += 1
    return get_policy_loss("ppo_clip")(*args, **kwargs)


class CountedRetriever:
    """An index directory's retriever whose searches are counted (a stand-in for a new search engine)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        CALLS["search"] += len(queries)
        return self.inner.search(queries, k)


def _open_counted(rest: str, ctx: OpenContext) -> CountedRetriever:
    CALLS["open"] += 1
    return CountedRetriever(load_retriever(rest, corpus=ctx.corpus))


register_backend(RetrieverBackend("test_counted", _open_counted, "test_counted:DIR"))
