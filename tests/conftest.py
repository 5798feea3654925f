"""Fixtures shared by several test modules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# The slowest test modules, slowest first (their tests' seconds summed from `make test`'s durations on the
# 2-core box, 2026-11-29): they run before all others. pytest-xdist's loadfile hands out whole modules in
# collection order, by default reordered by test count, which puts these few-test, slow modules last, where
# one of them could run alone on one worker while the other idled. Longest first, the run ends on
# short modules and both workers finish together. Refresh the list from a run's durations when it drifts.
SLOWEST_MODULES_FIRST = (
    "test_reproduce.py",
    "test_decode_engine.py",
    "test_bench_retrieval_scale.py",
    "test_claim_bundle.py",
    "test_claim_checkpoints.py",
    "test_coldstart.py",
    "test_learning_plugins.py",
    "test_from_committed.py",
    "test_export_serving.py",
    "test_rl_distributed.py",
    "test_retrieval_prefork.py",
    "test_llm_hf.py",
    "test_demo.py",
    "test_export.py",
    "test_rl_interrupts.py",
    "test_retrieval_bulk_encode.py",
    "test_robustness.py",
    "test_rl_trainer.py",
    "test_retrieval_fast_tokenize.py",
    "test_llm_registry.py",
    "test_bench_smoke.py",
    "test_knowledge.py",
    "test_bm25_build.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # keep the module order set below (xdist would sort modules by their number of tests)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest modules first, the rest in collection order (a stable sort: each module's tests keep
    their order and stay together)."""
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def small_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-passage synthetic world (60 questions, 1-2 hops, seed 0) with its BM25 index; read-only."""
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    out = tmp_path_factory.mktemp("world")
    write_world(generate_world(300, 60, hops=(1, 2), seed=0), out)
    build_index(out / "corpus.jsonl", "bm25", out / "bm25")
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny test model's tokenizer (built once a worker)."""
    from transformers import AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def one_layer_minilm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded MiniLM cut to its first transformer layer, saved as a sentence-transformers model dir
    (built once a worker, in its own temporary folder; nothing shared). Same tokenizer, pooling,
    normalisation and 384-dim vectors at about a third of the encoding time: for tests of what the
    encoding pipeline does with vectors (files, indexes, servers), not of MiniLM's retrieval quality."""
    from sentence_transformers import SentenceTransformer

    from sleuth.retrieval.encoders import resolve_encoder_path

    model = SentenceTransformer(resolve_encoder_path("minilm"), device="cpu")
    bert = model[0].auto_model
    bert.encoder.layer = bert.encoder.layer[:1]
    bert.config.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("minilm-one-layer") / "model"
    model.save(str(out))
    return str(out)


def _once_a_session(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], dict]
) -> tuple[Path, dict]:
    """`make(folder)` run once a test session, shared by the xdist workers: the first to ask runs it under a lock
    in the session's common temporary folder (pytest-N/, above each worker's popen-gwK/), the others wait for it.
    Returns (folder, the record `make` returned), the record written atomically once `make` is done."""
    import fcntl  # Linux, as the suite (pre-fork workers, /proc)

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    folder, record = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            tmp = record.with_suffix(".tmp")
            tmp.write_text(json.dumps(make(folder)))
            tmp.replace(record)
    return folder, json.loads(record.read_text())


@pytest.fixture(scope="session")
def qagent_cpu_claim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`sleuth reproduce qagent --profile cpu`, run once a test session (`_once_a_session`; three modules compare
    against it, about 25 s a run on 2 cores): its report.html. Read only."""
    from sleuth.claims.runner import reproduce

    folder, _ = _once_a_session(
        tmp_path_factory,
        "qagent-cpu-claim",
        lambda folder: {"report": str(reproduce("qagent", folder / "qagent", "cpu"))},
    )
    return folder / "qagent" / "report.html"


@pytest.fixture(scope="session")
def r_search_cpu_claim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`sleuth reproduce r_search --profile cpu --out DIR/r_search` through the CLI, run once a test session
    (`_once_a_session`; test_reproduce reruns it, test_claim_bundle compares a split run with it): DIR/r_search.
    Only a rerun that skips every stage may write there (its writes are atomic and the same)."""
    from typer.testing import CliRunner

    from sleuth.cli import app

    def run(folder: Path) -> dict:
        argv = ["reproduce", "r_search", "--profile", "cpu", "--out", str(folder / "r_search")]
        result = CliRunner().invoke(app, argv, terminal_width=300)
        assert result.exit_code == 0, result.output
        return {"exit_code": result.exit_code}

    folder, _ = _once_a_session(tmp_path_factory, "r-search-cpu-claim", run)
    return folder / "r_search"


@pytest.fixture(scope="session")
def fast_demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """`sleuth demo --fast --out DIR` run once a test session (`_once_a_session`): (DIR, {"returncode", "stdout",
    "stderr"} of that run). Read only: tests assert on its files."""

    def demo(folder: Path) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "sleuth.cli", "demo", "--fast", "--out", str(folder / "demo")],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    folder, record = _once_a_session(tmp_path_factory, "fast-demo", demo)
    return folder / "demo", record
