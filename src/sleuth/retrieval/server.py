"""HTTP retrieval server speaking the Search-R1 `/retrieve` API.

Request:  `{"queries": [str], "topk": int | null, "return_scores": bool}`
Response: `{"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}` with
scores, `{"result": [[{"id", "contents"}, ...] per query]}` without. As in Search-R1, a missing,
null or 0 `topk` means the server's default k.

Everything Search-R1's client (`search_r1/llm_agent/generation.py`) sends is served: an empty
`queries` list (a turn where no rollout searched) gets `{"result": []}`; a request of up to
`max_queries` queries (default 4096; Search-R1's batch sizes send up to ~2,560 at once) is searched
in chunks of `max_batch_queries`, as Search-R1's own server searches in `retrieval_batch_size`
chunks; a query longer than `max_query_chars` is cut to that length rather than refused (Search-R1's
dense encoder likewise truncates queries, to 256 tokens).

The retriever is CPU-bound and synchronous, so it runs in worker threads, batched continuously (as
TEI and vLLM schedule): a worker that becomes free takes every request queued at that moment into one
`retriever.search` call, so many small concurrent requests cost about as much as one batched call.
A request that finds a worker idle is searched at once unless there is evidence that others are
about to join it (see `MicroBatcher`); a lone client sending one request at a time never waits.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sleuth.http_errors import BodyBudget, BodyLimitMiddleware, error_response, validation_error_response
from sleuth.retrieval.base import (
    BODY_BUDGET_REQUESTS,
    BODY_BUDGET_WAIT_S,
    DEFAULT_MAX_QUERIES,
    DEFAULT_MAX_QUERY_CHARS,
    DEFAULT_SEARCH_CHUNK,
    Hit,
    Retriever,
    default_max_body_bytes,
)
from sleuth.text import unusable_text
from sleuth.utils import CONCURRENCY_MEMORY_S, RecentPeak

DEFAULT_K = 3  # Search-R1's retrieval server default (`--topk 3`)


class RetrieveRequest(BaseModel):
    """Body of `POST /retrieve`; extra fields are ignored, as the Search-R1 server does."""

    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


class RetrieverFailure(Exception):
    """The retriever raised or returned a malformed result; the request gets a 503."""


def _finite_or_none(score: float) -> float | None:
    return score if math.isfinite(score) else None


def _dumps_stdlib(body: dict[str, Any]) -> bytes:
    # ASCII output: CPython's encoder is ~2x faster with ensure_ascii on; clients decode it identically.
    try:
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode("ascii")
    except ValueError:
        # A retriever may pad with -inf/NaN scores; JSON has no such numbers, so send null instead.
        for hits in body["result"]:
            for item in hits:
                if "score" in item:
                    item["score"] = _finite_or_none(item["score"])
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode("ascii")


try:  # orjson, when installed, encodes ~20x faster and already writes non-finite floats as null
    import orjson

    def _dumps(body: dict[str, Any]) -> bytes:
        return orjson.dumps(body)

except ImportError:  # pragma: no cover - depends on the environment
    _dumps = _dumps_stdlib


def encode_result(hits_per_query: list[list[Hit]], return_scores: bool) -> bytes:
    """The `/retrieve` response body as JSON bytes, in the Search-R1 shape."""
    if return_scores:
        result: list[list[dict[str, Any]]] = [
            [{"document": {"id": h.doc_id, "contents": h.contents}, "score": float(h.score)} for h in hits]
            for hits in hits_per_query
        ]
    else:
        result = [[{"id": h.doc_id, "contents": h.contents} for h in hits] for hits in hits_per_query]
    return _dumps({"result": result})


@dataclass
class _Job:
    queries: list[str]
    k: int
    return_scores: bool
    future: asyncio.Future = field(repr=False)
    arrived: float = 0.0  # event-loop clock at submission


def _search_checked(retriever: Retriever, queries: list[str], k: int, chunk: int) -> list[list[Hit]]:
    """`retriever.search` over `queries` in slices of at most `chunk`, so one huge request cannot
    make one huge call (query-encoder activations, score matrices); results are joined in order."""
    results: list[list[Hit]] = []
    for start in range(0, len(queries), chunk):
        part = queries[start : start + chunk]
        try:
            found = retriever.search(part, k)
        except Exception as err:
            raise RetrieverFailure(f"retriever failed: {type(err).__name__}: {err}") from err
        if not isinstance(found, list) or len(found) != len(part):
            got = len(found) if isinstance(found, list) else type(found).__name__
            raise RetrieverFailure(f"retriever returned {got} result lists for {len(part)} queries")
        results.extend(found)
    return results


class MicroBatcher:
    """Merges concurrent `search` calls into shared `retriever.search` calls on worker threads.

    Continuous batching: while all workers are busy, arriving jobs queue up, and a worker that
    becomes free takes everything queued (up to `max_batch_queries`) into one call at once. A job
    that finds a worker idle is dispatched immediately unless holding it can pay off: it is held
    (for at most `batch_wait_s` from its arrival, less whatever it already spent queued) only while

    - requests have lately overlapped (more jobs were outstanding at once in the last
      `CONCURRENCY_MEMORY_S` seconds than are outstanding now), i.e. other clients are about to
      send theirs, as lock-step clients (rollout workers reaching a search turn together) do; and
    - the batch is under half of `max_batch_queries`: a larger one already amortises the per-call
      cost, and a request of its size would not fit beside it.

    The hold ends as soon as either stops being true. So a lone client sending one request at a
    time (outstanding requests never exceed one) and large requests are never delayed. A single
    job larger than `max_batch_queries` is searched in chunks of that size.
    """

    def __init__(
        self,
        retriever: Retriever,
        *,
        max_batch_queries: int = DEFAULT_SEARCH_CHUNK,
        batch_wait_s: float = 0.002,
        worker_threads: int = 1,
    ):
        if worker_threads < 1:
            raise ValueError(f"worker_threads must be >= 1, got {worker_threads}")
        if max_batch_queries < 1:
            raise ValueError(f"max_batch_queries must be >= 1, got {max_batch_queries}")
        if not batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.batch_wait_s = batch_wait_s
        self.worker_threads = worker_threads
        self._executor = ThreadPoolExecutor(worker_threads, thread_name_prefix="sleuth-retrieve")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Job] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._arrival: asyncio.Event | None = None
        self._collector: asyncio.Task | None = None
        self._dispatches: set[asyncio.Task] = set()
        # Loop-thread state: jobs submitted and not yet answered, and the recent peak of that count.
        self._outstanding = 0
        self._overlap = RecentPeak(CONCURRENCY_MEMORY_S)
        self._stats_lock = threading.Lock()
        self.stats = {
            "requests": 0,
            "queries": 0,
            "search_calls": 0,
            "failures": 0,
            "truncated_queries": 0,
            "held_batches": 0,  # batches held for concurrent requests to join
            "holds_to_deadline": 0,  # of those, held the full batch_wait (the expected requests never came)
        }

    def _ensure_started(self) -> asyncio.Queue[_Job]:
        # Started lazily in the running loop: a test client may serve each request from a new loop.
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._collector is None or self._collector.done():
            self._loop = loop
            self._queue = asyncio.Queue()
            self._slots = asyncio.Semaphore(self.worker_threads)
            self._arrival = asyncio.Event()
            self._outstanding = 0
            self._overlap = RecentPeak(CONCURRENCY_MEMORY_S)
            self._collector = loop.create_task(self._collect(self._queue, self._slots, self._arrival))
        assert self._queue is not None
        return self._queue

    async def submit(self, queries: list[str], k: int, return_scores: bool) -> bytes:
        """Search `queries` (sharing a call with concurrent jobs) and return the encoded response body."""
        queue = self._ensure_started()
        loop = asyncio.get_running_loop()
        now = loop.time()
        future = loop.create_future()
        queue.put_nowait(_Job(queries, k, return_scores, future, now))
        self._outstanding += 1
        self._overlap.record(self._outstanding, now)
        assert self._arrival is not None
        self._arrival.set()
        return await future

    def _worth_holding(self, n_queries: int, now: float) -> bool:
        """Whether a batch of `n_queries` that could be dispatched now should wait for more requests."""
        return (
            self.batch_wait_s > 0
            and 2 * n_queries < self.max_batch_queries
            and self._outstanding < self._overlap.peak(now)
        )

    def _take_queued(
        self, queue: asyncio.Queue[_Job], batch: list[_Job], n_queries: int
    ) -> tuple[_Job | None, int]:
        """Move queued jobs into `batch` while they fit; returns (the first job that did not fit, queries)."""
        while not queue.empty():
            job = queue.get_nowait()
            if n_queries + len(job.queries) > self.max_batch_queries:
                return job, n_queries
            batch.append(job)
            n_queries += len(job.queries)
        return None, n_queries

    async def _collect(
        self, queue: asyncio.Queue[_Job], slots: asyncio.Semaphore, arrival: asyncio.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        carry: _Job | None = None
        while True:
            await slots.acquire()
            first = carry if carry is not None else await queue.get()
            batch = [first]
            carry, n_queries = self._take_queued(queue, batch, len(first.queries))
            if carry is None and self._worth_holding(n_queries, loop.time()):
                carry, n_queries = await self._hold(
                    queue, arrival, batch, n_queries, first.arrived + self.batch_wait_s
                )
            task = loop.create_task(self._dispatch(batch, slots))
            self._dispatches.add(task)
            task.add_done_callback(self._dispatches.discard)

    async def _hold(
        self,
        queue: asyncio.Queue[_Job],
        arrival: asyncio.Event,
        batch: list[_Job],
        n_queries: int,
        deadline: float,
    ) -> tuple[_Job | None, int]:
        """Let arriving jobs join `batch` until it is no longer worth holding or `deadline` passes."""
        loop = asyncio.get_running_loop()
        held = to_deadline = False
        carry: _Job | None = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                to_deadline = held
                break
            held = True
            arrival.clear()
            try:
                await asyncio.wait_for(arrival.wait(), remaining)
            except asyncio.TimeoutError:
                to_deadline = True
                break
            carry, n_queries = self._take_queued(queue, batch, n_queries)
            if carry is not None or not self._worth_holding(n_queries, loop.time()):
                break
        if held:
            with self._stats_lock:
                self.stats["held_batches"] += 1
                self.stats["holds_to_deadline"] += to_deadline
        return carry, n_queries

    async def _dispatch(self, batch: list[_Job], slots: asyncio.Semaphore) -> None:
        specs = [(job.queries, job.k, job.return_scores) for job in batch]
        outcomes: list[bytes | RetrieverFailure]
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._run_batch, specs
            )
        except (Exception, asyncio.CancelledError) as err:
            # Executor shut down or loop closing: fail the waiting jobs rather than leave them hanging.
            outcomes = [RetrieverFailure(f"retrieval worker unavailable: {err!r}") for _ in batch]
            self._settle(batch, outcomes)
            raise
        finally:
            slots.release()
        self._settle(batch, outcomes)

    def _settle(self, batch: list[_Job], outcomes: list[bytes | RetrieverFailure]) -> None:
        self._outstanding -= len(batch)
        for job, outcome in zip(batch, outcomes, strict=True):
            if job.future.done():  # the client went away
                continue
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def _run_batch(self, specs: list[tuple[list[str], int, bool]]) -> list[bytes | RetrieverFailure]:
        """Runs on a worker thread: one search call per distinct k, then encode each job's response."""
        outcomes: list[bytes | RetrieverFailure] = [RetrieverFailure("not run")] * len(specs)
        by_k: dict[int, list[int]] = {}
        for i, (_, k, _) in enumerate(specs):
            by_k.setdefault(k, []).append(i)
        calls = failures = 0
        for k, job_ids in by_k.items():
            merged = [q for i in job_ids for q in specs[i][0]]
            try:
                calls += -(-len(merged) // self.max_batch_queries)
                results = _search_checked(self.retriever, merged, k, self.max_batch_queries)
                per_job: list[list[list[Hit]] | RetrieverFailure] = []
                start = 0
                for i in job_ids:
                    end = start + len(specs[i][0])
                    per_job.append(results[start:end])
                    start = end
            except RetrieverFailure as err:
                if len(job_ids) == 1:
                    per_job = [err]
                else:
                    # One bad request must not fail the others it was merged with: retry them alone.
                    per_job = []
                    for i in job_ids:
                        calls += -(-len(specs[i][0]) // self.max_batch_queries)
                        try:
                            per_job.append(
                                _search_checked(self.retriever, specs[i][0], k, self.max_batch_queries)
                            )
                        except RetrieverFailure as single_err:
                            per_job.append(single_err)
            for i, hits in zip(job_ids, per_job, strict=True):
                if isinstance(hits, RetrieverFailure):
                    failures += 1
                    outcomes[i] = hits
                else:
                    outcomes[i] = encode_result(hits, specs[i][2])
        with self._stats_lock:
            self.stats["requests"] += len(specs)
            self.stats["queries"] += sum(len(s[0]) for s in specs)
            self.stats["search_calls"] += calls
            self.stats["failures"] += failures
        return outcomes

    def count_truncated(self, n: int) -> None:
        with self._stats_lock:
            self.stats["truncated_queries"] += n

    def snapshot_stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    def close(self) -> None:
        if self._collector is not None and not self._collector.done():
            self._collector.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _describe_retriever(retriever: Retriever) -> dict[str, Any]:
    kind = getattr(retriever, "kind", None) or type(retriever).__name__
    num_docs = getattr(retriever, "num_docs", None)
    if num_docs is None:
        num_docs = getattr(retriever, "num_indexed", None)
    if num_docs is None:
        num_docs = getattr(getattr(retriever, "docstore", None), "num_docs", None)
    if num_docs is None and hasattr(retriever, "__len__"):
        try:
            num_docs = len(retriever)  # type: ignore[arg-type]
        except TypeError:
            num_docs = None
    return {"kind": str(kind), "num_docs": int(num_docs) if num_docs is not None else None}


def create_app(
    retriever: Retriever,
    *,
    max_queries: int = DEFAULT_MAX_QUERIES,
    max_k: int = 100,
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
    default_k: int = DEFAULT_K,
    name: str = "sleuth-retriever",
    worker_threads: int = 1,
    batch_wait_ms: float = 2.0,
    max_batch_queries: int | None = None,
    max_body_bytes: int | None = None,
    body_budget: BodyBudget | None = None,
) -> FastAPI:
    """A FastAPI app serving `retriever` at `POST /retrieve` (Search-R1 API) and `GET /health`.

    `max_queries` caps one request (more gets a 422 saying to split it); `max_query_chars` is where
    longer queries are cut; `max_batch_queries` (default 512) is the most queries one
    `retriever.search` call gets, whether they come from one large request or several merged ones.
    `batch_wait_ms` is the longest a request that finds a worker idle is held for concurrent
    requests to join its call, and only when that can help (see `MicroBatcher`); 0 never holds.
    A body over `max_body_bytes` gets 413 before it is read; by default the limit fits max_queries
    ASCII queries of max_query_chars (`default_max_body_bytes`). `body_budget` bounds the body bytes
    held at once over concurrent requests (default: 4 bodies at the limit, 1 s wait, then 503 with
    Retry-After; see `BodyBudget`); its counters are `app.state.body_budget` and in /health."""
    for label, value in (
        ("max_queries", max_queries),
        ("max_k", max_k),
        ("max_query_chars", max_query_chars),
    ):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if not 1 <= default_k <= max_k:
        raise ValueError(f"default_k must be in [1, max_k={max_k}], got {default_k}")

    batcher = MicroBatcher(
        retriever,
        max_batch_queries=max_batch_queries or DEFAULT_SEARCH_CHUNK,
        batch_wait_s=batch_wait_ms / 1000.0,
        worker_threads=worker_threads,
    )
    info = _describe_retriever(retriever)
    limits = {
        "max_queries": max_queries,
        "max_k": max_k,
        "max_query_chars": max_query_chars,
        "default_k": default_k,
    }

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        batcher.close()

    app = FastAPI(title=name, lifespan=lifespan)
    app.state.batcher = batcher
    max_body_bytes = max_body_bytes or default_max_body_bytes(max_queries, max_query_chars)
    if body_budget is None:
        body_budget = BodyBudget(BODY_BUDGET_REQUESTS * max_body_bytes, BODY_BUDGET_WAIT_S)
    if body_budget.total_bytes < max_body_bytes:
        raise ValueError(
            f"body_budget_bytes ({body_budget.total_bytes}) is smaller than max_body_bytes "
            f"({max_body_bytes}): a request at the limit could never be served; raise the budget"
        )
    app.state.body_budget = body_budget
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, budget=body_budget)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc, '{"queries": [str, ...], "topk": int, "return_scores": bool}')

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "name": name,
            **info,
            **limits,
            "max_body_bytes": max_body_bytes,
            "stats": {**batcher.snapshot_stats(), **body_budget.stats()},
        }

    @app.post("/retrieve")
    async def retrieve(req: RetrieveRequest) -> Response:
        k = req.topk or default_k  # Search-R1 treats a null or 0 topk as "use the default"
        if k < 1 or k > max_k:
            return error_response(422, f"topk must be between 1 and {max_k}, got {req.topk}", "topk")
        if not req.queries:
            # Search-R1's client posts an empty list when no rollout searched this turn
            return Response(content=b'{"result":[]}', media_type="application/json")
        if len(req.queries) > max_queries:
            return error_response(
                422,
                f"queries has {len(req.queries)} items; this server accepts at most {max_queries} per request "
                "(split the list into smaller batches)",
                "queries",
            )
        for i, query in enumerate(
            req.queries
        ):  # refused before a batch: it would fail or slow its neighbours
            problem = unusable_text(query)
            if problem is not None:
                return error_response(422, f"queries[{i}] {problem}", "queries")
        queries = [q if len(q) <= max_query_chars else q[:max_query_chars] for q in req.queries]
        truncated = sum(len(q) > max_query_chars for q in req.queries)
        if truncated:
            batcher.count_truncated(truncated)
        try:
            body = await batcher.submit(queries, k, req.return_scores)
        except RetrieverFailure as err:
            return error_response(503, str(err))
        return Response(content=body, media_type="application/json")

    return app
