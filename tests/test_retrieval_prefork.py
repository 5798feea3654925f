"""Pre-fork workers for `sleuth serve-retriever --workers N` (sleuth.retrieval.prefork): the supervisor
loads once and forks; workers share the loaded index copy-on-write, are replaced when they die, and
stop with the supervisor. Linux only (fork, /proc, PR_SET_PDEATHSIG)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from serve_helpers import free_port, wait_for_health
from sleuth.retrieval import build_index
from sleuth.retrieval.docstore_build import build_docstore_index
from sleuth.retrieval.encoders import Encoder, EncoderConfig
from sleuth.retrieval.prefork import EXIT_STARTUP_FAILED, Supervisor, prefork_available
from sleuth.retrieval.server_commands import WORKER_PID_HEADER

pytestmark = pytest.mark.skipif(not prefork_available(), reason="pre-fork workers are Linux-only")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class MiniLMShape(Encoder):
    """Records MiniLM in the manifest (the server loads the real one to encode queries) without loading
    it here: the indexes below are built from precomputed (random) embeddings."""

    def __init__(self) -> None:
        self.config = EncoderConfig(name="minilm")
        self.dim = 384


def _random_dense_index(work: Path, n: int, **faiss: object) -> Path:
    """A dense index of `n` passages over random unit vectors, through sleuth's own builders."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(f'{{"id":"d{i}","contents":"passage {i}"}}\n' for i in range(n))
    build_docstore_index(work / "c.jsonl", work / "ds", workers=2)
    block = np.random.default_rng(0).standard_normal((8192, 384), dtype=np.float32)
    block = (block / np.linalg.norm(block, axis=1, keepdims=True)).astype(np.float16)
    emb = np.memmap(work / "emb.f16", dtype=np.float16, mode="w+", shape=(n, 384))
    for start in range(0, n, len(block)):  # repeated rows: the index's size, not its content, matters here
        emb[start : start + len(block)] = block[: n - start]
    emb.flush()
    del emb
    # threads=1: faiss's PQ training with 2 OpenMP threads on a shared 2-core box can take 50x longer
    build_index(
        None,
        "dense",
        work / "idx",
        docstore_from=work / "ds",
        show_progress=False,
        threads=1,
        encoder=MiniLMShape(),
        embeddings=work / "emb.f16",
        **faiss,
    )
    return work / "idx"


def _start(index: Path, workers: int, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sleuth.cli",
        "serve-retriever",
        "--index",
        str(index),
        "--port",
        str(port),
        "--workers",
        str(workers),
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, url)
    return proc, url


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> tuple[str, str]:
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        raise


def _answering_pids(url: str, want: int, path: str = "/health", body: dict | None = None) -> set[str]:
    """Pids seen in `X-Sleuth-Worker-Pid` over fresh connections, several at once, until `want` of them."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> str:
        headers = {"Connection": "close"}
        r = (
            httpx.post(f"{url}{path}", json=body, timeout=30, headers=headers)
            if body is not None
            else httpx.get(f"{url}{path}", timeout=10, headers=headers)
        )
        r.raise_for_status()
        return r.headers[WORKER_PID_HEADER]

    pids: set[str] = set()
    with ThreadPoolExecutor(8) as pool:
        for _ in range(30):
            pids |= set(pool.map(one, range(12)))
            if len(pids) >= want:
                break
    return pids


def _children(pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(pid).children()}


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("prefork-bm25")
    with open(work / "c.jsonl", "w", encoding="utf-8") as f:
        for i in range(30):
            f.write(
                json.dumps({"id": f"d{i}", "contents": f"passage {i} about topic{i % 5} and word{i}"}) + "\n"
            )
    build_index(work / "c.jsonl", "bm25", work / "bm25", show_progress=False)
    return work / "bm25"


def test_workers_are_forked_replaced_when_killed_and_stopped_by_sigterm(bm25_index: Path) -> None:
    proc, url = _start(bm25_index, 3)
    try:
        workers = _children(proc.pid)
        assert len(workers) == 3
        pids = _answering_pids(url, 3)
        assert pids == {str(p) for p in workers}  # the supervisor itself serves nothing

        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        _wait_for(
            lambda: victim not in _children(proc.pid) and len(_children(proc.pid)) == 3,
            30,
            "the killed worker was not replaced within 30 s",
        )
        replacement = _children(proc.pid) - workers
        assert len(replacement) == 1
        _wait_for(
            lambda: str(next(iter(replacement))) in _answering_pids(url, 3),
            30,
            "the new worker does not answer",
        )
    finally:
        out, err = _stop(proc, signal.SIGTERM)
    assert proc.returncode == 0, err[-3000:]
    assert f"worker {victim} was killed by SIGKILL" in err
    for pid in workers | replacement:  # reaped, none left behind
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_workers_die_with_a_killed_supervisor(bm25_index: Path) -> None:
    proc, url = _start(bm25_index, 2)
    workers = _children(proc.pid)
    assert len(workers) == 2
    proc.kill()  # SIGKILL: no chance to forward anything; PR_SET_PDEATHSIG must end the workers
    proc.communicate(timeout=10)
    try:
        _wait_for(
            lambda: not any(psutil.pid_exists(p) for p in workers), 30, "workers outlived their supervisor"
        )
    finally:
        for pid in workers:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_no_preload_still_spawns_workers(bm25_index: Path) -> None:
    proc, url = _start(bm25_index, 2, "--no-preload")
    try:
        assert len(_answering_pids(url, 2)) == 2
    finally:
        _stop(proc, signal.SIGINT)
    assert proc.returncode == 0


def _fake_serve(app: object, sock: socket.socket) -> None:
    time.sleep(60)  # ended by the supervisor's SIGTERM (the worker's handler exits cleanly)


def test_supervisor_gives_up_when_no_worker_can_start() -> None:
    """A worker whose app cannot be built (its warm-up search failed) exits; before any worker was ever
    ready that is a startup failure: the supervisor stops the others and returns 2, like a load error."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    def broken_app() -> object:
        raise RuntimeError("warm-up search failed")

    logged: list[str] = []
    try:
        code = Supervisor(sock, 2, broken_app, serve=_fake_serve, log=logged.append).run()
    finally:
        sock.close()
    assert code == EXIT_STARTUP_FAILED
    assert any("could not start" in line for line in logged)


def test_supervisor_restarts_a_worker_that_exits_and_forwards_sigterm() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    marker = Path(f"/tmp/sleuth-prefork-test-{os.getpid()}")
    marker.unlink(missing_ok=True)

    def serve_then_exit_once(app: object, sock: socket.socket) -> None:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        if len(marker.read_text().split()) == 1:
            os._exit(7)  # the first worker dies unexpectedly
        time.sleep(60)

    logged: list[str] = []
    supervisor = Supervisor(sock, 1, lambda: object(), serve=serve_then_exit_once, log=logged.append)
    stopper = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    stopper.start()
    try:
        code = supervisor.run()
    finally:
        stopper.cancel()
        sock.close()
        started = marker.read_text().split() if marker.exists() else []
        marker.unlink(missing_ok=True)
    assert code == 0
    assert len(started) == 2 and any("exited with code 7" in line for line in logged), logged
    assert (
        not psutil.pid_exists(int(started[1]))
        or psutil.Process(int(started[1])).status() == psutil.STATUS_ZOMBIE
    )


FORK_AFTER_LOAD = r"""
import json, os, sys, time
from sleuth.retrieval import load_retriever

def threads():
    return len(os.listdir("/proc/self/task"))

retriever = load_retriever(sys.argv[1], threads=2)  # loads MiniLM and faiss; searches nothing
queries = [f"passage {i} about something else entirely" for i in range(40)]
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        import torch
        torch.set_num_threads(2)
        hits = retriever.search(queries, 3)
        out = {"ids": [[h.doc_id for h in q] for q in hits], "torch_threads": torch.get_num_threads(),
               "threads": threads()}
        os.write(write_end, json.dumps(out).encode())
        code = 0
    finally:
        os._exit(code)
os.close(write_end)
deadline = time.monotonic() + 60
while os.waitpid(pid, os.WNOHANG)[0] == 0:
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        print(json.dumps({"hung": True}))
        sys.exit(1)
    time.sleep(0.05)
child = json.loads(os.read(read_end, 1 << 20) or b"{}")
own = retriever.search(queries, 3)
print(json.dumps({"child": child, "parent_ids": [[h.doc_id for h in q] for q in own]}))
"""


def test_torch_and_faiss_work_in_a_child_forked_after_loading(tmp_path: Path) -> None:
    """The supervisor's situation: a process that loaded the real MiniLM and a faiss index (and searched
    nothing) forks; the child searches with 2 torch threads (its intra-op pool starts there) and gets
    what the parent gets. (A parent that had searched first would leave its OpenMP pool behind, and the
    child's first parallel region could hang: hence no warm-up before the fork.)"""
    index = _random_dense_index(tmp_path, 3000, faiss="flat")
    run = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_LOAD, str(index)],
        env={**ENV, "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    child = result["child"]
    assert child["torch_threads"] == 2 and child["threads"] > 1  # a pool started in the child
    assert child["ids"] == result["parent_ids"] and len(child["ids"]) == 40


def _kib(path: str, *keys: str) -> int:
    fields = {}
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            fields[key] = int(value.split()[0])
    return sum(fields[k] for k in keys)


def test_forked_workers_share_an_index_read_into_the_heap(tmp_path: Path) -> None:
    """faiss reads a fast-scan IVF-PQ index (4-bit codes) into each process's heap. Pre-forked workers
    share the supervisor's copy: after queries, each worker's private memory stays well below the
    index's size, and the index is among the dirty pages it shares. (Measured on the 2-core dev box:
    76 MiB index, 3 workers: 34-41 MiB private and ~460 MiB shared-dirty each; with `--no-preload`
    each spawned worker held 497-504 MiB private and shared nothing dirty; PSS 0.86 vs 1.88 GiB.)"""
    index = _random_dense_index(tmp_path, 768_000, faiss="ivfpq", nlist=16, m=192, nbits=4, nprobe=2)
    index_bytes = (index / "faiss.index").stat().st_size  # ~ what faiss holds in the heap: codes + ids
    assert index_bytes > 75 * 2**20
    proc, url = _start(index, 3, "--threads", "1")
    try:
        body = {"queries": [f"question {i} about passage {i}" for i in range(16)], "topk": 5}
        pids = _answering_pids(url, 3, "/retrieve", body)
        workers = _children(proc.pid)
        assert pids == {str(p) for p in workers} and len(workers) == 3
        rollup = {pid: f"/proc/{pid}/smaps_rollup" for pid in workers}
        private = {pid: _kib(path, "Private_Clean", "Private_Dirty") * 1024 for pid, path in rollup.items()}
        shared_dirty = {pid: _kib(path, "Shared_Dirty") * 1024 for pid, path in rollup.items()}
        supervisor_anon = _kib(f"/proc/{proc.pid}/status", "RssAnon") * 1024
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert supervisor_anon > index_bytes  # the supervisor holds the index (and torch, MiniLM) in its heap
    mib = 2**20
    for pid in workers:
        seen = (
            f"worker {pid}: {private[pid] / mib:.0f} MiB private, {shared_dirty[pid] / mib:.0f} MiB "
            f"shared dirty; index {index_bytes / mib:.0f} MiB"
        )
        # A worker holding its own copy would have the index (plus torch and MiniLM) private.
        assert private[pid] < 0.75 * index_bytes, seen
        assert shared_dirty[pid] > index_bytes, seen


def test_forked_workers_rerank_from_the_kept_vectors_like_one_process(tmp_path: Path) -> None:
    """A sharded IVF-PQ index with its float16 vectors kept, served by 2 forked workers that re-rank from the
    supervisor's open row file (`RowFile`, opened before the fork): the same passages and scores as the index
    searched in this process."""
    from sleuth.retrieval import load_retriever

    index = _random_dense_index(
        tmp_path, 8192, faiss="ivfpq", nlist=16, m=48, nbits=8, nprobe=4, shards=2, keep_vectors=True
    )
    queries = [f"question {i} about passage {i}" for i in range(24)]
    local = load_retriever(index, rerank=32).search(queries, 5)
    proc, url = _start(index, 2, "--threads", "1", "--rerank", "32")
    try:
        pids = _answering_pids(url, 2, "/retrieve", {"queries": queries[:2], "topk": 5})
        served = httpx.post(
            f"{url}/retrieve", json={"queries": queries, "topk": 5, "return_scores": True}, timeout=60
        ).json()["result"]
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert len(pids) == 2
    assert [[hit["document"]["id"] for hit in hits] for hits in served] == [
        [h.doc_id for h in hits] for hits in local
    ]
    np.testing.assert_allclose(
        [[hit["score"] for hit in hits] for hits in served],
        [[h.score for h in hits] for hits in local],
        atol=1e-5,
    )
