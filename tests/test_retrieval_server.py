"""Retrieval HTTP server (Search-R1 /retrieve API) and RemoteRetriever client."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import typer
import uvicorn
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from sleuth.errors import ConfigError, ServiceError
from sleuth.retrieval import server as server_module
from sleuth.retrieval.base import Hit, Retriever
from sleuth.retrieval.client import RemoteRetriever, parse_response
from sleuth.retrieval.server import MicroBatcher, RetrieverFailure, create_app, encode_result
from sleuth.retrieval.server_commands import is_loopback_host, register

CORPUS = [
    ("d0", "Paris", "Paris is the capital of France."),
    ("d1", "Berlin", "Berlin is the capital of Germany."),
    ("d2", "Rhine", "The Rhine flows through Germany and the Netherlands."),
    ("d3", "Seine", "The Seine flows through Paris."),
    ("d4", "Alps", "The Alps span France, Switzerland and Italy."),
]


def _terms(text: str) -> set[str]:
    return {t.strip(".,?").lower() for t in text.split()} - {"", "the", "is", "of", "and"}


class OverlapRetriever:
    """Scores a passage by the number of distinct query terms in its title+text; ties keep corpus order."""

    kind = "overlap"

    def __init__(self, corpus: list[tuple[str, str, str]] = CORPUS):
        self.docs = corpus
        self.doc_terms = [_terms(f"{title} {text}") for _, title, text in corpus]
        self.calls: list[tuple[int, int]] = []  # (number of queries, k) per search call

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        self.calls.append((len(queries), k))
        out = []
        for q in queries:
            qt = _terms(q)
            scored = sorted(
                ((float(len(qt & terms)), i) for i, terms in enumerate(self.doc_terms)),
                key=lambda s: (-s[0], s[1]),
            )
            out.append([Hit(self.docs[i][0], self.docs[i][1], self.docs[i][2], s) for s, i in scored[:k]])
        return out


class BoomRetriever(OverlapRetriever):
    """Fails any call whose queries include the word 'boom'."""

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        if any("boom" in q for q in queries):
            self.calls.append((len(queries), k))
            raise RuntimeError("index shard 3 unreadable")
        return super().search(queries, k)


def test_fake_retriever_ranks_by_overlap() -> None:
    r = OverlapRetriever()
    assert isinstance(r, Retriever)
    hits = r.search(["capital of France", "flows Paris"], 2)
    # "capital france": d0 has both (2), d1 has capital (1), d4 has france (1) -> d0, d1 (corpus order)
    assert [(h.doc_id, h.score) for h in hits[0]] == [("d0", 2.0), ("d1", 1.0)]
    # "flows paris": d3 has both (2), d0 paris (1), d2 flows (1) -> d3, d0
    assert [(h.doc_id, h.score) for h in hits[1]] == [("d3", 2.0), ("d0", 1.0)]


# ----------------------------------------------------------------------------- in-process app


@pytest.fixture()
def client() -> Iterator[TestClient]:
    app = create_app(OverlapRetriever(), max_queries=4, max_k=5, max_query_chars=50, batch_wait_ms=0)
    with TestClient(app) as c:
        yield c


def test_retrieve_with_scores_has_search_r1_shape(client: TestClient) -> None:
    resp = client.post(
        "/retrieve", json={"queries": ["capital of France", "flows Paris"], "topk": 2, "return_scores": True}
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json() == {
        "result": [
            [
                {
                    "document": {"id": "d0", "contents": '"Paris"\nParis is the capital of France.'},
                    "score": 2.0,
                },
                {
                    "document": {"id": "d1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
                    "score": 1.0,
                },
            ],
            [
                {
                    "document": {"id": "d3", "contents": '"Seine"\nThe Seine flows through Paris.'},
                    "score": 2.0,
                },
                {
                    "document": {"id": "d0", "contents": '"Paris"\nParis is the capital of France.'},
                    "score": 1.0,
                },
            ],
        ]
    }


def test_retrieve_without_scores_returns_bare_documents(client: TestClient) -> None:
    resp = client.post("/retrieve", json={"queries": ["flows Paris"], "topk": 1, "return_scores": False})
    assert resp.status_code == 200
    assert resp.json() == {"result": [[{"id": "d3", "contents": '"Seine"\nThe Seine flows through Paris.'}]]}
    # return_scores defaults to false, as in Search-R1
    assert client.post("/retrieve", json={"queries": ["flows Paris"], "topk": 1}).json() == resp.json()


@pytest.mark.parametrize(
    "body", [{"queries": ["Alps"]}, {"queries": ["Alps"], "topk": None}, {"queries": ["Alps"], "topk": 0}]
)
def test_missing_null_or_zero_topk_means_default_3(client: TestClient, body: dict) -> None:
    # Search-R1's server falls back to its --topk (3) when topk is falsy.
    result = client.post("/retrieve", json=body).json()["result"]
    assert [d["id"] for d in result[0]] == ["d4", "d0", "d1"]


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({"queries": ["a", "b", "c", "d", "e"]}, "queries", "at most 4"),
        ({"queries": ["a"], "topk": 6}, "topk", "between 1 and 5"),
        ({"queries": ["a"], "topk": -1}, "topk", "between 1 and 5"),
        ({"queries": "capital of France"}, "queries", "valid list"),
        ({"queries": ["a", 7]}, "queries.1", "valid string"),
        ({"queries": ["a"], "topk": "three"}, "topk", "valid integer"),
        ({"queries": ["a"], "topk": 2.5}, "topk", "integer"),
        ({"queries": ["a"], "return_scores": "maybe"}, "return_scores", "valid boolean"),
        ({"topk": 3}, "queries", "Field required"),
        ([1, 2], "body", "valid dictionary"),
    ],
)
def test_bad_requests_get_422_naming_the_field(
    client: TestClient, body: object, field: str, needle: str
) -> None:
    resp = client.post("/retrieve", json=body)
    assert resp.status_code == 422, resp.text
    payload = resp.json()
    assert payload["field"] == field
    assert needle in payload["detail"]
    # The server keeps serving after any bad request.
    assert client.post("/retrieve", json={"queries": ["Alps"], "topk": 1}).status_code == 200


def test_empty_query_list_gets_empty_result_without_searching() -> None:
    # Search-R1's client posts {"queries": []} in a turn where no rollout searched
    retriever = OverlapRetriever()
    with TestClient(create_app(retriever, batch_wait_ms=0)) as c:
        resp = c.post("/retrieve", json={"queries": [], "topk": 3, "return_scores": True})
    assert resp.status_code == 200 and resp.json() == {"result": []}
    assert retriever.calls == []


def test_long_query_is_truncated_not_refused(client: TestClient) -> None:
    long_query = "capital France " + "x" * 100  # the fixture's max_query_chars is 50
    resp = client.post("/retrieve", json={"queries": [long_query, "Alps"], "topk": 2})
    assert resp.status_code == 200
    expected = client.post("/retrieve", json={"queries": [long_query[:50], "Alps"], "topk": 2}).json()
    assert resp.json() == expected
    assert client.get("/health").json()["stats"]["truncated_queries"] == 1


def test_large_request_is_searched_in_chunks_and_answered_in_order() -> None:
    retriever = OverlapRetriever()
    queries = [("capital France", "flows Paris", "Alps")[i % 3] + f" q{i}" for i in range(4096)]
    with TestClient(
        create_app(retriever, batch_wait_ms=0)
    ) as c:  # the defaults: 4096 per request, chunks of 512
        result = c.post("/retrieve", json={"queries": queries, "topk": 1}).json()["result"]
        too_many = c.post("/retrieve", json={"queries": queries + ["one more"], "topk": 1})
    assert [r[0]["id"] for r in result] == [("d0", "d3", "d4")[i % 3] for i in range(4096)]
    assert [n for n, _ in retriever.calls] == [512] * 8
    assert too_many.status_code == 422 and "at most 4096" in too_many.json()["detail"]


def test_malformed_json_body_gets_422(client: TestClient) -> None:
    resp = client.post("/retrieve", content=b'{"queries": ["a"', headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert "JSON" in resp.json()["detail"]
    assert client.get("/health").status_code == 200


def test_health_reports_index_and_limits(client: TestClient) -> None:
    client.post("/retrieve", json={"queries": ["Alps", "Rhine"], "topk": 1})
    health = client.get("/health").json()
    assert health["status"] == "ok"
    assert health["kind"] == "overlap"
    assert health["num_docs"] == 5
    assert (health["max_queries"], health["max_k"], health["max_query_chars"], health["default_k"]) == (
        4,
        5,
        50,
        3,
    )
    assert health["stats"]["requests"] == 1 and health["stats"]["queries"] == 2


def test_failing_retriever_gives_503_and_server_stays_up() -> None:
    with TestClient(create_app(BoomRetriever(), batch_wait_ms=0)) as c:
        resp = c.post("/retrieve", json={"queries": ["boom"], "topk": 2})
        assert resp.status_code == 503
        assert "RuntimeError: index shard 3 unreadable" in resp.json()["detail"]
        assert c.get("/health").json()["stats"]["failures"] == 1
        assert c.post("/retrieve", json={"queries": ["Alps"], "topk": 1}).status_code == 200


class ShortRetriever(OverlapRetriever):
    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return super().search(queries, k)[:-1]


def test_retriever_returning_wrong_number_of_lists_is_503() -> None:
    with TestClient(create_app(ShortRetriever(), batch_wait_ms=0)) as c:
        resp = c.post("/retrieve", json={"queries": ["a", "b"], "topk": 1})
        assert resp.status_code == 503
        assert "1 result lists for 2 queries" in resp.json()["detail"]


@pytest.mark.parametrize("dumps", [server_module._dumps, server_module._dumps_stdlib])
def test_non_finite_scores_are_sent_as_null(dumps, monkeypatch) -> None:
    monkeypatch.setattr(server_module, "_dumps", dumps)
    hits = [[Hit("a", "T", "x", -math.inf), Hit("b", "U", "y", 1.5)]]
    assert json.loads(encode_result(hits, True)) == {
        "result": [
            [
                {"document": {"id": "a", "contents": '"T"\nx'}, "score": None},
                {"document": {"id": "b", "contents": '"U"\ny'}, "score": 1.5},
            ]
        ]
    }


@pytest.mark.parametrize("dumps", [server_module._dumps, server_module._dumps_stdlib])
def test_non_ascii_passages_round_trip(dumps, monkeypatch) -> None:
    monkeypatch.setattr(server_module, "_dumps", dumps)
    hits = [[Hit("z1", "Zürich", 'Ça va — 東京 "quoted"', 0.5)]]
    assert json.loads(encode_result(hits, False)) == {
        "result": [[{"id": "z1", "contents": '"Zürich"\nÇa va — 東京 "quoted"'}]]
    }


def test_app_works_without_lifespan_across_event_loops() -> None:
    # A TestClient used without `with` serves each request from a fresh event loop.
    c = TestClient(create_app(OverlapRetriever(), batch_wait_ms=0))
    for query, doc in [("Alps", "d4"), ("Rhine", "d2"), ("Seine", "d3")]:
        assert c.post("/retrieve", json={"queries": [query], "topk": 1}).json()["result"][0][0]["id"] == doc


def test_create_app_rejects_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_k"):
        create_app(OverlapRetriever(), max_k=0)
    with pytest.raises(ValueError, match="default_k"):
        create_app(OverlapRetriever(), max_k=2, default_k=3)


# ----------------------------------------------------------------------------- micro-batching


def _gather(batcher: MicroBatcher, jobs: list[tuple[list[str], int]]) -> list[object]:
    async def main() -> list[object]:
        try:
            return await asyncio.gather(
                *(batcher.submit(q, k, True) for q, k in jobs), return_exceptions=True
            )
        finally:
            batcher.close()

    return asyncio.run(main())


def test_concurrent_requests_share_one_search_call_per_k() -> None:
    retriever = OverlapRetriever()
    batcher = MicroBatcher(retriever, batch_wait_s=0.05)
    outs = _gather(batcher, [(["Alps"], 1), (["Rhine", "Seine"], 1), (["Paris"], 2), (["Berlin"], 1)])
    # Jobs with k=1 were merged into one call of 4 queries; the k=2 job got its own call.
    assert sorted(retriever.calls) == [(1, 2), (4, 1)]
    # Each job still gets exactly its own results, in order.
    ids = [[[item["document"]["id"] for item in hits] for hits in json.loads(o)["result"]] for o in outs]
    assert ids == [[["d4"]], [["d2"], ["d3"]], [["d0", "d3"]], [["d1"]]]


def test_one_failing_request_does_not_fail_the_requests_it_was_merged_with() -> None:
    retriever = BoomRetriever()
    batcher = MicroBatcher(retriever, batch_wait_s=0.05)
    ok1, bad, ok2 = _gather(batcher, [(["Alps"], 1), (["boom"], 1), (["Rhine"], 1)])
    assert isinstance(bad, RetrieverFailure) and "shard 3" in str(bad)
    assert json.loads(ok1)["result"][0][0]["document"]["id"] == "d4"
    assert json.loads(ok2)["result"][0][0]["document"]["id"] == "d2"
    # one merged attempt, then each job alone
    assert retriever.calls == [(3, 1), (1, 1), (1, 1), (1, 1)]


def test_batch_query_cap_splits_merged_calls() -> None:
    retriever = OverlapRetriever()
    batcher = MicroBatcher(retriever, batch_wait_s=0.05, max_batch_queries=3)
    outs = _gather(batcher, [(["a", "b"], 1), (["c", "d"], 1), (["e"], 1)])
    assert all(isinstance(o, bytes) for o in outs)
    assert [n for n, _ in retriever.calls] == [2, 3]


def test_lone_sequential_client_is_never_held() -> None:
    # A wait longer than the test's guard: any hold would show in the stats (and time the guard out).
    retriever = OverlapRetriever()
    batcher = MicroBatcher(retriever, batch_wait_s=60.0)

    async def main() -> list[bytes]:
        try:
            return [await batcher.submit([q], 1, True) for q in ("Alps", "Rhine", "Seine", "Paris")]
        finally:
            batcher.close()

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert [json.loads(o)["result"][0][0]["document"]["id"] for o in outs] == ["d4", "d2", "d3", "d0"]
    assert retriever.calls == [(1, 1)] * 4
    assert batcher.snapshot_stats()["held_batches"] == 0


def test_lone_client_over_http_is_never_held() -> None:
    with TestClient(create_app(OverlapRetriever(), batch_wait_ms=60_000)) as c:
        for q in ("Alps", "Rhine", "Seine"):
            assert c.post("/retrieve", json={"queries": [q], "topk": 1}).status_code == 200
        stats = c.get("/health").json()["stats"]
    assert stats["requests"] == 3 and stats["search_calls"] == 3 and stats["held_batches"] == 0


def test_lock_step_clients_are_held_until_all_arrive() -> None:
    # Three clients that search together (rollout workers reaching a search turn at once): after one
    # round shows three requests overlapping, a request finding the worker idle is held until the
    # other two arrive, and the hold ends on their arrival, not at the (long) deadline.
    retriever = OverlapRetriever()
    batcher = MicroBatcher(retriever, batch_wait_s=60.0)

    async def main() -> list[bytes]:
        try:
            first_round = await asyncio.gather(
                *(batcher.submit([q], 1, True) for q in ("Alps", "Rhine", "Seine"))
            )
            lead = asyncio.ensure_future(batcher.submit(["Paris"], 1, True))
            for _ in range(5):  # let the collector take "Paris" and start holding it
                await asyncio.sleep(0)
            assert retriever.calls == [(3, 1)]  # nothing dispatched yet: "Paris" is held
            rest = await asyncio.gather(
                batcher.submit(["Berlin"], 1, True), batcher.submit(["Rhine"], 1, True)
            )
            return [*first_round, await lead, *rest]
        finally:
            batcher.close()

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert retriever.calls == [(3, 1), (3, 1)]
    ids = [json.loads(o)["result"][0][0]["document"]["id"] for o in outs]
    assert ids == ["d4", "d2", "d3", "d0", "d1", "d2"]
    assert batcher.snapshot_stats()["held_batches"] == 1
    assert batcher.snapshot_stats()["holds_to_deadline"] == 0


def test_hold_ends_at_the_deadline_and_large_batches_are_not_held() -> None:
    retriever = OverlapRetriever()
    batcher = MicroBatcher(retriever, batch_wait_s=0.01, max_batch_queries=8)

    async def main() -> None:
        try:
            await asyncio.gather(batcher.submit(["Alps"], 1, True), batcher.submit(["Rhine"], 1, True))
            await batcher.submit(
                ["Seine"], 1, True
            )  # overlap seen, the other client never comes: held to deadline
            await asyncio.gather(batcher.submit(["Alps"], 1, True), batcher.submit(["Rhine"], 1, True))
            await batcher.submit(["a", "b", "c", "d"], 1, True)  # half of max_batch_queries: not held
        finally:
            batcher.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert retriever.calls == [(2, 1), (1, 1), (2, 1), (4, 1)]
    stats = batcher.snapshot_stats()
    assert stats["held_batches"] == 1 and stats["holds_to_deadline"] == 1


def test_recent_peak_forgets_after_two_windows() -> None:
    from sleuth.utils import RecentPeak

    peak = RecentPeak(1.0)
    peak.record(3, now=10.0)
    peak.record(1, now=10.5)
    assert peak.peak(10.9) == 3
    peak.record(1, now=11.2)  # new window: the previous one's 3 is still remembered
    assert peak.peak(11.9) == 3
    assert peak.peak(12.3) == 1  # two windows on: only the last window's 1
    assert peak.peak(14.0) == 0


# ----------------------------------------------------------------------------- real HTTP server


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serve(retriever: Retriever, sock: socket.socket | None = None, **app_kwargs: object) -> Iterator[str]:
    """Run a real uvicorn server on a loopback port in a thread; yields its base URL."""
    sock = sock or _bound_socket()
    port = sock.getsockname()[1]
    app = create_app(retriever, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    with serve(OverlapRetriever(), max_queries=8, batch_wait_ms=1) as url:
        yield url


def test_remote_retriever_matches_in_process_results(live_url: str) -> None:
    queries = [
        "capital of France",
        "flows Paris",
        "Alps Italy",
        "Rhine Netherlands",
        "Berlin",
        "nothing matches",
    ]
    expected = OverlapRetriever().search(queries, 3)
    with RemoteRetriever(live_url + "/retrieve", batch_size=4, base_delay=0.01) as remote:
        assert isinstance(remote, Retriever)
        got = remote.search(queries, 3)
    assert got == expected  # ids, titles, texts and scores survive the round trip


def test_remote_retriever_splits_into_batches(live_url: str) -> None:
    with RemoteRetriever(live_url, batch_size=2, concurrency=1) as remote:
        before = remote._client.get(f"{live_url}/health").json()["stats"]["requests"]
        assert len(remote.search([f"q{i} Paris" for i in range(5)], 1)) == 5
        after = remote._client.get(f"{live_url}/health").json()["stats"]["requests"]
    assert after - before == 3  # 2 + 2 + 1


def test_remote_retriever_4xx_is_not_retried(live_url: str) -> None:
    # The server accepts 8 queries per request; a batch of 9 is the caller's mistake, not a transient one.
    with RemoteRetriever(live_url, batch_size=9, base_delay=5.0) as remote:
        start = time.monotonic()
        with pytest.raises(ServiceError, match="at most 8"):
            remote.search(["Paris"] * 9, 1)
        assert time.monotonic() - start < 2.0  # no backoff sleeps happened
        with pytest.raises(ValueError, match="k must be"):
            remote.search(["Paris"], 0)


def test_remote_retriever_dead_port_retries_then_names_url() -> None:
    dead = _bound_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    try:
        with (
            RemoteRetriever(url, retries=3, base_delay=0.01, timeout=2) as remote,
            pytest.raises(ServiceError) as info,
        ):
            remote.search(["Paris"], 1)
    finally:
        dead.close()
    message = str(info.value)
    assert url in message and "3 attempts" in message and "ConnectError" in message


def test_remote_retriever_fails_over_and_recovers(live_url: str) -> None:
    dead = _bound_socket()
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    remote = RemoteRetriever([dead_url, live_url], retries=2, base_delay=0.01, batch_size=1, recheck_s=3600)
    try:
        hits = remote.search(["Alps", "Seine", "Berlin", "Rhine"], 1)
        assert [h[0].doc_id for h in hits] == ["d4", "d3", "d1", "d2"]
        assert remote.healthy_urls() == [live_url]
        assert not remote.check_health(dead_url)
        # The dead address comes back to life: a passing health check returns it to the rotation.
        with serve(OverlapRetriever(), sock=dead):
            assert remote.check_health(dead_url)
            assert remote.healthy_urls() == [dead_url, live_url]
            assert [h[0].doc_id for h in remote.search(["Alps", "Seine"], 1)] == ["d4", "d3"]
    finally:
        remote.close()
        dead.close()


def test_client_parses_both_search_r1_response_shapes() -> None:
    with_scores = {"result": [[{"document": {"id": "7", "contents": '"Title"\nSome text.'}, "score": 12.5}]]}
    assert parse_response(with_scores, 1) == [[Hit("7", "Title", "Some text.", 12.5)]]
    # Search-R1's BM25 server returns title/text/contents without an id; bare documents have no score.
    bare = {"result": [[{"title": "T", "text": "body", "contents": '"T"\nbody'}], []]}
    assert parse_response(bare, 2) == [[Hit("", "T", "body", 0.0)], []]
    with pytest.raises(TypeError, match="2 result lists for 1"):
        parse_response(bare, 1)


def test_remote_retriever_rejects_bad_urls() -> None:
    with pytest.raises(ValueError, match="http://"):
        RemoteRetriever("localhost:8000")
    with pytest.raises(ValueError, match="at least one"):
        RemoteRetriever([])


# ----------------------------------------------------------------------------- CLI


def test_loopback_detection() -> None:
    assert all(is_loopback_host(h) for h in ["127.0.0.1", "localhost", "::1", "[::1]", "127.3.2.1"])
    assert not any(is_loopback_host(h) for h in ["0.0.0.0", "10.1.2.3", "::", "example.org"])


def test_serve_retriever_missing_index_exits_2(tmp_path) -> None:
    result = CliRunner().invoke(_cli_app(), ["serve-retriever", "--index", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


# ----------------------------------------------------------------------------- real BM25 index


def _build_bm25_index(tmp_path) -> tuple:
    from sleuth.retrieval import build_index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": d, "contents": f'"{t}"\n{x}'}) + "\n" for d, t, x in CORPUS),
        encoding="utf-8",
    )
    build_index(corpus, "bm25", tmp_path / "index", show_progress=False)
    return corpus, tmp_path / "index"


@pytest.mark.slow  # the first bm25s search JIT-compiles numba kernels: ~6 s when numba's cache is cold
def test_bm25_index_end_to_end_over_http(tmp_path) -> None:
    from sleuth.retrieval import load_retriever

    corpus, _ = _build_bm25_index(tmp_path)
    bm25 = load_retriever(tmp_path / "index", corpus=corpus)
    queries = ["capital of Germany", "Seine river Paris", "Alps Italy"]
    expected = bm25.search(queries, 2)
    assert [hits[0].doc_id for hits in expected] == ["d1", "d3", "d4"]
    with serve(bm25) as url, RemoteRetriever(url, batch_size=2) as remote:
        assert remote.search(queries, 2) == expected
        health = remote._client.get(f"{url}/health").json()
        assert (health["kind"], health["num_docs"]) == ("BM25Retriever", 5)


def _cli_app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # keep typer in multi-command mode
    return app


def test_serve_retriever_loads_index_and_warns_on_public_host(tmp_path, monkeypatch) -> None:
    corpus, index = _build_bm25_index(tmp_path)
    runs: list[tuple[object, dict]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    args = [
        "serve-retriever",
        "--index",
        str(index),
        "--corpus",
        str(corpus),
        "--port",
        "8123",
        "--max-k",
        "7",
    ]
    result = CliRunner().invoke(_cli_app(), args)
    assert result.exit_code == 0, result.output
    assert "http://127.0.0.1:8123/retrieve" in result.output and "WARNING" not in result.output
    app, kw = runs[0]
    assert (kw["host"], kw["port"]) == ("127.0.0.1", 8123)
    with TestClient(app) as c:
        health = c.get("/health").json()
    assert (health["kind"], health["num_docs"], health["max_k"]) == ("BM25Retriever", 5, 7)

    result = CliRunner().invoke(_cli_app(), [*args, "--host", "0.0.0.0"])
    assert result.exit_code == 0 and "WARNING: binding 0.0.0.0" in result.output
    assert runs[1][1]["host"] == "0.0.0.0"

    result = CliRunner().invoke(
        _cli_app(), [*args, "--max-body-bytes", "5000", "--body-budget-bytes", "12000"]
    )
    assert result.exit_code == 0, result.output
    with TestClient(runs[2][0]) as c:
        health = c.get("/health").json()
        assert c.post("/retrieve", json={"queries": ["x" * 6000]}).status_code == 413
    assert (health["max_body_bytes"], health["stats"]["body_budget_bytes"]) == (5000, 12000)
    result = CliRunner().invoke(
        _cli_app(), [*args, "--max-body-bytes", "5000", "--body-budget-bytes", "4999"]
    )
    assert result.exit_code == 2 and "--body-budget-bytes 4999 is smaller than" in result.output
    assert len(runs) == 3  # refused before serving


def test_serve_retriever_passes_nprobe_and_rerank_to_the_index(tmp_path, monkeypatch) -> None:
    """--nprobe / --rerank reach the loader; an index they do not apply to is refused before serving, also when
    the workers would load it themselves."""
    from sleuth.retrieval import server_commands

    _, index = _build_bm25_index(tmp_path)
    runs: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    base = ["serve-retriever", "--index", str(index)]
    for extra, needle in (
        (["--nprobe", "48"], "--nprobe applies to IVF-PQ indexes; this one is 'bm25'"),
        (["--rerank", "0"], "--rerank needs a dense index with its passage vectors"),
        (["--rerank", "64", "--workers", "2"], "this one is 'bm25'"),
        (["--nprobe", "0"], "--nprobe must be >= 1, got 0"),
        (["--rerank", "-1"], "--rerank must be >= 0, got -1"),
    ):
        result = CliRunner().invoke(_cli_app(), [*base, *extra], terminal_width=300)
        assert result.exit_code == 2 and needle in result.output, (extra, result.output)
    assert runs == []
    loaded: list[dict] = []
    real = server_commands.load_retriever
    monkeypatch.setattr(server_commands, "load_retriever", lambda path, **kw: loaded.append(kw) or real(path))
    monkeypatch.setattr(server_commands, "check_search_options", lambda manifest, search: None)  # as if dense
    result = CliRunner().invoke(_cli_app(), [*base, "--nprobe", "48", "--rerank", "256"], terminal_width=300)
    assert result.exit_code == 0, result.output
    assert loaded == [{"corpus": None, "threads": 1, "nprobe": 48, "rerank": 256}] and len(runs) == 1


def test_search_options_follow_the_index_kind() -> None:
    from sleuth.retrieval.server_commands import check_search_options

    kept = {"kind": "dense", "faiss": {"type": "ivfpq"}, "vectors": {"file": "vectors.f16"}}
    check_search_options(kept, {"nprobe": 64, "rerank": 256})  # an IVF-PQ index with its vectors: both apply
    check_search_options({**kept, "vectors": None}, {"nprobe": 64, "rerank": 0})  # re-ranking off needs none
    with pytest.raises(
        ConfigError, match="--rerank needs a dense index with its passage vectors .*kept none"
    ):
        check_search_options({**kept, "vectors": None}, {"rerank": 64})
    with pytest.raises(ConfigError, match="--nprobe applies to IVF-PQ indexes; this one is 'hnsw'"):
        check_search_options({"kind": "dense", "faiss": {"type": "hnsw"}}, {"nprobe": 8})


def test_serve_retriever_rejects_corpus_of_another_index(tmp_path) -> None:
    _, index = _build_bm25_index(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "contents": '"X"\nsomething else'}) + "\n", encoding="utf-8")
    result = CliRunner().invoke(
        _cli_app(), ["serve-retriever", "--index", str(index), "--corpus", str(other)]
    )
    assert result.exit_code == 2
    assert "different file" in result.output


# ----------------------------------------------------------------------------- Search-R1's client


class SearchR1StyleClient:
    """The calls Search-R1's `search_r1/llm_agent/generation.py` makes, written the same way: every
    turn posts all searching rollouts' queries at once (an empty list when none searched) with the
    configured topk and return_scores=True, indexes `['result']` without checking the status, and
    formats each result with `_passages2string`, then wraps it as `<information>...</information>`."""

    def __init__(self, search_url: str, topk: int = 3):
        self.search_url = search_url
        self.topk = topk

    def _batch_search(self, queries: list[str]) -> dict:
        import httpx

        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        return httpx.post(self.search_url, json=payload, timeout=60).json()

    def batch_search(self, queries: list[str]) -> list[str]:
        results = self._batch_search(queries)["result"]  # a 422 body has no 'result': KeyError
        return [self._passages2string(result) for result in results]

    @staticmethod
    def _passages2string(retrieval_result: list[dict]) -> str:
        format_reference = ""
        for idx, doc_item in enumerate(retrieval_result):
            content = doc_item["document"]["contents"]
            title = content.split("\n")[0]
            text = "\n".join(content.split("\n")[1:])
            format_reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
        return format_reference

    def observations(self, actions: list[tuple[str, str]]) -> list[str]:
        """`execute_predictions` for one turn: (action, content) per rollout -> next observation."""
        search_results = self.batch_search([c for a, c in actions if a == "search"])
        out = []
        for action, _ in actions:
            if action == "search":
                out.append(f"\n\n<information>{search_results.pop(0).strip()}</information>\n\n")
            else:
                out.append("")
        assert not search_results
        return out


def test_search_r1_client_over_a_training_step_of_turns() -> None:
    """A training step's turns as Search-R1's client sends them: a batch of 600 searches, a turn in which
    nobody searched (empty list), one 2,560-query turn (its default batch sizes), one with a 2,500-char
    query. Every turn gets a 'result'; each observation equals sleuth's own Search-R1 loop's text."""
    from sleuth.agent.search_r1 import SearchR1Loop

    retriever = OverlapRetriever()
    loop = SearchR1Loop()
    base = ["capital of France", "flows Paris", "Alps Italy", "Rhine Germany", "Berlin"]
    turns = [
        [("search", base[i % 5]) for i in range(600)],
        [("answer", "Paris")] * 40,
        [("search", base[i % 5] + f" {i}") if i % 4 else ("answer", "x") for i in range(3413)],
        [("search", "Seine flows " + "y" * 2490), ("search", "Alps"), ("answer", "Rome")],
    ]
    with serve(retriever) as url:
        client = SearchR1StyleClient(url + "/retrieve", topk=3)
        for actions in turns:
            observations = client.observations(actions)
            searched = [c for a, c in actions if a == "search"]
            assert len(observations) == len(actions)
            hits = retriever.search([q[:2000] for q in searched], 3) if searched else []
            expected = iter(hits)
            for (action, _), obs in zip(actions, observations, strict=True):
                if action != "search":
                    assert obs == ""
                    continue
                ours = loop.observe(None, None, [next(expected)])  # type: ignore[arg-type]
                assert obs == ours.prefix + ours.body + ours.suffix
    assert sum(1 for a, _ in turns[2] if a == "search") == 2559
