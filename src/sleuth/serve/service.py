"""The trained searcher as a service: validation, request batching, rollouts, served context, answers.

Both front ends (the HTTP API in `searcher_server` and the MCP server in `mcp_server`) call
`SearcherService.search`. Requests that arrive while the model is busy are merged into one batched
rollout (continuous batching); a request that finds the model idle waits up to `batch_wait_ms` for
company only when requests have lately overlapped, so a lone client is never delayed. Merged requests
share one rollout (one `generate` call per turn for all of them)
on a single worker thread: the policy is one model, and running two rollouts at once on it would
only make both slower. A batch is split by (max_turns, top_k), since one rollout runs one loop
configuration.

A request's cost is bounded so that one pathological question cannot hold the requests batched with it: a
question of more than `max_question_tokens` tokens (2,000 `[` are 1,000 tokens for SmolLM2, an ordinary
2,000-character question about 400) is refused with 422 before it joins a batch, since every row of a batched
turn pays for the longest prompt; a search still running after `max_generation_s` of its rollout stops at the
next turn and gets 504 of its own; and every search is answered as soon as its own trajectory is finished,
not when the slowest one of its batch is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import TIME_LIMIT, RolloutBudget, encode_text, rollout, rollout_each
from sleuth.agent.registry import find_method
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.llm.base import Generator, SamplingParams
from sleuth.retrieval.base import Hit, Retriever, format_docs
from sleuth.rewards.answerer import DEFAULT_READER, answer_from_documents, answer_from_evidence
from sleuth.text import unusable_text
from sleuth.utils import CONCURRENCY_MEMORY_S, RecentPeak


class RequestError(ValueError):
    """The request is malformed (HTTP 422); `field` names the offending input."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name
        self.message = message


class NoAnswerGenerator(RuntimeError):
    """/answer was called on a server started without --generator (HTTP 400)."""


class ServiceFailure(RuntimeError):
    """A backend (retriever, searcher model, answer generator) failed (HTTP 503)."""


class SearchTimeout(TimeoutError):
    """The request did not finish within the server's per-request timeout (HTTP 504)."""


@dataclass(frozen=True)
class ServeLimits:
    max_question_chars: int = 2000
    max_turns: int = 8  # the largest per-request max_turns accepted
    max_top_k: int = 20  # the largest per-request top_k accepted
    max_batch: int = 16  # requests merged into one batched rollout
    batch_wait_ms: float = (
        10.0  # longest a request waits for others to share its rollout (only after overlap)
    )
    timeout_s: float = 300.0  # per request, queueing included (a CPU searcher takes minutes under load)
    # a question's tokens for the searcher's tokenizer: an ordinary question at max_question_chars is ~400
    max_question_tokens: int = 512
    # a search's rollout time; past it the search stops at the next turn and its request gets 504 (None: no limit)
    max_generation_s: float | None = 120.0

    def __post_init__(self) -> None:
        for name in ("max_question_chars", "max_turns", "max_top_k", "max_batch", "max_question_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_generation_s is not None and not self.max_generation_s > 0:
            raise ValueError(f"max_generation_s must be > 0 (or None: no limit), got {self.max_generation_s}")


@dataclass(frozen=True)
class SearcherSettings:
    """How a `SearcherService` runs: its request limits, the rollout's token budgets, the reader's answer
    length, and the names /health reports."""

    limits: ServeLimits = field(default_factory=ServeLimits)
    max_new_tokens_per_turn: int = 256
    max_obs_tokens: int = 512
    max_response_tokens: int = 2048
    answer_max_new_tokens: int = 128
    model_name: str = ""
    retriever_name: str = ""  # "": the retriever's class name
    generator_name: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_new_tokens_per_turn",
            "max_obs_tokens",
            "max_response_tokens",
            "answer_max_new_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class SearchQuery:
    """A validated request."""

    question: str
    max_turns: int
    top_k: int
    want_answer: bool = False


@dataclass
class _Outcome:
    body: dict[str, Any]
    started: float  # perf_counter when this request's rollout began
    search_s: float
    answer_s: float = 0.0


@dataclass
class _Job:
    query: SearchQuery
    submitted: float
    future: asyncio.Future = field(repr=False)


class _GuardedRetriever:
    """Turns any retriever exception into a ServiceFailure that names the retriever."""

    def __init__(self, inner: Retriever):
        self.inner = inner

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        try:
            return self.inner.search(queries, k)
        except Exception as err:
            raise ServiceFailure(f"retriever failed: {type(err).__name__}: {err}") from err


class _GuardedGenerator:
    """Counts generate calls (one per turn of a batched rollout) and labels model failures."""

    def __init__(self, inner: Generator, label: str, on_call: Callable[[], None]):
        self.inner = inner
        self.label = label
        self.on_call = on_call
        self.tokenizer = getattr(inner, "tokenizer", None)

    def generate(self, batch: list, stop: list | None = None, params: SamplingParams | None = None) -> list:
        self.on_call()
        try:
            return self.inner.generate(batch, stop, params)
        except Exception as err:
            raise ServiceFailure(f"{self.label} failed: {type(err).__name__}: {err}") from err


def _settle(future: asyncio.Future, outcome: Any) -> None:
    """Resolve a request's future once (event-loop thread); a request already answered or timed out is left."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _doc(hit: dict[str, Any]) -> dict[str, str]:
    return {
        "id": str(hit.get("doc_id", "")),
        "title": str(hit.get("title", "")),
        "text": str(hit.get("text", "")),
    }


def served_documents(traj: Trajectory) -> list[dict[str, str]]:
    """What the searcher hands a downstream LLM, as {id, title, text} records.

    Each method says which (`Method.hand_over`): s3 its selected documents; QAgent, Search-R1, staged
    the deduplicated passages it retrieved; R-Search ("RSTool") its evidence block, then those passages.
    """
    method = find_method(traj.method)
    return [_doc(h) for h in (method.hand_over(traj) if method else traj.served_context)]


def _reads_evidence(traj: Trajectory) -> bool:
    method = find_method(traj.method)
    return method is not None and method.reads_evidence


def context_text(docs: Sequence[dict[str, str]]) -> str:
    """The served context in the `Doc {i}(Title: {title}) {text}` format the papers' prompts use."""
    return format_docs([Hit(doc_id=d["id"], title=d["title"], text=d["text"], score=0.0) for d in docs])


def response_body(traj: Trajectory, batch_size: int) -> dict[str, Any]:
    docs = served_documents(traj)
    return {
        "question": traj.question,
        "loop": traj.method,
        "context": docs,
        "context_text": context_text(docs),
        "trajectory": {
            "queries": list(traj.queries),
            "documents": [[_doc(h) for h in hits] for hits in traj.retrieved],
            "answer": traj.answer,
            "evidence": traj.evidence,
            "finish_reason": traj.finish_reason,
            "num_turns": traj.num_turns,
        },
        "retrieval_count": traj.retrieval_count,
        "batch_size": batch_size,
    }


class SearcherService:
    """A searcher policy + its loop + a retriever (+ optionally a frozen answer generator)."""

    def __init__(
        self,
        generator: Generator,
        loop: AgentLoop,
        retriever: Retriever,
        answer_generator: Generator | None = None,
        settings: SearcherSettings | None = None,
    ):
        tokenizer = getattr(generator, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "the searcher model must expose a tokenizer (a local model: alias, checkpoint dir or .gguf); "
                "the rollout engine works token-in/token-out"
            )
        settings = settings or SearcherSettings()
        self.loop = loop
        self.limits = settings.limits
        if loop.top_k > self.limits.max_top_k or loop.max_turns > self.limits.max_turns:
            # the loop's own defaults must always be acceptable requests
            self.limits = replace(
                self.limits,
                max_top_k=max(self.limits.max_top_k, loop.top_k),
                max_turns=max(self.limits.max_turns, loop.max_turns),
            )
        self.tokenizer = tokenizer
        self.generator = _GuardedGenerator(generator, "searcher model", self._count_generate)
        self.retriever = _GuardedRetriever(retriever)
        self.answer_generator = (
            _GuardedGenerator(answer_generator, "answer generator", lambda: None)
            if answer_generator
            else None
        )
        self.params = SamplingParams(max_new_tokens=settings.max_new_tokens_per_turn, temperature=0.0)
        self.answer_params = SamplingParams(max_new_tokens=settings.answer_max_new_tokens, temperature=0.0)
        self.max_obs_tokens = settings.max_obs_tokens
        self.max_response_tokens = settings.max_response_tokens
        self.model_name = settings.model_name
        self.retriever_name = settings.retriever_name or type(retriever).__name__
        self.generator_name = settings.generator_name
        self._stats_lock = threading.Lock()
        self.stats = {
            "requests": 0,
            "completed": 0,
            "rejected": 0,
            "failures": 0,
            "timeouts": 0,
            "batches": 0,
            "rollouts": 0,
            "generate_calls": 0,
            "answer_calls": 0,
            "held_batches": 0,  # batches that waited batch_wait_ms for concurrent requests to join
        }
        self._next_id = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sleuth-searcher")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Job] | None = None
        self._collector: asyncio.Task | None = None
        # Requests submitted and not yet answered, and the recent peak of that count (event-loop thread).
        self._outstanding = 0
        self._overlap = RecentPeak(CONCURRENCY_MEMORY_S)

    # -- bookkeeping ------------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def _count_generate(self) -> None:
        self.count("generate_calls")

    def snapshot_stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "loop": self.loop.name,
            "loop_defaults": {"max_turns": self.loop.max_turns, "top_k": self.loop.top_k},
            "retriever": self.retriever_name,
            "generator": self.generator_name,
            "limits": {
                "max_question_chars": self.limits.max_question_chars,
                "max_turns": self.limits.max_turns,
                "max_top_k": self.limits.max_top_k,
                "max_batch": self.limits.max_batch,
                "batch_wait_ms": self.limits.batch_wait_ms,
                "timeout_s": self.limits.timeout_s,
                "max_question_tokens": self.limits.max_question_tokens,
                "max_generation_s": self.limits.max_generation_s,
            },
        }

    # -- validation -------------------------------------------------------------------------------
    def validate(
        self, question: Any, max_turns: Any = None, top_k: Any = None, *, want_answer: bool = False
    ) -> SearchQuery:
        """Check a request against the server's limits; raises RequestError naming the field."""
        if not isinstance(question, str):
            raise RequestError("question", f"question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise RequestError("question", "question is empty; send the question text to search for")
        problem = unusable_text(question)
        if (
            problem is not None
        ):  # refused here, before a batch: it would fail or slow every request batched with it
            raise RequestError("question", f"question {problem}")
        if len(question) > self.limits.max_question_chars:
            raise RequestError(
                "question",
                f"question has {len(question)} characters; this server accepts at most {self.limits.max_question_chars}",
            )
        tokens = len(encode_text(self.tokenizer, question.strip()))
        if tokens > self.limits.max_question_tokens:  # every row of a batched turn would pay for its prompt
            raise RequestError(
                "question",
                f"question is {tokens} tokens for this searcher's tokenizer; this server accepts at most "
                f"{self.limits.max_question_tokens} (--max-question-tokens): shorten it",
            )
        turns = self._bounded_int("max_turns", max_turns, self.loop.max_turns, self.limits.max_turns)
        k = self._bounded_int("top_k", top_k, self.loop.top_k, self.limits.max_top_k)
        return SearchQuery(question=question.strip(), max_turns=turns, top_k=k, want_answer=want_answer)

    @staticmethod
    def _bounded_int(name: str, value: Any, default: int, upper: int) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(name, f"{name} must be an integer, got {type(value).__name__}")
        if not 1 <= value <= upper:
            raise RequestError(name, f"{name} must be between 1 and {upper}, got {value}")
        return value

    # -- the async front door ------------------------------------------------------------------------
    async def search(self, query: SearchQuery) -> dict[str, Any]:
        """Run `query` (sharing a batched rollout with concurrent requests); the response body.

        Raises NoAnswerGenerator, ServiceFailure or SearchTimeout."""
        if query.want_answer and self.answer_generator is None:
            raise NoAnswerGenerator(
                "this server has no answer generator; restart it with --generator SPEC "
                "(a local model alias/dir or openai:<base_url>#<model>), or call /search instead"
            )
        self.count("requests")
        queue = self._ensure_started()
        submitted = time.perf_counter()
        future = asyncio.get_running_loop().create_future()
        queue.put_nowait(_Job(query, submitted, future))
        self._outstanding += 1
        self._overlap.record(self._outstanding, submitted)
        try:
            outcome: _Outcome = await asyncio.wait_for(future, self.limits.timeout_s)
        except SearchTimeout:  # this search ran past max_generation_s (a TimeoutError too: caught first)
            self.count("timeouts")
            raise
        except asyncio.TimeoutError as err:
            self.count("timeouts")
            raise SearchTimeout(
                f"the search did not finish within {self.limits.timeout_s:g} s (server --timeout-s); "
                "try fewer max_turns or retry later"
            ) from err
        except ServiceFailure:
            self.count("failures")
            raise
        finally:
            self._outstanding -= 1
        self.count("completed")
        body = dict(outcome.body)
        body["timings"] = {
            "queue_s": round(max(0.0, outcome.started - submitted), 6),
            "search_s": round(outcome.search_s, 6),
            "answer_s": round(outcome.answer_s, 6),
            "total_s": round(time.perf_counter() - submitted, 6),
        }
        return body

    def _ensure_started(self) -> asyncio.Queue[_Job]:
        # Started lazily in the running loop: each server (uvicorn, MCP stdio, a test client) owns one.
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._collector is None or self._collector.done():
            self._loop = loop
            self._queue = asyncio.Queue()
            self._collector = loop.create_task(self._collect(self._queue))
        assert self._queue is not None
        return self._queue

    async def _collect(self, queue: asyncio.Queue[_Job]) -> None:
        loop = asyncio.get_running_loop()
        wait_s = self.limits.batch_wait_ms / 1000.0
        while True:
            first = await queue.get()
            # Continuous batching: requests queued while the model was busy are taken together. A
            # request that finds it idle waits for company only when requests have lately overlapped
            # (lock-step clients about to send theirs); a lone client is never delayed.
            lately = self._overlap.peak(time.perf_counter())
            if wait_s > 0 and queue.qsize() < self.limits.max_batch - 1 and self._outstanding < lately:
                self.count("held_batches")
                await asyncio.sleep(wait_s)
            batch = [first]
            while len(batch) < self.limits.max_batch and not queue.empty():
                batch.append(queue.get_nowait())
            live = [job for job in batch if not job.future.done()]  # timed-out requests are not run
            if not live:
                continue
            futures = [job.future for job in live]

            def release(
                i: int, outcome: _Outcome | Exception, futures: list[asyncio.Future] = futures
            ) -> None:
                loop.call_soon_threadsafe(_settle, futures[i], outcome)  # from the worker thread

            try:
                outcomes = await loop.run_in_executor(
                    self._executor, self.run_batch, [j.query for j in live], release
                )
            except (
                Exception
            ) as err:  # executor shut down: fail the waiting jobs rather than leave them hanging
                outcomes = [ServiceFailure(f"search worker unavailable: {err!r}") for _ in live]
            for future, outcome in zip(futures, outcomes, strict=True):
                _settle(future, outcome)  # those released early are done already

    # -- the batched work (worker thread) ------------------------------------------------------------
    def run_batch(
        self,
        queries: Sequence[SearchQuery],
        release: Callable[[int, _Outcome | Exception], None] | None = None,
    ) -> list[_Outcome | Exception]:
        """One rollout per distinct (max_turns, top_k), then one answer call per prompt kind. A search
        without an answer is handed to `release(i, outcome)` as soon as its trajectory is finished."""
        self.count("batches")
        outcomes: list[_Outcome | Exception] = [ServiceFailure("not run")] * len(queries)
        trajs: dict[int, Trajectory] = {}
        groups: dict[tuple[int, int], list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault((q.max_turns, q.top_k), []).append(i)
        finished: set[int] = set()  # requests whose trajectory the rollout handed back
        for (turns, k), members in groups.items():
            started = time.perf_counter()

            def done(
                row: int, traj: Trajectory, members: list[int] = members, started: float = started
            ) -> None:
                i = members[row]
                finished.add(i)
                outcomes[i] = self._outcome(traj, len(members), started)
                if traj.finish_reason != TIME_LIMIT:
                    trajs[i] = traj
                if release is not None and not queries[i].want_answer:
                    release(i, outcomes[i])

            try:
                self._rollout([queries[i].question for i in members], turns, k, done)
            except ServiceFailure as err:
                for i in set(members) - finished:
                    outcomes[i] = err
            except Exception as err:
                left = [i for i in members if i not in finished]
                if len(left) > 1:
                    # one bad request must not fail the others it was batched with: run each alone
                    for i in left:
                        self._run_alone(queries, i, outcomes, trajs)
                elif left:
                    outcomes[left[0]] = ServiceFailure(f"search failed: {type(err).__name__}: {err}")
        wanted = [i for i, q in enumerate(queries) if q.want_answer and i in trajs]
        if wanted:
            self._answer_into(outcomes, trajs, wanted)
        return outcomes

    def _outcome(self, traj: Trajectory, batch_size: int, started: float) -> _Outcome | SearchTimeout:
        """A finished search's response, or, stopped at max_generation_s, its request's own 504."""
        if traj.finish_reason == TIME_LIMIT:
            return SearchTimeout(
                f"this question's search ran past the server's budget of {self.limits.max_generation_s:g} s of "
                f"generation per request (--max-generation-s) after {traj.num_turns} turn(s); ask with fewer "
                "max_turns or a simpler question"
            )
        return _Outcome(response_body(traj, batch_size), started, time.perf_counter() - started)

    def _run_alone(
        self,
        queries: Sequence[SearchQuery],
        i: int,
        outcomes: list[_Outcome | Exception],
        trajs: dict[int, Trajectory],
    ) -> None:
        started = time.perf_counter()
        try:
            (traj,) = self._rollout([queries[i].question], queries[i].max_turns, queries[i].top_k)
        except ServiceFailure as err:
            outcomes[i] = err
            return
        except Exception as err:
            outcomes[i] = ServiceFailure(f"search failed: {type(err).__name__}: {err}")
            return
        outcomes[i] = self._outcome(traj, 1, started)
        if traj.finish_reason != TIME_LIMIT:
            trajs[i] = traj

    def _rollout(
        self,
        questions: list[str],
        max_turns: int,
        top_k: int,
        on_done: Callable[[int, Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        loop = self.loop if top_k == self.loop.top_k else replace(self.loop, top_k=top_k)
        with self._stats_lock:
            first = self._next_id
            self._next_id += len(questions)
            self.stats["rollouts"] += 1
        examples = [
            QAExample(id=f"req{first + j}", question=q, golden_answers=[]) for j, q in enumerate(questions)
        ]
        budget = RolloutBudget(
            self.max_obs_tokens, self.max_response_tokens, max_turns, self.limits.max_generation_s
        )
        if on_done is None:
            return rollout(
                loop,
                self.generator,
                self.retriever,
                examples,
                self.params,
                budget=budget,
                tokenizer=self.tokenizer,
            )
        return rollout_each(
            loop,
            self.generator,
            self.retriever,
            examples,
            self.params,
            on_done,
            budget=budget,
            tokenizer=self.tokenizer,
        )

    def _answer_into(
        self, outcomes: list[_Outcome | Exception], trajs: dict[int, Trajectory], wanted: list[int]
    ) -> None:
        """Ask the frozen generator, batched: R-Search evidence with its evidence prompt, the rest from docs."""
        assert self.answer_generator is not None
        by_evidence = [i for i in wanted if _reads_evidence(trajs[i]) and trajs[i].evidence]
        by_docs = [i for i in wanted if i not in by_evidence]
        method = find_method(self.loop.name)
        template = (method.reader if method else None) or DEFAULT_READER
        started = time.perf_counter()
        try:
            answers: dict[int, str] = {}
            if by_evidence:
                self.count("answer_calls")
                texts = answer_from_evidence(
                    self.answer_generator,
                    [trajs[i].question for i in by_evidence],
                    [trajs[i].evidence or "" for i in by_evidence],
                    self.answer_params,
                )
                answers.update(zip(by_evidence, texts, strict=True))
            if by_docs:
                self.count("answer_calls")
                docs = [
                    [
                        {"doc_id": d["id"], "title": d["title"], "text": d["text"], "score": 0.0}
                        for d in served_documents(trajs[i])
                    ]
                    for i in by_docs
                ]
                texts = answer_from_documents(
                    self.answer_generator,
                    [trajs[i].question for i in by_docs],
                    docs,
                    template,
                    self.answer_params,
                )
                answers.update(zip(by_docs, texts, strict=True))
        except Exception as err:
            failure = (
                err
                if isinstance(err, ServiceFailure)
                else ServiceFailure(f"answer generator failed: {type(err).__name__}: {err}")
            )
            for i in wanted:
                outcomes[i] = failure
            return
        answer_s = time.perf_counter() - started
        for i in wanted:
            outcome = outcomes[i]
            assert isinstance(outcome, _Outcome)
            outcome.body["answer"] = answers[i]
            outcome.answer_s = answer_s

    def close(self) -> None:
        if self._collector is not None and not self._collector.done():
            self._collector.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
