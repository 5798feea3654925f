"""`sleuth reproduce <claim> --from-committed` (issue 42 item 5), end to end on a CPU: a tiny-model claim run is
packed with its adapters by bench/claims_pack.py, then its decisive arms are evaluated again from the packed folder
alone; and the committed rows carry every field the claim's table is computed from (qagent's own answers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (loaded before the OpenMP test: a process that loaded torch first)
from safetensors import safe_open
from typer.testing import CliRunner

from bench_loading import load_bench
from sleuth.appendlog import read_appended
from sleuth.claims.committed import (
    ADAPTERS_DIR,
    COMMITTED_FILE,
    committed_table,
    newest_committed,
    pack_committed,
    passive_openmp_waits,
    response_digest,
)
from sleuth.claims.runner import reproduce
from sleuth.cli import app
from sleuth.errors import ConfigError


def _claims_pack():
    return load_bench("claims_pack")


def _predictions(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_appended(path).records}


@pytest.mark.slow
def test_from_committed_evaluates_the_packed_adapters_again_and_decodes_alike(tmp_path: Path) -> None:
    run, dest, out = tmp_path / "run", tmp_path / "committed", tmp_path / "check"
    reproduce("r_search", run, "cpu")
    pack = _claims_pack()
    pack.pack(run, dest, run / "world", None)
    committed = pack_committed(run, dest, 0, run / "world")
    # the decisive arms' final adapters only, in bfloat16; no base weights, no tokenizer (the base model's)
    assert set(committed["models"]) == {
        "train_with_evidence.checkpoint",
        "train_no_evidence_block.checkpoint",
    }
    for name in committed["models"].values():
        files = {
            p.relative_to(dest / ADAPTERS_DIR / name).as_posix()
            for p in (dest / ADAPTERS_DIR / name).rglob("*")
            if p.is_file()
        }
        assert files == {"searcher.json", "policy/adapter_config.json", "policy/adapter_model.safetensors"}
        with safe_open(str(dest / ADAPTERS_DIR / name / "policy" / "adapter_model.safetensors"), "pt") as f:
            assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}  # noqa: SIM118
    shutil.rmtree(run / "world")  # the check rebuilds it from the seed
    result = CliRunner().invoke(
        app, ["reproduce", "r_search", "--from-committed", str(dest), "--questions", "20", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "committed run, the same questions" in result.output and "check.html" in result.output
    check = json.loads((out / "check.json").read_text())
    report = json.loads((run / "report.json").read_text())
    (test,) = check["tests"]
    # the committed numbers on the same 20 questions, recomputed from the committed rows, are the report's own
    # computation on those questions; on every question they are the report's seed-0 row
    assert test["committed_same_questions"]["n"] == 20 and test["committed_seed"]["n"] == 30
    assert test["committed_seed"] == report["table"]["seeds"]["tests"][0]["per_seed"][0]
    assert check["committed_rows_reproduce_report"] is True
    assert (
        check["cpu_dtype"] == "float32"
    )  # a CPU run is checked in its own float32 (a GPU run: bf16 if native)
    # the same tiny model, the same greedy decode, the bf16 adapters: every response decoded as the run decoded it
    for name in ("with_evidence", "no_evidence_block"):
        here = _predictions(out / "eval" / name / "r-search" / "predictions.jsonl")
        there = _predictions(run / "eval" / name / "r-search" / "predictions.jsonl")
        assert len(here) == 20 and all(
            here[i]["trajectory"]["response_text"] == there[i]["trajectory"]["response_text"]
            and here[i]["prediction"] == there[i]["prediction"]
            for i in here
        )
        assert check["agreement"][f"eval_{name}"] == {
            "n": 20,
            "same_prediction": 20,
            "same_em": 20,
            "same_response": 20,
        }
    assert test["here"] == test["committed_same_questions"]
    # a rerun resumes the recorded evaluations; another number of questions in the same OUT is refused
    again = CliRunner().invoke(
        app, ["reproduce", "r_search", "--from-committed", str(dest), "--questions", "20", "--out", str(out)]
    )
    assert again.exit_code == 0 and "done earlier, skipped" in again.output
    other = CliRunner().invoke(
        app, ["reproduce", "r_search", "--from-committed", str(dest), "--questions", "5", "--out", str(out)]
    )
    assert other.exit_code == 2 and "holds the check of" in other.output
    # a changed world is named, not evaluated
    record = json.loads((dest / ADAPTERS_DIR / COMMITTED_FILE).read_text())
    record["world"]["files"]["test.jsonl"] = "0" * 64
    (dest / ADAPTERS_DIR / COMMITTED_FILE).write_text(json.dumps(record))
    changed = CliRunner().invoke(
        app, ["reproduce", "r_search", "--from-committed", str(dest), "--out", str(tmp_path / "changed")]
    )
    assert changed.exit_code == 2 and "test.jsonl differ from the committed run's" in changed.output


@pytest.mark.slow
def test_qagent_committed_rows_give_the_report_table_own_answers_included(
    tmp_path: Path, qagent_cpu_claim: Path
) -> None:
    """Item 2 (b): every row of qagent's table, the own-answer row (extra.agent_answer) included, recomputed from
    the committed per-question rows alone equals the report's."""
    run, dest = qagent_cpu_claim.parent, tmp_path / "committed"
    _claims_pack().pack(run, dest, run / "world", None)
    rows = [
        json.loads(line)
        for line in (dest / "stage1_trained_reader" / "per_question.jsonl").read_text().splitlines()
    ]
    stage1 = _predictions(run / "eval" / "stage1_trained_reader" / "qagent" / "predictions.jsonl")
    assert rows and all(r["agent_answer"] == stage1[r["id"]]["extra"]["agent_answer"] for r in rows)
    assert all(r["response_sha256"] == response_digest(stage1[r["id"]]) for r in rows)
    report = json.loads((run / "report.json").read_text())
    assert committed_table(dest)["rows"] == report["table"]["rows"]
    # the own-answer row reads the committed agent_answer: stage 1's own answers made right make its side 1.0
    for row in rows:
        row["agent_answer"] = row["golden_answers"][0]
    (dest / "stage1_trained_reader" / "per_question.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    own = next(name for name in report["table"]["rows"] if "its own answer" in name)
    changed = committed_table(dest)["rows"]
    assert changed[own]["b"] == 1.0 != report["table"]["rows"][own]["b"]
    assert {k: v for k, v in changed.items() if k != own} == {
        k: v for k, v in report["table"]["rows"].items() if k != own
    }


def test_the_newest_packed_gpu_run_is_the_default_and_none_is_a_clear_error(
    tmp_path: Path, monkeypatch
) -> None:
    root = tmp_path / "bench" / "results" / "claims"
    for name in ("r_search_old", "r_search_new", "r_search_plain", "s3_new"):
        (root / name).mkdir(parents=True)
        (root / name / "claim.json").write_text(
            json.dumps(
                {"method": name.split("_")[0] if name.startswith("s3") else "r_search", "profile": "gpu"}
            )
        )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"no committed gpu run of r_search holds adapters .*committed runs of "
        r"r_search: r_search_new, r_search_old, r_search_plain",
    ):
        newest_committed("r_search")
    result = CliRunner().invoke(app, ["reproduce", "r_search", "--from-committed", "--questions", "5"])
    assert result.exit_code == 2 and "no committed gpu run of r_search holds adapters" in result.output
    for name, when, profile in (
        ("r_search_old", "2026-11-27T00:00:00Z", "gpu"),
        ("r_search_new", "2026-11-28T00:00:00Z", "gpu"),
        ("s3_new", "2026-11-29T00:00:00Z", "gpu"),
    ):
        (root / name / ADAPTERS_DIR).mkdir()
        (root / name / ADAPTERS_DIR / COMMITTED_FILE).write_text(
            json.dumps({"profile": profile, "packed_at": when})
        )
    assert newest_committed("r_search", Path("bench/results/claims")).name == "r_search_new"


@pytest.mark.slow
def test_a_lora_reader_export_is_packed_as_its_adapter_and_reads_alike(tmp_path: Path) -> None:
    """The gpu profiles' readers are LoRA checkpoints exported merged (the full model): what is committed is the
    checkpoint's bf16 adapter, and the model rebuilt from it on the base answers as the export does."""
    from sleuth.claims.committed import materialize, pack_model
    from sleuth.claims.profiles import PLAIN_PROFILES
    from sleuth.claims.reader import ReaderSettings, train_reader
    from sleuth.claims.steps import build_world
    from sleuth.data.formats import read_qa_jsonl
    from sleuth.eval.baselines import BaselineSettings, gold_passages, read_documents
    from sleuth.eval.harness import resolve_generator, resolve_retriever

    run = tmp_path / "run"
    build_world(run / "world", PLAIN_PROFILES["cpu"])
    export = train_reader(
        run / "world",
        run / "reader",
        ReaderSettings(model="tiny", distractors=1, epochs=1, lr=3e-3, batch_size=8, questions=8),
    )
    packed = pack_model(export, tmp_path / "packed", run, str(run.resolve()))
    assert packed["lora"] and packed["base_model"] == "tiny"
    assert {p.name for p in (tmp_path / "packed" / "policy").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    rebuilt = materialize(tmp_path / "packed", tmp_path / "rebuilt")
    questions = read_qa_jsonl(run / "world" / "test.jsonl")[:6]
    docs = gold_passages(resolve_retriever(run / "world" / "bm25"), questions)
    texts = [
        read_documents(
            resolve_generator(str(model)), questions, docs, BaselineSettings(answer_max_new_tokens=16), "s3"
        )[1]
        for model in (export, rebuilt)
    ]
    assert texts[0] == texts[1] and any(texts[0])


def test_the_check_lets_openmp_idle_threads_sleep_where_torch_is_not_loaded_yet() -> None:
    """`passive_openmp_waits` (called first by `check_committed`) sets OMP_WAIT_POLICY=PASSIVE before torch loads,
    keeps a policy the caller chose, and does nothing once torch is loaded (OpenMP read its settings then)."""
    code = (
        "import os, sys; from sleuth.claims.committed import passive_openmp_waits as p; "
        "print(p(), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert fresh.stdout.split() == ["True", "PASSIVE", "False"]
    chosen = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert chosen.stdout.split() == ["True", "ACTIVE", "False"]
    assert "torch" in sys.modules  # this process loaded it (the module imports it): too late to change

    before = os.environ.get("OMP_WAIT_POLICY")
    assert passive_openmp_waits() is False and os.environ.get("OMP_WAIT_POLICY") == before
