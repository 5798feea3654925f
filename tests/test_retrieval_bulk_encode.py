"""Encoding a docstore over several processes (issue 24: 21M passages within a GPU lease), on CPU:
the file equals the one-process file bit for bit, a killed worker's run resumes, bad device lists fail."""

from __future__ import annotations

import os
import signal
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sleuth.data.formats import Passage
from sleuth.errors import ConfigError
from sleuth.retrieval.bulk_encode import (
    EncodePlan,
    encode_docstore_parallel,
    parse_devices,
    plan_ranges,
    worker_devices,
)
from sleuth.retrieval.docstore import DocStore
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.index import encode_docstore, open_embeddings

DIM = 16


def _store(tmp_path: Path, n: int, seed: int = 0) -> DocStore:
    rng = np.random.default_rng(seed)
    words = ["river", "castle", "born", "works", "for", "the", "of", "city", "north", "old", "guild", "a"]
    passages = [
        Passage(
            id=f"p{i}", title=f"Title {i}", text=" ".join(rng.choice(words, size=int(rng.integers(3, 40))))
        )
        for i in range(n)
    ]
    return DocStore.build(passages, tmp_path / "docstore")


class _HashEncoder:
    """Deterministic bag of words (crc32-seeded unit vectors per token), no model: fast in a worker."""

    def __init__(self) -> None:
        self.config = EncoderConfig(name="test-hash", batch_size=8)
        self.dim = DIM

    def encode_passages(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), DIM), np.float32)
        for i, text in enumerate(texts):
            for tok in text.split():
                out[i] += np.random.default_rng(zlib.crc32(tok.encode())).standard_normal(DIM)
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


@dataclass
class KillingFactory:
    """Builds a _HashEncoder that logs each chunk it encodes to `log` (one file per process) and, while
    `trap` exists, SIGKILLs its own process when asked for the chunk starting at `kill_at`."""

    log_dir: str
    trap: str
    kill_at: int

    def __call__(self, device: str) -> _HashEncoder:
        factory = self

        class Logged(_HashEncoder):
            def encode_passages(self, texts: list[str]) -> np.ndarray:
                first = int(texts[0].split('"')[1].split()[1])  # '"Title 17"\n...' -> 17
                if first == factory.kill_at and Path(factory.trap).exists():
                    os.kill(os.getpid(), signal.SIGKILL)
                with open(Path(factory.log_dir) / f"{os.getpid()}.log", "a") as f:
                    f.write(f"{first}\n")
                return super().encode_passages(texts)

        return Logged()


def _logged_chunks(log_dir: Path) -> list[int]:
    return sorted(int(x) for p in log_dir.glob("*.log") for x in p.read_text().split())


def test_parse_devices() -> None:
    assert parse_devices("all", visible_gpus=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert parse_devices("cuda:1, cuda:0", visible_gpus=2) == ["cuda:1", "cuda:0"]
    assert parse_devices("cuda", visible_gpus=1) == ["cuda:0"]
    assert parse_devices("cpu,cpu", visible_gpus=0) == ["cpu", "cpu"]
    assert parse_devices(["cpu"], visible_gpus=0) == ["cpu"]
    with pytest.raises(ConfigError, match="no GPU is visible"):
        parse_devices("all", visible_gpus=0)
    with pytest.raises(ConfigError, match=r"cuda:2 is not visible \(2 GPU\(s\): cuda:0..cuda:1\)"):
        parse_devices("cuda:0,cuda:2", visible_gpus=2)
    with pytest.raises(ConfigError, match="'gpu0' is not a device"):
        parse_devices("gpu0", visible_gpus=2)
    with pytest.raises(ConfigError, match="cuda:0 is listed twice"):
        parse_devices("cuda,cuda:0", visible_gpus=2)
    with pytest.raises(ConfigError, match="--devices is empty"):
        parse_devices(" , ", visible_gpus=2)


def test_worker_processes_per_device() -> None:
    """Each GPU gets the cores divided between the GPUs (tokenizing needs them), each cpu entry one."""
    assert worker_devices(["cuda:0", "cuda:1"], cores=16) == ["cuda:0"] * 8 + ["cuda:1"] * 8
    assert worker_devices(["cuda:0"], cores=16, procs_per_gpu=3) == ["cuda:0"] * 3
    assert worker_devices(["cuda:0", "cuda:1", "cuda:2"], cores=2) == ["cuda:0", "cuda:1", "cuda:2"]
    assert worker_devices(["cpu", "cpu"], cores=16) == ["cpu", "cpu"]


def test_plan_ranges_cover_every_row_in_whole_chunks() -> None:
    assert plan_ranges(10, 3, 2) == [(0, 6), (6, 10)]
    assert plan_ranges(12, 3, 2) == [(0, 6), (6, 12)]
    assert plan_ranges(0, 3, 2) == []
    # Default: about 128 ranges of whole chunks, whatever the worker count (21M in 16,384-row chunks: 11 each).
    ranges = plan_ranges(21_000_000, 16384)
    assert len(ranges) == 117 and ranges[0] == (0, 180224) and ranges[-1][1] == 21_000_000
    assert plan_ranges(600, 16384) == [(0, 600)]


def test_bad_device_list_fails_before_any_file_is_written(tmp_path: Path) -> None:
    store = _store(tmp_path, 10)
    with pytest.raises(ConfigError, match="not a device"):
        encode_docstore_parallel(
            store, tmp_path / "e.f16", KillingFactory(str(tmp_path), "none", -1), "tpu:0"
        )
    assert list(tmp_path.glob("e.f16*")) == []


def test_two_processes_write_the_file_one_process_writes(tmp_path: Path, one_layer_minilm: str) -> None:
    """Real MiniLM (cut to its first layer, for time) on CPU. Chunks and length-sorted batches do not
    depend on the worker count, so the two-process file is bit-identical to the one-process file; against
    sentence-transformers' own encode (index.encode_docstore: its batches are formed over the whole chunk
    in another order, so padding differs) it agrees to fp16 rounding."""
    store = _store(tmp_path, 150)
    config = EncoderConfig(name=one_layer_minilm, batch_size=16)
    one = encode_docstore_parallel(
        store, tmp_path / "one.f16", config, "cpu", EncodePlan(chunk=32, range_chunks=1, cores=1)
    )
    two = encode_docstore_parallel(
        store, tmp_path / "two.f16", config, "cpu,cpu", EncodePlan(chunk=32, range_chunks=1, cores=2)
    )
    assert one["rows"] == two["rows"] == 150 and one["ranges"] == 5 and two["devices"] == ["cpu", "cpu"]
    assert two["workers"] == 2 and two["encoded_rows"] == 150 and two["passages_per_second"] > 0
    a, b = (open_embeddings(tmp_path / f, 150, 384) for f in ("one.f16", "two.f16"))
    assert np.array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.linalg.norm(np.asarray(a, np.float32), axis=1), 1.0, atol=2e-3)
    encode_docstore(store, tmp_path / "st.f16", Encoder(config), chunk=32)
    reference = np.asarray(open_embeddings(tmp_path / "st.f16", 150, 384), np.float32)
    np.testing.assert_allclose(np.asarray(a, np.float32), reference, atol=2e-3)
    assert not (tmp_path / "two.f16.parts").exists() and not (tmp_path / "two.f16.tmp").exists()


def test_a_killed_worker_leaves_no_file_and_a_rerun_resumes(tmp_path: Path) -> None:
    store = _store(tmp_path, 100)
    logs = tmp_path / "logs"
    logs.mkdir()
    trap = tmp_path / "trap"
    trap.touch()
    factory = KillingFactory(str(logs), str(trap), kill_at=60)  # dies in range 3 (rows 60..79)
    out = tmp_path / "emb.f16"
    with pytest.raises(
        RuntimeError, match=r"worker \d \(cpu\) exited with code -9.*run the same command again"
    ):
        encode_docstore_parallel(
            store, out, factory, "cpu,cpu", EncodePlan(chunk=10, range_chunks=2, cores=2)
        )
    assert not out.exists() and (tmp_path / "emb.f16.tmp").exists()
    first_run = _logged_chunks(logs)
    assert 60 not in first_run and 70 not in first_run  # range (60, 80) never finished
    done = sorted((tmp_path / "emb.f16.parts").glob("range-*.done"))
    assert 0 < len(done) < 5
    for f in logs.glob("*.log"):
        f.unlink()
    trap.unlink()
    result = encode_docstore_parallel(
        store, out, factory, "cpu,cpu", EncodePlan(chunk=10, range_chunks=2, cores=2)
    )
    assert result["resumed_ranges"] == len(done) and result["encoded_rows"] == 100 - 20 * len(done)
    # The rerun encodes only the ranges without a marker.
    done_starts = {int(p.name[6:12]) * 20 for p in done}
    assert _logged_chunks(logs) == sorted(
        s for r in range(5) if r * 20 not in done_starts for s in (r * 20, r * 20 + 10)
    )
    reference = tmp_path / "ref.f16"
    encode_docstore_parallel(
        store, reference, KillingFactory(str(logs), "none", -1), "cpu", EncodePlan(chunk=10, cores=1)
    )
    assert np.array_equal(np.fromfile(out, np.float16), np.fromfile(reference, np.float16))
    assert not (tmp_path / "emb.f16.parts").exists()


def test_a_changed_plan_starts_over(tmp_path: Path) -> None:
    """A leftover partial run with another chunk size is not resumed (its ranges would not line up)."""
    store = _store(tmp_path, 40)
    logs = tmp_path / "logs"
    logs.mkdir()
    trap = tmp_path / "trap"
    trap.touch()
    out = tmp_path / "emb.f16"
    with pytest.raises(RuntimeError):
        encode_docstore_parallel(
            store,
            out,
            KillingFactory(str(logs), str(trap), 20),
            "cpu",
            EncodePlan(chunk=10, range_chunks=1, cores=1),
        )
    trap.unlink()
    result = encode_docstore_parallel(
        store, out, KillingFactory(str(logs), "none", -1), "cpu", EncodePlan(chunk=8, range_chunks=1, cores=1)
    )
    assert result["resumed_ranges"] == 0 and open_embeddings(out, 40, DIM).shape == (40, DIM)


def test_an_empty_docstore_gives_an_empty_file(tmp_path: Path) -> None:
    store = DocStore.build([], tmp_path / "docstore")
    result = encode_docstore_parallel(
        store, tmp_path / "e.f16", KillingFactory(str(tmp_path), "none", -1), "cpu"
    )
    assert result["rows"] == 0 and (tmp_path / "e.f16").stat().st_size == 0


def test_cli_encode_then_ivfpq_from_the_bm25_docstore(tmp_path: Path) -> None:
    """`sleuth encode` (two CPU workers) writes the file `sleuth index --embeddings --docstore-from` reads,
    with no corpus file given; bad device lists and missing docstores fail with one clear line."""
    from typer.testing import CliRunner

    from sleuth.cli import app

    rng = np.random.default_rng(1)
    words = ["river", "castle", "guild", "north", "salt", "harbour", "tower", "mill", "bridge", "forest"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(
            f'{{"id": "d{i}", "contents": "\\"T{i}\\"\\n{" ".join(rng.choice(words, 12))}"}}\n'
            for i in range(300)
        )
    )
    runner = CliRunner()
    assert (
        runner.invoke(
            app, ["index", str(corpus), "--kind", "bm25", "--out", str(tmp_path / "bm25")]
        ).exit_code
        == 0
    )
    res = runner.invoke(
        app,
        [
            "encode",
            str(tmp_path / "bm25"),
            "--out",
            str(tmp_path / "e.f16"),
            "--devices",
            "cpu,cpu",
            "--batch-size",
            "32",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "300 x 384 float16 on cpu,cpu (2 processes)" in " ".join(res.output.split())
    res = runner.invoke(
        app,
        [
            "index",
            "--kind",
            "dense",
            "--faiss",
            "ivfpq",
            "--nlist",
            "16",
            "--pq-m",
            "48",
            "--nprobe",
            "16",
            "--shards",
            "2",
            "--keep-vectors",
            "--embeddings",
            str(tmp_path / "e.f16"),
            "--docstore-from",
            str(tmp_path / "bm25"),
            "--out",
            str(tmp_path / "ivf"),
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["search", str(tmp_path / "ivf"), "river castle guild", "-k", "3"])
    assert res.exit_code == 0 and "d" in res.output, res.output
    bad = runner.invoke(
        app, ["encode", str(tmp_path / "bm25"), "--out", str(tmp_path / "x.f16"), "--devices", "gpu"]
    )
    assert bad.exit_code == 2 and "'gpu' is not a device" in " ".join(bad.output.split())
    nowhere = runner.invoke(app, ["encode", str(tmp_path / "none"), "--out", str(tmp_path / "x.f16")])
    assert nowhere.exit_code == 2 and "has no docstore/" in " ".join(nowhere.output.split())
    neither = runner.invoke(app, ["index", "--kind", "dense", "--out", str(tmp_path / "z")])
    assert neither.exit_code == 2 and "--docstore-from" in " ".join(neither.output.split())


class _RecordingModel:
    """Stands in for a SentenceTransformer: 'tokenizes' a passage to its row number (read from its
    title) and 'encodes' row r to a unit vector [cos r, sin r, 0...]; records which thread tokenized."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.threads: list[str] = []

    def preprocess(self, texts: list[str]) -> dict:
        import threading

        import torch

        self.threads.append(threading.current_thread().name)
        rows = [int(t.split('"')[1].split()[1]) if t.startswith('"') else -1 for t in texts]
        return {"rows": torch.tensor(rows, dtype=torch.float32)}

    def forward(self, features: dict) -> dict:
        return self(features)

    def __call__(self, features: dict) -> dict:
        import torch

        r = features["rows"]
        vecs = torch.zeros(len(r), DIM)
        vecs[:, 0], vecs[:, 1] = torch.cos(r), torch.sin(r)
        return {"sentence_embedding": vecs}


def test_pipelined_readers_put_every_row_in_its_place_after_a_warm_up_call(tmp_path: Path) -> None:
    """Two reader threads tokenize alternate chunks: every row lands at its own offset. The first
    tokenizer call happens on the main thread before the readers start (HF tokenizers write their
    settings on the first call, which fails while another thread encodes)."""
    from sleuth.retrieval.bulk_encode import _encode_range_pipelined

    store = _store(tmp_path, 45)
    encoder = _HashEncoder()
    encoder.config = EncoderConfig(name="recording", batch_size=4)
    encoder.model = _RecordingModel()
    out = np.zeros((45, DIM), np.float16)
    _encode_range_pipelined(encoder, store, out, 5, 45, chunk=8)
    rows = np.arange(45)
    expected = np.zeros((45, DIM), np.float16)
    expected[5:, 0], expected[5:, 1] = np.cos(rows[5:]), np.sin(rows[5:])
    np.testing.assert_array_equal(out, expected)
    threads = encoder.model.threads
    assert threads[0] == "MainThread" and {"encode-reader-0", "encode-reader-1"} == set(threads[1:])
