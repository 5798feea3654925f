"""`retriever.cache: DIR` / `--retriever-cache DIR`: every search is recorded once and replayed
deterministically (the retriever is not called again), with hit/miss counts, in eval and training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sleuth.retrieval.base import Hit

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))


class DriftingRetriever:
    """A web search stand-in: every call answers differently and is counted (each one would be billed)."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def search(self, queries, k):
        self.calls.append(list(queries))
        n = len(self.calls)
        return [
            [Hit(f"{q}-{n}-{i}", f"T{i}", f"{q} result {i} of call {n}", 1.0 / (i + 1)) for i in range(k)]
            for q in queries
        ]


def test_record_once_then_replay_without_calling_the_retriever(tmp_path: Path) -> None:
    from sleuth.retrieval.cache import CachingRetriever, cache_stats

    inner = DriftingRetriever()
    cached = CachingRetriever(inner, tmp_path / "cache", "web:test")
    first = cached.search(["alpha", "beta", "alpha"], 2)
    assert inner.calls == [["alpha", "beta"]]  # a repeated query is searched once
    assert first[0] == first[2] and first[0][0].doc_id == "alpha-1-0"
    assert cache_stats(cached) == {"retriever/cache_hits": 0.0, "retriever/cache_misses": 3.0}

    again = CachingRetriever(DriftingRetriever(), tmp_path / "cache", "web:test")  # a later run
    assert again.search(["beta", "alpha"], 2) == [first[1], first[0]]
    assert again.inner.calls == [] and cache_stats(again)["retriever/cache_hits"] == 2.0
    # another k, or another retriever in the same directory, is not a hit
    assert again.search(["alpha"], 3)[0][0].doc_id == "alpha-1-0" and again.inner.calls == [["alpha"]]
    other = CachingRetriever(DriftingRetriever(), tmp_path / "cache", "web:other")
    other.search(["alpha"], 2)
    assert other.inner.calls == [["alpha"]]
    assert cache_stats(inner) == {}  # a retriever without a cache reports nothing


def test_a_damaged_entry_or_a_file_as_directory_is_a_clear_error(tmp_path: Path) -> None:
    from sleuth.errors import ConfigError
    from sleuth.retrieval.cache import CachingRetriever

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file; pass a directory"):
        CachingRetriever(DriftingRetriever(), tmp_path / "file", "s")
    cached = CachingRetriever(DriftingRetriever(), tmp_path / "c", "s")
    cached.search(["q"], 1)
    (entry,) = (tmp_path / "c").rglob("*.json")
    entry.write_text("{")
    with pytest.raises(ConfigError, match="unreadable.*delete it"):
        cached.search(["q"], 1)


def test_eval_replays_the_recorded_searches(small_world: Path, tmp_path: Path, monkeypatch) -> None:
    import sleuth.retrieval.index as index_module
    from sleuth.cli import app

    cache = tmp_path / "cache"
    args = [
        "eval",
        "-m",
        "naive-rag",
        "--data",
        str(small_world / "test.jsonl"),
        "--retriever",
        str(small_world / "bm25"),
        "--model",
        "tiny",
        "--limit",
        "3",
        "--answer-max-new-tokens",
        "2",
        "--retriever-cache",
        str(cache),
    ]
    first = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")], env={"COLUMNS": "200"})
    assert first.exit_code == 0, first.output
    assert "0 searches replayed, 3 searched and recorded" in first.output
    # the second run must not search at all: the index's search is made to fail
    real_load = index_module.load_retriever

    def load_failing(*a, **kw):
        retriever = real_load(*a, **kw)
        retriever.search = lambda *_: (_ for _ in ()).throw(AssertionError("searched despite the cache"))
        return retriever

    monkeypatch.setattr("sleuth.retrieval.backends.load_retriever", load_failing)
    second = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b")], env={"COLUMNS": "200"})
    assert second.exit_code == 0, second.output
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert (
        summary["retriever_cache"]["retriever/cache_hits"] == 3
        and summary["retriever_cache"]["retriever/cache_misses"] == 0
    )

    def contexts(out: Path) -> list:
        return [
            json.loads(line)["trajectory"]
            for line in (out / "naive-rag" / "predictions.jsonl").read_text().splitlines()
        ]

    assert contexts(tmp_path / "a") == contexts(tmp_path / "b")


def test_training_records_then_replays_and_logs_the_counts(small_world: Path, tmp_path: Path) -> None:
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train
    from test_rl_trainer import _recipe

    algorithm = {"name": "grpo", "n": 2, "prompts_per_step": 2, "minibatch_size": 4, "micro_batch_size": 4}
    metrics = []
    for run in ("a", "b"):
        data = _recipe(small_world, tmp_path / run, algorithm, steps=1)
        data["retriever"]["cache"] = str(tmp_path / "cache")
        data["agent"]["loop"] = "s3"  # s3 begins with a search for the question: every rollout searches
        train(recipe_from_dict(data))
        (line,) = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        metrics.append(json.loads(line))
    searched = metrics[0]["retriever/cache_misses"]
    assert searched > 0 and metrics[0]["retriever/cache_hits"] + searched > 0
    # same seed, same model: the second run asks the same queries and every one is replayed
    assert metrics[1]["retriever/cache_misses"] == 0
    assert metrics[1]["retriever/cache_hits"] == metrics[0]["retriever/cache_hits"] + searched
