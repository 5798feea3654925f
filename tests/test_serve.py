"""The searcher HTTP API on a real (1-step) trained checkpoint: served context, answers, auth, errors, batching."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from sleuth.serve.searcher_server import bearer_token_ok, create_app
from sleuth.serve.service import SearcherService, SearcherSettings, SearchQuery, ServeLimits
from sleuth.serve.threaded import serve_in_thread

QUESTION = "Where was the director of the film born?"


@pytest.fixture(scope="module")
def checkpoint(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `sleuth train` run directory (s3 loop, tiny policy, one GRPO step, saved)."""
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    recipe = {
        "name": "serve-test",
        "seed": 0,
        "model": {"policy": "tiny"},
        "data": {"train": str(small_world / "train.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "s3",
            "max_turns": 2,
            "top_k": 3,
            "max_new_tokens_per_turn": 12,
            "max_response_tokens": 96,
            "max_obs_tokens": 64,
        },
        "reward": {"name": "search_r1_em"},
        "algorithm": {
            "name": "grpo",
            "n": 2,
            "prompts_per_step": 2,
            "minibatch_size": 4,
            "micro_batch_size": 4,
        },
        "optim": {"lr": 1e-2},
        "trainer": {"total_steps": 1, "save_every": 1, "out_dir": str(out)},
    }
    train(recipe_from_dict(recipe))
    return out


@pytest.fixture(scope="module")
def service(checkpoint: Path, small_world: Path) -> Iterator[SearcherService]:
    from sleuth.serve.loading import ServiceSpec, build_service

    svc = build_service(
        ServiceSpec(
            checkpoint=checkpoint,
            index=small_world / "bm25",
            generator="tiny",
            limits=ServeLimits(batch_wait_ms=5, max_question_chars=300, max_turns=4, max_top_k=6),
        )
    )
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def url(service: SearcherService) -> Iterator[str]:
    with serve_in_thread(create_app(service)) as base:
        yield base


class SwitchableRetriever:
    """A real retriever that can be made to fail or stall on demand."""

    def __init__(self, inner):
        self.inner = inner
        self.fail = False
        self.delay_s = 0.0

    def search(self, queries: list[str], k: int):
        if self.fail:
            raise OSError("index volume unavailable")
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inner.search(queries, k)


class BrokenGenerator:
    def __init__(self, inner):
        self.tokenizer = inner.tokenizer

    def generate(self, batch, stop=None, params=None):
        raise RuntimeError("CUDA out of memory")


def _sibling(service: SearcherService, retriever=None, answer_generator=None, **settings) -> SearcherService:
    """Another service over the same loaded policy (no model reload); `settings` replace SearcherSettings fields."""
    base = SearcherSettings(
        limits=service.limits,
        max_new_tokens_per_turn=service.params.max_new_tokens,
        max_obs_tokens=service.max_obs_tokens,
        max_response_tokens=service.max_response_tokens,
    )
    return SearcherService(
        service.generator.inner,
        service.loop,
        retriever or service.retriever.inner,
        answer_generator,
        replace(base, **settings),
    )


def test_checkpoint_loop_and_limits(service: SearcherService, url: str) -> None:
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["loop"] == "s3"
    assert health["loop_defaults"] == {"max_turns": 2, "top_k": 3}  # from the checkpoint's searcher.json
    assert "step 1" in health["model"] and health["generator"] == "tiny"
    assert (
        service.max_obs_tokens == 64
        and service.max_response_tokens == 96
        and service.params.temperature == 0.0
    )


def test_search_serves_the_searchers_context(service: SearcherService, url: str) -> None:
    r = httpx.post(f"{url}/search", json={"question": QUESTION}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    traj = body["trajectory"]
    # s3 begins with a search for the question itself: its window is the index's own top-3
    direct = service.retriever.inner.search([QUESTION], 3)[0]
    assert traj["queries"][0] == QUESTION
    assert [d["id"] for d in traj["documents"][0]] == [h.doc_id for h in direct]
    assert body["retrieval_count"] == len(traj["queries"]) == len(traj["documents"]) >= 1
    # the served context comes from what was retrieved, with no repeats, and is formatted for an LLM
    retrieved = {d["id"]: d for docs in traj["documents"] for d in docs}
    ids = [d["id"] for d in body["context"]]
    assert ids and len(ids) == len(set(ids)) and all(d == retrieved[d["id"]] for d in body["context"])
    lines = body["context_text"].split("\n")
    assert lines[0] == f'Doc 1(Title: "{body["context"][0]["title"]}") {body["context"][0]["text"]}'
    assert len(lines) == len(ids)
    t = body["timings"]
    assert 0 <= t["queue_s"] <= t["total_s"] and 0 < t["search_s"] <= t["total_s"]
    # greedy decoding: the same request gives the same context
    again = httpx.post(f"{url}/search", json={"question": QUESTION}, timeout=60).json()
    assert again["context"] == body["context"] and again["trajectory"]["queries"] == traj["queries"]


def test_overrides_apply_per_request(service: SearcherService, url: str) -> None:
    body = httpx.post(
        f"{url}/search", json={"question": QUESTION, "top_k": 2, "max_turns": 1}, timeout=60
    ).json()
    direct = service.retriever.inner.search([QUESTION], 2)[0]
    assert [d["id"] for d in body["trajectory"]["documents"][0]] == [h.doc_id for h in direct]
    assert all(len(docs) <= 2 for docs in body["trajectory"]["documents"])
    assert body["trajectory"]["num_turns"] <= 2  # one action round, plus s3's forced final generation


def test_answer_is_the_generators_answer_from_the_context(service: SearcherService, url: str) -> None:
    from sleuth.rewards.answerer import answer_from_documents

    r = httpx.post(f"{url}/answer", json={"question": QUESTION, "top_k": 2}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    docs = [
        {"doc_id": d["id"], "title": d["title"], "text": d["text"], "score": 0.0} for d in body["context"]
    ]
    expected = answer_from_documents(
        service.answer_generator.inner, [QUESTION], [docs], "s3", service.answer_params
    )
    assert body["answer"] == expected[0]
    assert body["timings"]["answer_s"] > 0


def test_answer_without_generator_is_400(service: SearcherService) -> None:
    svc = _sibling(service)
    with serve_in_thread(create_app(svc)) as base:
        r = httpx.post(f"{base}/answer", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 400 and "--generator" in r.json()["detail"]
        assert httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60).status_code == 200


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({"question": ""}, "question", "empty"),
        ({"question": "   "}, "question", "empty"),
        ({"question": "x" * 301}, "question", "at most 300"),
        ({"question": 42}, "question", "string"),
        ({"question": "q", "max_turns": "2"}, "max_turns", "integer"),
        ({"question": "q", "max_turns": 0}, "max_turns", "between 1 and 4"),
        ({"question": "q", "max_turns": 5}, "max_turns", "between 1 and 4"),
        ({"question": "q", "top_k": 7}, "top_k", "between 1 and 6"),
        ({"question": "q", "top_k": True}, "top_k", "integer"),
        ({"question": "q", "topk": 3}, "topk", "Extra inputs"),
        ({"max_turns": 1}, "question", "required"),
    ],
)
def test_invalid_requests_get_422_naming_the_field(url: str, body: dict, field: str, needle: str) -> None:
    r = httpx.post(f"{url}/search", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and needle in r.json()["detail"]


def test_non_json_body_is_422(url: str) -> None:
    r = httpx.post(f"{url}/search", content=b"question=hi", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "invalid request" in r.json()["detail"]


def test_bearer_auth(service: SearcherService) -> None:
    assert bearer_token_ok("Bearer s3cret", "s3cret") and bearer_token_ok("bearer s3cret", "s3cret")
    assert not bearer_token_ok("Bearer s3cre", "s3cret") and not bearer_token_ok("s3cret", "s3cret")
    assert not bearer_token_ok(None, "s3cret") and not bearer_token_ok("Basic s3cret", "s3cret")
    named = _sibling(service, retriever_name=service.retriever_name, model_name=service.model_name)
    with serve_in_thread(create_app(named, token="s3cret")) as base:
        open_health = httpx.get(f"{base}/health")
        assert open_health.json()["auth"] is True  # health stays open
        # ... but shows no paths (model checkpoint, index, generator) to a caller without the token
        for private in ("model", "retriever", "generator"):
            assert private not in open_health.json()
        assert str(service.retriever_name) not in open_health.text and "/" not in open_health.json()["name"]
        full = httpx.get(f"{base}/health", headers={"Authorization": "Bearer s3cret"}).json()
        assert full["retriever"] == service.retriever_name and "step 1" in full["model"]
        body = {"question": QUESTION, "max_turns": 1}
        missing = httpx.post(f"{base}/search", json=body, timeout=60)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        wrong = httpx.post(f"{base}/search", json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
        assert wrong.status_code == 401
        ok = httpx.post(f"{base}/search", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["context"]


def test_request_body_over_the_limit_is_413(service: SearcherService) -> None:
    with serve_in_thread(create_app(_sibling(service), max_body_bytes=4096)) as base:
        big = httpx.post(f"{base}/search", json={"question": "x" * 10_000}, timeout=30)
        assert big.status_code == 413 and "4096 bytes" in big.json()["detail"]
        ok = httpx.post(f"{base}/search", json={"question": QUESTION, "max_turns": 1}, timeout=60)
        assert ok.status_code == 200


def test_retriever_failure_is_503_and_the_server_recovers(service: SearcherService) -> None:
    flaky = SwitchableRetriever(service.retriever.inner)
    svc = _sibling(service, retriever=flaky)
    with serve_in_thread(create_app(svc)) as base:
        flaky.fail = True
        r = httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 503 and "retriever failed" in r.json()["detail"]
        assert "index volume unavailable" in r.json()["detail"]
        flaky.fail = False
        r = httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 200 and r.json()["context"]
        stats = httpx.get(f"{base}/health").json()["stats"]
        assert stats["failures"] == 1 and stats["completed"] == 1


def test_generator_failures_are_503(service: SearcherService) -> None:
    broken_answers = _sibling(service, answer_generator=BrokenGenerator(service.answer_generator.inner))
    with serve_in_thread(create_app(broken_answers)) as base:
        r = httpx.post(f"{base}/answer", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 503 and "answer generator failed" in r.json()["detail"]
        assert "CUDA out of memory" in r.json()["detail"]
        assert httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60).status_code == 200
    broken_policy = SearcherService(
        BrokenGenerator(service.generator.inner), service.loop, service.retriever.inner
    )
    with serve_in_thread(create_app(broken_policy)) as base:
        r = httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 503 and "searcher model failed" in r.json()["detail"]


def test_timeout_is_504_and_the_server_recovers(service: SearcherService) -> None:
    slow = SwitchableRetriever(service.retriever.inner)
    svc = _sibling(service, retriever=slow, limits=replace(service.limits, timeout_s=0.3))
    with serve_in_thread(create_app(svc)) as base:
        slow.delay_s = 1.0
        r = httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 504 and "within 0.3 s" in r.json()["detail"]
        slow.delay_s = 0.0
        svc.limits = replace(svc.limits, timeout_s=60)
        r = httpx.post(f"{base}/search", json={"question": QUESTION}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(f"{base}/health").json()["stats"]["timeouts"] == 1


def test_concurrent_requests_share_rollouts(service: SearcherService) -> None:
    svc = _sibling(service, limits=replace(service.limits, batch_wait_ms=300))
    questions = [f"Who founded company number {i}?" for i in range(6)]
    start = threading.Barrier(len(questions))

    def call(q: str) -> httpx.Response:
        start.wait()
        return httpx.post(f"{base}/search", json={"question": q, "max_turns": 1}, timeout=60)

    with serve_in_thread(create_app(svc)) as base, ThreadPoolExecutor(len(questions)) as pool:
        responses = list(pool.map(call, questions))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    stats = svc.snapshot_stats()
    assert stats["rollouts"] < len(questions)
    assert max(r.json()["batch_size"] for r in responses) > 1
    # every answer belongs to its own request: question and first search window match
    for q, r in zip(questions, responses, strict=True):
        body = r.json()
        assert body["question"] == q
        assert [d["id"] for d in body["trajectory"]["documents"][0]] == [
            h.doc_id for h in service.retriever.inner.search([q], 3)[0]
        ]


def test_lone_client_is_never_held_for_company(service: SearcherService) -> None:
    """One client sending one request at a time finds the model idle each time: with no recent overlap
    no request waits batch_wait_ms (counted, not timed; a hold would cost 5 s each)."""
    svc = _sibling(service, limits=replace(service.limits, batch_wait_ms=5000))
    with serve_in_thread(create_app(svc)) as base:
        for i in range(3):
            r = httpx.post(
                f"{base}/search",
                json={"question": f"Who founded company number {i}?", "max_turns": 1},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["batch_size"] == 1
    stats = svc.snapshot_stats()
    assert stats["held_batches"] == 0 and stats["batches"] == 3


def test_batch_is_split_by_loop_config(service: SearcherService) -> None:
    svc = _sibling(service)
    queries = [
        SearchQuery("Who directed the film?", 1, 2),
        SearchQuery("Where is the company based?", 1, 2),
        SearchQuery("When was the author born?", 1, 3),
    ]
    outcomes = svc.run_batch(queries)
    stats = svc.snapshot_stats()
    assert stats["rollouts"] == 2  # (1, 2) and (1, 3)
    # s3 with max_turns=1: one action round + the forced final generation, per rollout
    assert stats["generate_calls"] <= 2 * 2
    assert [o.body["batch_size"] for o in outcomes] == [2, 2, 1]
    assert [len(o.body["trajectory"]["documents"][0]) for o in outcomes] == [2, 2, 3]


def test_cli_rejects_bad_options_and_warns_on_public_host(
    monkeypatch, checkpoint: Path, small_world: Path
) -> None:
    import uvicorn
    from typer.testing import CliRunner

    from sleuth.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["serve-searcher", "--index", str(small_world / "bm25")])
    assert res.exit_code == 2 and "--checkpoint" in res.output
    res = runner.invoke(app, ["serve-searcher", "--model", "tiny", "--index", str(small_world / "nope")])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = runner.invoke(
        app,
        [
            "serve-searcher",
            "--checkpoint",
            str(checkpoint),
            "--index",
            str(small_world / "bm25"),
            "--max-batch",
            "0",
        ],
    )
    assert res.exit_code == 2 and "max_batch" in res.output

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    monkeypatch.setenv("MY_TOKEN", "tok")
    res = runner.invoke(
        app,
        [
            "serve-searcher",
            "--checkpoint",
            str(checkpoint),
            "--index",
            str(small_world / "bm25"),
            "--host",
            "0.0.0.0",
            "--port",
            "8123",
            "--token-env",
            "MY_TOKEN",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "WARNING" in res.output and "bearer token required" in res.output
    served, kw = runs[0]
    assert kw["host"] == "0.0.0.0" and kw["port"] == 8123
    from fastapi.testclient import TestClient

    with TestClient(served) as client:
        assert client.post("/search", json={"question": "q"}).status_code == 401
        assert client.get("/health").status_code == 200


# -- what each loop serves, with scripted policies (exact, model-free) ---------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sleuth.llm.registry import tiny_model_dir

    return AutoTokenizer.from_pretrained(tiny_model_dir())


def _scripted_service(tokenizer, small_world: Path, loop: str, turns: list[str], answer_text: str = "Paris"):
    from sleuth.agent import get_loop
    from sleuth.llm.scripted import ScriptedGenerator
    from sleuth.retrieval import load_retriever

    policy = ScriptedGenerator(tokenizer, {QUESTION: turns})
    answerer = ScriptedGenerator(tokenizer, lambda call: answer_text)
    retriever = load_retriever(small_world / "bm25")
    svc = SearcherService(
        policy,
        get_loop(loop),
        retriever,
        answer_generator=answerer,
        settings=SearcherSettings(max_new_tokens_per_turn=64, max_obs_tokens=256, max_response_tokens=1024),
    )
    return svc, answerer, retriever


def test_s3_serves_exactly_the_selected_documents(tokenizer, small_world: Path) -> None:
    svc, answerer, retriever = _scripted_service(
        tokenizer,
        small_world,
        "s3",
        ["<important_info>[2, 4]</important_info>\n<search_complete>True</search_complete>"],
    )
    window = retriever.search([QUESTION], 8)[0]
    body = asyncio.run(svc.search(svc.validate(QUESTION, want_answer=True)))
    assert [d["id"] for d in body["context"]] == [window[1].doc_id, window[3].doc_id]
    assert body["answer"] == "Paris" and body["trajectory"]["answer"] is None  # s3 never answers itself
    prompt = tokenizer.decode(answerer.calls[0][0])
    assert "Contexts:\nDoc 1 (Title: " + window[1].title + ")\n" in prompt and window[0].text not in prompt


def test_r_search_serves_its_evidence_and_answers_from_it(tokenizer, small_world: Path) -> None:
    svc, answerer, retriever = _scripted_service(
        tokenizer,
        small_world,
        "r_search",
        [
            "I should look it up. <search>physician born in</search>",
            "<original_evidence>The founder was born in Kvythsaxholm.</original_evidence>\n<answer>Kvythsaxholm</answer>",
        ],
    )
    body = asyncio.run(svc.search(svc.validate(QUESTION, want_answer=True)))
    docs = retriever.search(["physician born in"], 3)[0]
    assert len(docs) == 3
    assert body["context"][0]["title"] == "evidence"
    assert body["context"][0]["text"] == "The founder was born in Kvythsaxholm."
    assert [d["id"] for d in body["context"][1:]] == [h.doc_id for h in docs]
    assert body["trajectory"]["answer"] == "Kvythsaxholm" and body["trajectory"]["queries"] == [
        "physician born in"
    ]
    # RSTool: the frozen model answers from the evidence alone (R-Search's evidence prompt)
    prompt = tokenizer.decode(answerer.calls[0][0])
    assert "The following are given passages:\nThe founder was born in Kvythsaxholm." in prompt
    assert docs[0].text not in prompt and body["answer"] == "Paris"


def test_qagent_serves_its_deduplicated_passages(tokenizer, small_world: Path) -> None:
    svc, _, retriever = _scripted_service(
        tokenizer,
        small_world,
        "qagent",
        [
            "<plan>find both</plan><search><query>film director</query><query>film director</query>"
            "<query>company founder</query></search>",
            "<reflection>ok</reflection><answer>x</answer>",
        ],
    )
    body = asyncio.run(svc.search(svc.validate(QUESTION)))
    top1 = [retriever.search([q], 1)[0][0].doc_id for q in ("film director", "company founder")]
    assert [d["id"] for d in body["context"]] == list(dict.fromkeys(top1))
    assert body["retrieval_count"] == 3 and body["trajectory"]["answer"] == "x"
