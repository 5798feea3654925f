"""`RemoteRetriever`: the `Retriever` protocol over any Search-R1-compatible `/retrieve` server.

Works against `sleuth serve-retriever` and against an existing Search-R1 retrieval server. Big
query lists are split into batches; with several servers the batches are spread round robin over
the healthy ones and sent concurrently. A server that fails is skipped until a health check
passes again.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from sleuth.data.formats import split_contents
from sleuth.errors import ServiceError
from sleuth.retrieval.base import Hit
from sleuth.utils import RetryPolicy, retry

try:  # orjson, when installed, parses large responses several times faster
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - depends on the environment
    from json import loads as _loads


class _TransientError(Exception):
    """A failure worth retrying, possibly on another server (connection, timeout, 5xx)."""


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/retrieve"):
        url = url[: -len("/retrieve")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"retriever URL {url!r} must start with http:// or https://")
    return url


def _hit_from_item(item: Any) -> Hit:
    """One result item, either `{"document": {...}, "score": s}` or a bare document dict."""
    if not isinstance(item, dict):
        raise TypeError(f"expected a JSON object per hit, got {type(item).__name__}")
    if "document" in item and isinstance(item["document"], dict):
        doc, score = item["document"], item.get("score")
    else:
        doc, score = item, None  # servers asked for scores but answering without them: score unknown -> 0
    if "contents" in doc:
        title, text = split_contents(str(doc["contents"]))
    else:
        title, text = str(doc.get("title", "")), str(doc.get("text", ""))
    # Search-R1's BM25 path returns documents without an id.
    return Hit(
        doc_id=str(doc.get("id", "")),
        title=title,
        text=text,
        score=float(score) if score is not None else 0.0,
    )


def parse_response(payload: Any, n_queries: int) -> list[list[Hit]]:
    """Hits per query from a `/retrieve` response body (either Search-R1 shape)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise TypeError('expected a JSON object with a "result" list')
    result = payload["result"]
    if len(result) != n_queries:
        raise TypeError(f"got {len(result)} result lists for {n_queries} queries")
    return [[_hit_from_item(item) for item in hits] for hits in result]


class RemoteRetriever:
    """Retriever backed by one or more HTTP retrieval servers.

    `retries` is the number of attempts per batch; between attempts the client backs off
    exponentially from `base_delay` seconds and moves to the next healthy server. `retry` (a
    `RetryPolicy`, e.g. a recipe's `services.retry`) replaces those three settings with a time
    budget. A 4xx answer is not retried (the request itself is wrong) and raises `ServiceError`
    with the server's message.
    """

    def __init__(
        self,
        urls: str | list[str],
        timeout: float = 30.0,
        retries: int = 4,
        batch_size: int = 256,
        *,
        base_delay: float = 0.5,
        max_delay: float = 8.0,
        recheck_s: float = 5.0,
        concurrency: int | None = None,
        retry: RetryPolicy | None = None,
    ):
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("RemoteRetriever needs at least one server URL")
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.urls = [_base_url(u) for u in url_list]
        self.timeout = timeout
        self.retries = retries
        self.batch_size = batch_size
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.retry_policy = retry or RetryPolicy(
            max_attempts=retries, initial_delay_s=base_delay, max_delay_s=max_delay, budget_s=math.inf
        )
        self.recheck_s = recheck_s
        self.concurrency = concurrency or 2 * len(self.urls)
        self._client = httpx.Client(
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max(self.concurrency, 4), max_keepalive_connections=self.concurrency
            ),
        )
        self._lock = threading.Lock()
        self._next = 0
        self._down_since: dict[str, float] = {}  # url -> time of the last failed request or health check
        self._pool: ThreadPoolExecutor | None = None

    # -- server selection -------------------------------------------------------------------

    def healthy_urls(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u not in self._down_since]

    def _mark_down(self, url: str) -> None:
        with self._lock:
            self._down_since[url] = time.monotonic()

    def check_health(self, url: str) -> bool:
        """True if `url` answers; marks it up or down. Falls back to a tiny query on servers without /health."""
        try:
            resp = self._client.get(f"{url}/health", timeout=min(self.timeout, 5.0))
            if resp.status_code in (404, 405):  # e.g. a Search-R1 server: no /health route
                resp = self._client.post(
                    f"{url}/retrieve",
                    json={"queries": ["health check"], "topk": 1},
                    timeout=min(self.timeout, 5.0),
                )
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        with self._lock:
            if ok:
                self._down_since.pop(url, None)
            else:
                self._down_since[url] = time.monotonic()
        return ok

    def _pick_url(self) -> str:
        now = time.monotonic()
        with self._lock:
            due = [u for u, t in self._down_since.items() if now - t >= self.recheck_s]
        for url in due:
            self.check_health(url)
        with self._lock:
            healthy = [u for u in self.urls if u not in self._down_since]
            # With every server down, keep trying them in turn so the caller sees the real error.
            candidates = healthy or self.urls
            url = candidates[self._next % len(candidates)]
            self._next += 1
        return url

    # -- requests ---------------------------------------------------------------------------

    def _post_once(self, queries: list[str], k: int) -> list[list[Hit]]:
        url = self._pick_url()
        endpoint = f"{url}/retrieve"
        try:
            resp = self._client.post(endpoint, json={"queries": queries, "topk": k, "return_scores": True})
        except httpx.HTTPError as err:
            self._mark_down(url)
            raise _TransientError(f"{endpoint}: {type(err).__name__}: {err}") from err
        if resp.status_code >= 500:
            self._mark_down(url)
        check_status(resp, endpoint)
        try:
            return parse_response(_loads(resp.content), len(queries))
        except (ValueError, TypeError, KeyError) as err:
            raise ServiceError(
                f"{endpoint} answered with a malformed /retrieve response ({err}); is it a Search-R1-compatible server?"
            ) from err

    def _search_batch(self, queries: list[str], k: int) -> list[list[Hit]]:
        return retry(
            lambda: self._post_once(queries, k),
            policy=self.retry_policy,
            retry_on=(_TransientError,),
            what=f"retriever {', '.join(self.urls)} (retrieval of {len(queries)} queries)",
        )

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-k hits per query, best first (the `Retriever` protocol)."""
        if isinstance(queries, str):
            raise TypeError("search() takes a list of queries, not a single string")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        queries = list(queries)
        if not queries:
            return []
        batches = [queries[i : i + self.batch_size] for i in range(0, len(queries), self.batch_size)]
        if len(batches) == 1 or self.concurrency == 1:
            parts = [self._search_batch(b, k) for b in batches]
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="sleuth-remote")
                pool = self._pool
            parts = list(pool.map(lambda b: self._search_batch(b, k), batches))
        return [hits for part in parts for hits in part]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._client.close()

    def __enter__(self) -> RemoteRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteRetriever({self.urls!r}, batch_size={self.batch_size})"


def check_status(resp: httpx.Response, endpoint: str) -> None:
    """The retry rule of every HTTP retriever: a 5xx is transient (retried with backoff), any other
    non-200 answer means the request itself is wrong and raises `ServiceError` with the server's message."""
    if resp.status_code >= 500:
        raise _TransientError(f"{endpoint}: HTTP {resp.status_code}: {_detail(resp)}")
    if resp.status_code != 200:
        raise ServiceError(f"{endpoint} rejected the request: HTTP {resp.status_code}: {_detail(resp)}")


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
    except ValueError:
        pass
    return resp.text[:300]
