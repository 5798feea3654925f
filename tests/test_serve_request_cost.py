"""A searcher request's cost is bounded (issue 48): on main a question of 2,000 `[` held a SmolLM2 searcher batch
2.8x longer for the good requests beside it. Now a question over `max_question_tokens` gets 422 before it joins
a batch, a search past `max_generation_s` gets 504 of its own, and a finished search is answered without
waiting for the slowest one of its batch. CPU: the tiny model's tokenizer, a scripted policy whose turns take
a fixed time (so the timings do not depend on the machine's speed), the Search-R1 loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from sleuth.agent.registry import get_loop
from sleuth.llm.registry import tiny_model_dir
from sleuth.llm.scripted import ScriptCall, ScriptedGenerator
from sleuth.retrieval.base import Hit
from sleuth.serve.searcher_server import create_app
from sleuth.serve.service import SearcherService, SearcherSettings, SearchTimeout, ServeLimits
from sleuth.serve.threaded import serve_in_thread

TURN_S = 0.3  # what one batched turn of the policy takes
BUDGET_S = 1.5  # max_generation_s: 5 turns
GOOD = "Where was the director of the film born?"
SLOW = "SLOW: which company keeps searching?"


class TimedPolicy(ScriptedGenerator):
    """A policy whose every batched turn takes TURN_S: the good question answers at once, the slow one searches
    at every turn (up to max_turns)."""

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer, self._turn)

    @staticmethod
    def _turn(call: ScriptCall) -> str:
        return "<search>more about it</search>" if "SLOW" in call.prompt_text else "<answer>Paris</answer>"

    def generate(self, batch: list, stop: list | None = None, params: Any = None) -> list:
        time.sleep(TURN_S)
        return super().generate(batch, stop, params)


class OneHitRetriever:
    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return [[Hit("d1", "Title", "Some text.", 1.0)] for _ in queries]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir())


@pytest.fixture
def service(tokenizer: Any) -> Iterator[SearcherService]:
    limits = ServeLimits(max_turns=8, max_batch=4, batch_wait_ms=0, max_generation_s=BUDGET_S)
    svc = SearcherService(
        TimedPolicy(tokenizer),
        get_loop("search_r1", max_turns=8, top_k=1),
        OneHitRetriever(),
        settings=SearcherSettings(limits=limits, max_new_tokens_per_turn=32),
    )
    yield svc
    svc.close()


def test_a_question_over_the_token_budget_gets_422_before_a_batch(service: SearcherService) -> None:
    """2,000 `[` pass the character limit (2,000) but are 2,000 tokens for the tiny tokenizer (1,000 for
    SmolLM2's): refused, naming the field and the option; an ordinary question of the same length is served."""
    with serve_in_thread(create_app(service)) as base:
        r = httpx.post(f"{base}/search", json={"question": "[" * 2000}, timeout=60)
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "question" and "--max-question-tokens" in r.json()["detail"]
        assert "2000 tokens" in r.json()["detail"] and "at most 512" in r.json()["detail"]
        ordinary = (GOOD + " ") * (2000 // (len(GOOD) + 1))
        assert httpx.post(f"{base}/search", json={"question": ordinary}, timeout=60).status_code == 200
    assert service.snapshot_stats()["batches"] == 1  # the refused one never reached the model


def test_a_search_past_the_generation_budget_gets_504_of_its_own(service: SearcherService) -> None:
    with serve_in_thread(create_app(service)) as base:
        r = httpx.post(f"{base}/search", json={"question": SLOW}, timeout=60)
        assert r.status_code == 504, r.text
        assert "--max-generation-s" in r.json()["detail"] and f"{BUDGET_S:g} s" in r.json()["detail"]
        assert httpx.post(f"{base}/search", json={"question": GOOD}, timeout=60).status_code == 200
        assert httpx.get(f"{base}/health").json()["stats"]["timeouts"] == 1


def test_a_slow_search_does_not_hold_the_good_one_batched_with_it(service: SearcherService) -> None:
    """Both requests share one rollout. The good one is answered after its own turn, not when the batch ends;
    the slow one stops at the budget (on main: 9 turns, 2.7 s, and both answered then)."""

    async def both() -> tuple[Any, Any, float]:
        started = time.perf_counter()
        results = await asyncio.gather(
            service.search(service.validate(SLOW)),
            service.search(service.validate(GOOD)),
            return_exceptions=True,
        )
        return results[0], results[1], time.perf_counter() - started

    slow, good, elapsed = asyncio.run(both())
    assert isinstance(slow, SearchTimeout), slow
    assert good["trajectory"]["answer"] == "Paris" and good["batch_size"] == 2
    assert good["timings"]["total_s"] < BUDGET_S - TURN_S  # one turn, not the batch
    assert elapsed < BUDGET_S + 3 * TURN_S  # the slow search stopped at the first turn past the budget
    assert service.snapshot_stats()["rollouts"] == 1
