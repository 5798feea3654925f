"""bench/retrieval_scale.py (issue 24): the BM25 stages end to end at a tiny size, the report, and the
memory sampler against a known allocation. (The dense stages and bench/retrieval_21m.sh were run end to
end by hand at 20,000 passages; encoding on a CPU makes them too slow for the suite.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent / "bench"
SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(BENCH))

import retrieval_scale  # noqa: E402  (bench/ is not a package)


def test_peak_memory_sees_an_allocation() -> None:
    with retrieval_scale.PeakMemory() as mem:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        block.sum()
    now = retrieval_scale.tree_memory(os.getpid())
    del block
    assert mem.peak["anon"] >= 60 * 2**20
    assert mem.peak["rss"] >= mem.peak["anon"] and now["rss"] > 0


def test_bm25_stages_and_report_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    common = ["--work", str(tmp_path / "w"), "--size", "3000", "--world-passages", "300", "--questions", "60",
              "--workers", "2", "--shard-docs", "1000", "--batch-requests", "2", "--batch-clients", "2",
              "--latency-seconds", "1", "--recall-questions", "20"]
    for stage in ("synth", "bm25-build", "bm25-serve"):
        subprocess.run([sys.executable, str(BENCH / "retrieval_scale.py"), stage, *common], env=env, check=True,
                       capture_output=True, text=True, timeout=300)
    out = subprocess.run([sys.executable, str(BENCH / "retrieval_scale.py"), "report", *common, "--out",
                          str(tmp_path / "r.json")], env=env, check=True, capture_output=True, text=True)
    assert "BM25 serve" in out.stdout and "cold start" in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["missing_stages"] == ["encode", "ivfpq-build", "dense-serve"]
    assert result["machine"]["cpus"] == os.cpu_count()
    synth, build, serve = (result["stages"][s] for s in ("synth", "bm25-build", "bm25-serve"))
    assert synth["passages"] == 3000 and synth["corpus_bytes"] > 3000 * 300
    assert build["passages"] == 3000 and build["index_bytes"] > 0 and build["peak_anon_bytes"] > 0
    assert build["peak_rss_bytes"] >= build["peak_anon_bytes"]
    assert serve["cold_start_seconds"] > 0 and serve["qps_batch256_one_client"] > 0
    assert serve["latency_p99_ms"] >= serve["latency_p50_ms"] > 0
    assert serve["gold_recall_at_5_single_hop"] > 0.5 and serve["recall_questions"] > 0
    for record in (synth, build, serve):
        assert record["command"] and record["date"] and len(record["load_average_before"]) == 3
