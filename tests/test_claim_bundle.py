"""Claim bundles (issue 25): stage records that move with their run directory, each claim's stage plan, a
bundle cut into parts and joined back byte for byte, and a claim cut short mid-RL, packed, carried through
the call limits, restored under another directory and resumed, ending with an uncut run's claim table."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import threading
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from bench_loading import load_bench
from sleuth.claims.runner import RunPart, claim_arms, reproduce, stage_plan
from sleuth.claims.stages import (
    STOP_AFTER_ENV,
    StagesStopped,
    finished_stages,
    reroot,
    stage,
)
from sleuth.cli import app
from sleuth.errors import ConfigError

claim_bundle = load_bench("claim_bundle")  # lease tooling lives in bench/, outside the package
MIB, BundleError, CallLimits, PartWriter = (
    claim_bundle.MIB,
    claim_bundle.BundleError,
    claim_bundle.CallLimits,
    claim_bundle.PartWriter,
)
carry_plan, join_parts, pack, restore, send, take = (
    claim_bundle.carry_plan,
    claim_bundle.join_parts,
    claim_bundle.pack,
    claim_bundle.restore,
    claim_bundle.send,
    claim_bundle.take,
)
# a lender's call limits, as bench/gpu_claims.sh passes them: 8 files of under 16 MiB, 64 MiB back and in
LIMITS = CallLimits(out_files=8, out_bytes=64 * MIB, carry_bytes=64 * MIB)
PART_BYTES = 15 * MIB


def test_reroot_moves_only_paths_under_the_old_root():
    value = {"a": "/old/x", "b": ["/old", "/older/y", 3, None], "c": {"d": "/else/old/z", "e": "/old/"}}
    assert reroot(value, "/old", "/new") == {
        "a": "/new/x",
        "b": ["/new", "/older/y", 3, None],
        "c": {"d": "/else/old/z", "e": "/new/"},
    }


def test_a_stage_record_follows_its_directory(tmp_path):
    first = tmp_path / "first"
    calls = []
    assert stage(first, "s", lambda: calls.append(1) or {"ckpt": str(first / "ck"), "n": 1}) == {
        "ckpt": str(first / "ck"),
        "n": 1,
    }
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(first, moved)
    assert stage(moved, "s", lambda: calls.append(1) or {}) == {"ckpt": str(moved / "ck"), "n": 1}
    assert calls == [1]


def test_stop_after_stops_at_a_stage_boundary(tmp_path, monkeypatch):
    monkeypatch.setenv(STOP_AFTER_ENV, "1")
    assert stage(tmp_path, "a", lambda: {"x": 1}) == {"x": 1}
    with pytest.raises(StagesStopped, match="stopped before stage b: 1 stages are done"):
        stage(tmp_path, "b", lambda: {"x": 2})
    assert stage(tmp_path, "a", lambda: {"x": 3}) == {"x": 1}  # a finished stage still reads back
    monkeypatch.setenv(STOP_AFTER_ENV, "two")
    with pytest.raises(ConfigError, match="SLEUTH_REPRODUCE_STOP_AFTER='two'"):
        stage(tmp_path, "b", lambda: {"x": 2})


def test_stage_plans_list_the_stages_the_runners_write():
    """The same stage names (in the order they run) as the CPU runs write (tests/test_reproduce.py)."""
    assert list(stage_plan("staged", "cpu")) == [
        "world",
        "inject",
        "labels",
        "premise",
        "train_staged",
        "eval_staged",
        "train_search_r1",
        "eval_search_r1",
    ]
    assert stage_plan("staged", "cpu")["labels"] == ("inject.checkpoint",)
    assert sorted(stage_plan("r_search", "cpu")) == [
        "eval_no_evidence_block",
        "eval_with_evidence",
        "eval_without_evidence",
        "premise",
        "reader",
        "sft_no_evidence_block",
        "sft_r_search",
        "train_no_evidence_block",
        "train_with_evidence",
        "train_without_evidence",
        "world",
    ]
    assert stage_plan("r_search", "gpu")["train_with_evidence"] == (
        "sft_r_search.sft_checkpoint",
        "reader.reader",
    )
    assert stage_plan("r_search", "gpu")["train_no_evidence_block"] == (
        "sft_no_evidence_block.sft_checkpoint",
        "reader.reader",
    )
    qagent = stage_plan("qagent", "cpu")
    assert sorted(qagent) == [
        "eval_stage1_base_reader",
        "eval_stage1_other_reader",
        "eval_stage1_trained_reader",
        "eval_stage2_base_reader",
        "eval_stage2_other_reader",
        "eval_stage2_trained_reader",
        "other_reader",
        "premise",
        "reader",
        "sft_qagent",
        "train_stage1",
        "train_stage2",
        "world",
    ]
    assert qagent["eval_stage1_other_reader"] == ("train_stage1.checkpoint", "other_reader.reader")
    assert qagent["train_stage2"] == ("train_stage1.run/checkpoints/step_000001", "reader.reader")
    s3 = stage_plan("s3", "gpu")
    assert len(s3) == 4 + 2 + 4 * 2 * 2 + 3 and s3["train_s3_1600"] == (
        "sft_s3.sft_checkpoint",
        "reader.reader",
        "rag_baseline.cache",
    )
    assert s3["eval_search_r1_25"] == ("train_search_r1_25.checkpoint",)
    assert len(stage_plan("s3", "cpu")) == 4 + 2 + 2 * 2 * 2 + 3
    # the two arms that locate a gap: s3 without selection, search_r1's documents read by the trained reader
    assert s3["eval_search_r1_docs_read_1600"] == ("train_search_r1_1600.checkpoint", "reader.reader")
    assert s3["train_s3_noselect_25"] == ("sft_s3.sft_checkpoint", "reader.reader", "rag_baseline.cache")
    # later seeds: every per-seed stage again, loading its own seed's checkpoints and the shared reader
    seeded = stage_plan("s3", "gpu", range(0, 3))
    assert len(seeded) == 4 + 3 * (2 + 4 * 2 * 2 + 3) and seeded["train_s3_25.seed2"] == (
        "sft_s3.seed2.sft_checkpoint",
        "reader.reader",
        "rag_baseline.cache",
    )


def test_parts_join_back_byte_identical(tmp_path):
    data = os.urandom(300_001)
    writer = PartWriter(tmp_path, "bundle.", 64 * 1024)
    for start in range(0, len(data), 10_007):  # writes that straddle part boundaries
        writer.write(data[start : start + 10_007])
    parts = writer.close()
    assert [p["bytes"] for p in parts] == [65536] * 4 + [300_001 - 4 * 65536]
    assert writer.whole.hexdigest() == hashlib.sha256(data).hexdigest()
    joined = io.BytesIO()
    assert join_parts(tmp_path, parts, joined) == hashlib.sha256(data).hexdigest()
    assert joined.getvalue() == data
    damaged = bytearray((tmp_path / "bundle.002").read_bytes())
    damaged[5] ^= 1
    (tmp_path / "bundle.002").write_bytes(bytes(damaged))
    with pytest.raises(
        BundleError, match="bundle.002: 65536 bytes, sha256 .*damaged, or from another bundle"
    ):
        join_parts(tmp_path, parts, io.BytesIO())
    (tmp_path / "bundle.004").unlink()
    with pytest.raises(BundleError, match="part bundle.004 of the bundle is missing"):
        join_parts(tmp_path, parts[4:], io.BytesIO())


def test_carry_plan_fills_the_calls_beside_their_own_paths(tmp_path):
    """Calls 1-3 of bench/gpu_claims.sh carry the wheels (32 MB) and the GGUF halves (47 MB each): two, one and
    one 15 MiB parts fit beside them, the rest go four to a call."""
    for name, size in (
        (".whl/a.whl", 28_000_000),
        (".models/m", 5_200_000),
        (".gpu/p1/x", 47_000_000),
        (".gpu/p2/y", 47_000_000),
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(bytes(size))
    index = {"parts": [{"name": f"bundle.{i:03d}", "bytes": 15 * MIB} for i in range(9)]}
    beside = [
        [str(tmp_path / ".whl"), str(tmp_path / ".models")],
        [str(tmp_path / ".gpu/p1")],
        [str(tmp_path / ".gpu/p2")],
    ]
    plan = [[p.rsplit("/", 1)[-1] for p in call] for call in carry_plan(index, ".claims", beside, LIMITS)]
    assert plan == [
        [".whl", ".models", "bundle.json", "bundle.000", "bundle.001"],
        ["p1", "bundle.002"],
        ["p2", "bundle.003"],
        ["bundle.004", "bundle.005", "bundle.006", "bundle.007"],
        ["bundle.008"],
    ]
    # the working tree (8 MB) travels with every call: one part beside the wheels, none beside a GGUF half (47 MB +
    # 8 MB leave 11 MB), three in a call of parts alone
    plan = [
        [p.rsplit("/", 1)[-1] for p in call]
        for call in carry_plan(index, ".claims", beside, LIMITS, tree=8_000_000)
    ]
    assert plan == [
        [".whl", ".models", "bundle.json", "bundle.000"],
        ["p1"],
        ["p2"],
        ["bundle.001", "bundle.002", "bundle.003"],
        ["bundle.004", "bundle.005", "bundle.006"],
        ["bundle.007", "bundle.008"],
    ]


def _records(path):
    """A jsonl file's records without their timings."""
    return [{k: v for k, v in json.loads(line).items() if k != "latency_s"} for line in path.open()]


def _carry(bundle, dev_claims, outs):
    """What bench/gpu_claims.sh does across calls: send into each call's fresh $OUT (limits counted), then
    `take` on the development machine, until the carried folder holds every part."""
    for k in range(10):
        out = outs / f"call{k}"
        out.mkdir(parents=True)
        (out / "claims.tgz").write_bytes(b"reports")  # pack's other file shares the call's limits
        sent = send(bundle, out, LIMITS)
        assert len(list(out.iterdir())) <= LIMITS.out_files
        state = take(out, dev_claims)
        if not state["missing"]:
            return k + 1
        assert sent
    raise AssertionError("the bundle never came back whole")


@pytest.mark.slow
def test_a_claim_cut_short_resumes_from_its_bundle_elsewhere(tmp_path, monkeypatch, qagent_cpu_claim):
    """qagent on the CPU profile (about 60 s on 2 cores): an uncut run; a run cut in the middle of stage 1's
    RL, packed into 64 KiB parts, carried in several calls, restored under another directory (the first one
    gone) and resumed: the same claim table, rollouts and answers, the finished stages skipped, stage 1's RL
    resumed at step 1."""
    uncut = qagent_cpu_claim  # the uncut run, shared with other modules
    lease1 = tmp_path / "lease1" / "claims"
    monkeypatch.setenv(STOP_AFTER_ENV, "6")
    with pytest.raises(StagesStopped, match="before stage train_stage2"):
        reproduce("qagent", lease1 / "qagent", "cpu")
    monkeypatch.delenv(STOP_AFTER_ENV)
    # the lease ends after stage 1's first RL step: its record and its step-2 checkpoint were never written
    run1 = lease1 / "qagent" / "stage1" / "train"
    (lease1 / "qagent" / "stages" / "train_stage1.json").unlink()
    shutil.rmtree(run1 / "checkpoints" / "step_000002")
    (run1 / "checkpoints" / "latest").write_text("step_000001\n")

    index = pack(lease1, tmp_path / "bundle", part_bytes=64 * 1024)
    info = index["claims"]["qagent"]
    assert info["done"] == ["other_reader", "premise", "reader", "sft_qagent", "world"]
    assert info["pending"][0] == "train_stage1"
    assert info["checkpoints"] == {
        "qagent/train/sft/checkpoints/step_000006": "without optimizer state",
        "reader/sft/checkpoints/step_000030": "without optimizer state",
        "other_reader/sft/checkpoints/step_000030": "without optimizer state",
        "stage1/train/checkpoints/step_000001": "whole",
    }
    assert sorted(e["dir"] for e in info["rebuild"]) == ["other_reader/reader", "reader/reader", "world"]
    assert len(index["parts"]) > 1 and all(p["bytes"] <= 64 * 1024 for p in index["parts"])
    with tarfile.open(
        fileobj=io.BytesIO(b"".join((tmp_path / "bundle" / p["name"]).read_bytes() for p in index["parts"]))
    ) as tar:
        names = tar.getnames()
    assert "qagent/stage1/train/checkpoints/step_000001/state.pt" in names
    assert "qagent/qagent/train/sft/checkpoints/step_000006/policy/adapter_model.safetensors" in names
    # the claim's world is rebuilt from its seed; the other reader's world (another seed) travels as files
    assert any(n.startswith("qagent/other_reader/world/") for n in names)
    assert not any(
        n.endswith("step_000006/state.pt")
        or n.startswith("qagent/world/")
        or n.startswith("qagent/reader/reader/")
        or "/rollouts/" in n
        or n.endswith("reader_sft.jsonl")
        for n in names
    )

    dev = tmp_path / "dev" / ".claims"
    assert _carry(tmp_path / "bundle", dev, tmp_path / "outs") >= 2
    shutil.rmtree(tmp_path / "lease1")  # nothing may still point there
    lease2 = tmp_path / "lease2" / "runs" / "claims"
    assert restore(dev, lease2, tmp_path / "done")["claims"]["qagent"] == {
        "stages": 5,
        "complete": False,
        "warnings": [],
    }
    assert restore(dev, lease2)["status"] == "restored earlier" and not (tmp_path / "done").exists()
    buf = io.StringIO()
    resumed = reproduce("qagent", lease2 / "qagent", "cpu", Console(file=buf, width=300))
    output = buf.getvalue()
    assert output.count("done earlier, skipped") == 5 and "(step 1)" in output, output
    assert (
        json.loads(resumed.with_suffix(".json").read_text())["table"]
        == json.loads(uncut.with_suffix(".json").read_text())["table"]
    )
    # the tiny model's tables are all zeros: hold what they come from to the uncut run too, the step-2 rollouts
    # of the resumed RL (sampling RNG, data cursor, weights) and every evaluation's answers
    compared = [
        "stage1/train/rollouts/step_000002.jsonl",
        "stage2/train/rollouts/step_000001.jsonl",
        *(p.relative_to(uncut.parent).as_posix() for p in uncut.parent.glob("eval/*/*/predictions.jsonl")),
    ]
    assert len(compared) == 8
    for rel in compared:
        assert _records(lease2 / "qagent" / rel) == _records(uncut.parent / rel), rel
    records = "".join(p.read_text() for p in (lease2 / "qagent" / "stages").iterdir())
    assert str(tmp_path / "lease1") not in records and str(lease2 / "qagent") in records

    # a finished claim: records and evaluations only, and its done-marker on restore
    again = pack(lease2, tmp_path / "bundle2", PART_BYTES)
    assert again["claims"]["qagent"]["checkpoints"] == {} and again["claims"]["qagent"]["pending"] == []
    restored = restore(tmp_path / "bundle2", tmp_path / "lease3", tmp_path / "done")
    assert restored["claims"]["qagent"]["complete"] and (tmp_path / "done" / "qagent").exists()
    assert (
        json.loads((tmp_path / "lease3" / "qagent" / "report.json").read_text())["table"]
        == json.loads(resumed.with_suffix(".json").read_text())["table"]
    )


def test_a_run_that_reused_a_reader_checkpoint_packs_into_a_bundle(tmp_path, monkeypatch, r_search_cpu_claim):
    """`--reuse DIR` with DIR/reader a checkpoint (bench/gpu_claims.sh reuses checkpoints/claims): the export is made
    from a copy under the run, so a bundle carries the adapters and rebuilds the export (on 2026-11-29 the export
    pointed at the copy outside the run and the bundle of every claim that reused it was refused)."""
    from sleuth.claims.reuse import write_world_record

    trained = json.loads((r_search_cpu_claim / "reader" / "reader.json").read_text())["checkpoint"]
    models = tmp_path / "models"
    shutil.copytree(trained, models / "reader")
    write_world_record(models / "reader", r_search_cpu_claim / "world")
    monkeypatch.setenv(STOP_AFTER_ENV, "2")
    with pytest.raises(StagesStopped):
        reproduce("r_search", tmp_path / "lease" / "r_search", "cpu", reuse=models)
    index = pack(tmp_path / "lease", tmp_path / "bundle", PART_BYTES)
    info = index["claims"]["r_search"]
    assert info["done"] == ["reader", "world"]
    assert info["checkpoints"] == {"reader/reused": "without optimizer state"}
    assert sorted(e["dir"] for e in info["rebuild"]) == ["reader/reader", "world"]


def test_a_stage_two_runs_reach_together_runs_once(tmp_path):
    """Runs sharing OUT (`--arms`): the second to reach a stage waits for the first's record instead of running
    it again."""
    calls, started = [], threading.Event()

    def slow() -> dict:
        started.set()
        time.sleep(0.5)
        calls.append("first")
        return {"by": "first"}

    first = threading.Thread(target=lambda: stage(tmp_path, "world", slow))
    first.start()
    started.wait(5)
    second = stage(tmp_path, "world", lambda: calls.append("second") or {"by": "second"})
    first.join()
    assert second == {"by": "first"} and calls == ["first"]
    assert finished_stages(tmp_path) == ["world"]  # the lock lives beside the records


def test_arms_are_checked_and_the_report_waits_for_every_arm(tmp_path):
    with pytest.raises(ConfigError, match=r"--arms s3_7: the s3 claim's arms are s3_2, search_r1_2, s3_4"):
        reproduce("s3", tmp_path, "cpu", part=RunPart(["s3_7"]))
    with pytest.raises(ConfigError, match="qagent claim's arms run one after another"):
        reproduce("qagent", tmp_path, "cpu", part=RunPart(["stage1"]))
    assert claim_arms("r_search", "gpu") == ("with_evidence", "without_evidence", "no_evidence_block")
    assert claim_arms("s3", "gpu")[-3:] == ("s3_1600", "search_r1_1600", "s3_noselect_25")


@pytest.mark.slow
def test_arms_split_over_two_runs_give_the_report_of_one_run(tmp_path, r_search_cpu_claim):
    """r_search's arms in two runs sharing OUT (as on two GPUs): the first stops once its arm is done, the
    second (the other two arms) writes the report; the claim table equals one run's with every arm (the
    session's whole run, `r_search_cpu_claim`)."""
    whole, split = r_search_cpu_claim, tmp_path / "split"
    first = CliRunner().invoke(
        app,
        ["reproduce", "r_search", "--profile", "cpu", "--out", str(split), "--arms", "with_evidence"],
        terminal_width=300,
    )
    assert first.exit_code == 0, first.output  # its arm is done: a success, though the report must wait
    assert (
        "arms done: with_evidence. stages left to other runs: sft_no_evidence_block, train_without_evidence, "
        "eval_without_evidence, train_no_evidence_block, eval_no_evidence_block;" in first.output
    )
    assert (
        not (split / "stages" / "train_without_evidence.json").exists()
        and not (split / "report.json").exists()
    )
    assert not (
        split / "stages" / "sft_no_evidence_block.json"
    ).exists()  # that arm's own cold start waits too
    reproduce("r_search", split, "cpu", part=RunPart(["without_evidence", "no_evidence_block"]))
    tables = [json.loads((d / "report.json").read_text())["table"] for d in (whole, split)]
    assert tables[0]["rows"] == tables[1]["rows"] and tables[0]["holds"] == tables[1]["holds"]


def test_gpu_claims_pack_returns_results_and_first_seed_adapters(tmp_path, r_search_cpu_claim):
    """bench/gpu_claims.sh pack on a finished claim: claims.tgz, results_<claim>.tgz and adapters_<claim>.tgz (what
    `--from-committed` loads: the decisive arms' adapters, committed.json); a file over the part size comes in
    parts that join back byte for byte."""
    import subprocess
    import sys

    runs, out = tmp_path / "runs", tmp_path / "out"
    shutil.copytree(r_search_cpu_claim, runs / "r_search")
    out.mkdir()
    env = {
        **os.environ,
        "CLAIMS_WORK": str(tmp_path / "work"),
        "CLAIMS_RUNS": str(runs),
        "OUT": str(out),
        "PY": sys.executable,
        "PROFILE": "cpu",
        "CLAIMS_PART_MIB": "1",
    }
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        ["bash", "bench/gpu_claims.sh", "pack"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in out.iterdir())
    assert "claims.tgz" in names and any(n.startswith("results_r_search.tgz") for n in names), names

    def joined(name: str) -> bytes:
        parts = sorted(p for p in out.iterdir() if p.name == name or p.name.startswith(name + ".part"))
        assert parts and all(p.stat().st_size <= 1024 * 1024 for p in parts), names
        return b"".join(p.read_bytes() for p in parts)

    with tarfile.open(fileobj=io.BytesIO(joined("adapters_r_search.tgz"))) as tar:
        packed = tar.getnames()
        committed = json.load(tar.extractfile("adapters/committed.json"))
    assert committed["claim"] == "r_search" and committed["seed"] == 0
    loaded = {p.split("/")[1] for p in packed if p.endswith("adapter_model.safetensors")}
    assert loaded == {"train_with_evidence", "train_no_evidence_block"}, packed
    with tarfile.open(fileobj=io.BytesIO(joined("results_r_search.tgz"))) as tar:
        assert any(n.endswith("r_search/report.json") for n in tar.getnames())


def test_gpu_claims_plans_one_job_per_arm_with_s3s_largest_first(tmp_path):
    """bench/gpu_claims.sh's queue: every independent arm once, qagent whole, claims in CLAIMS' order, s3's
    1,600-question arms first within s3 (an arm named search_r1 is not read as a size)."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "CLAIMS_WORK": str(tmp_path),
        "CLAIMS": "staged r_search qagent s3",
        "PY": sys.executable,
        "PROFILE": "gpu",
    }
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    jobs = subprocess.run(
        ["bash", "bench/gpu_claims.sh", "plan"], cwd=repo, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    s3 = [f"s3 {m}_{n}" for n in (25, 100, 400, 1600) for m in ("s3", "search_r1")] + ["s3 s3_noselect_25"]
    expected = [
        "staged staged",
        "staged search_r1",
        "r_search with_evidence",
        "r_search without_evidence",
        "r_search no_evidence_block",
        "qagent",
        *s3,
    ]
    assert sorted(jobs) == sorted(expected)
    assert set(jobs[:2]) == {"staged staged", "staged search_r1"} and jobs[5] == "qagent"
    assert set(jobs[6:8]) == {"s3 s3_1600", "s3 search_r1_1600"}
    assert set(jobs[8:10]) == {"s3 s3_400", "s3 search_r1_400"}
    env["CLAIMS"] = "s3 qagent"
    jobs = subprocess.run(
        ["bash", "bench/gpu_claims.sh", "plan"], cwd=repo, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert set(jobs[:2]) == {"s3 s3_1600", "s3 search_r1_1600"} and jobs[-1] == "qagent"
    # each job's done-marker and log: RUN[.ARM], RUN the run directory's name (<claim>-seedN under SEED=N), so a
    # second seed's jobs on one machine are not taken for the first's
    ids = subprocess.run(
        ["bash", "bench/gpu_claims.sh", "ids"], cwd=repo, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert ids == [j.replace(" ", ".") for j in jobs] and "qagent" in ids
    seeded = subprocess.run(
        ["bash", "bench/gpu_claims.sh", "ids"],
        cwd=repo,
        env={**env, "SEED": "2"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert seeded == [j.replace("s3 ", "s3-seed2.").replace("qagent", "qagent-seed2") for j in jobs]


def test_gpu_claims_pack_returns_adapters_of_a_claim_whose_report_waits(tmp_path, r_search_cpu_claim):
    """A claim in NO_REPORT (its other seeds run in a later lease) has no report yet: pack returns its results so far
    (the predictions) and its first seed's adapters, which the lent machine would otherwise take away; a claim
    without a report and not in NO_REPORT returns neither."""
    import subprocess
    import sys

    runs = tmp_path / "runs"
    shutil.copytree(r_search_cpu_claim, runs / "r_search")
    for name in ("report.json", "report.html"):
        (runs / "r_search" / name).unlink()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def pack(folder: str, **extra: str) -> list[str]:
        out = tmp_path / folder
        out.mkdir()
        env = {
            **os.environ,
            "CLAIMS_WORK": str(tmp_path / f"work_{folder}"),
            "CLAIMS_RUNS": str(runs),
            "OUT": str(out),
            "PY": sys.executable,
            "PROFILE": "cpu",
            **extra,
        }
        done = subprocess.run(
            ["bash", "bench/gpu_claims.sh", "pack"], cwd=repo, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return sorted(p.name for p in out.iterdir())

    waiting = pack("waiting", NO_REPORT="r_search")
    assert {"adapters_r_search.tgz", "results_r_search.tgz"} <= set(waiting), waiting
    with tarfile.open(
        tmp_path / "waiting" / "results_r_search.tgz"
    ) as tar:  # the predictions so far, no report
        names = tar.getnames()
    assert any(n.endswith("predictions.jsonl") for n in names) and not any(
        n.endswith("report.json") for n in names
    )
    with tarfile.open(tmp_path / "waiting" / "adapters_r_search.tgz") as tar:
        assert json.load(tar.extractfile("adapters/committed.json"))["seed"] == 0
    plain = pack("plain")
    assert not any(n.startswith(("results_", "adapters_")) for n in plain), plain


def test_a_bundle_of_a_first_seed_leaves_the_later_seeds_loads_to_them(tmp_path):
    """s3 with seed 0's cold starts done and seeds 1-2 still to run (a lease that ran `s3@0`): the later seeds'
    stages load their own seed's cold start ("sft_s3.seed1.sft_checkpoint", a stage not run yet), so nothing of theirs
    is carried, and seed 0's cold starts are carried only where a pending stage of seed 0 loads them. (On 2026-11-29
    the bundle took "sft_s3" for the stage and "seed1.sft_checkpoint" for its key, and every pack failed.)"""
    out = tmp_path / "s3"
    (out / "stages").mkdir(parents=True)
    (out / "claim.json").write_text(json.dumps({"method": "s3", "profile": "gpu", "seed": 0, "seeds": 3}))
    for method in ("s3", "search_r1"):
        step = out / method / "train" / "sft" / "checkpoints" / "step_000600"
        (step / "policy").mkdir(parents=True)
        (step / "policy" / "adapter_model.safetensors").write_bytes(b"w" * 64)
        (step / "searcher.json").write_text("{}")
        record = {"result": {"sft_checkpoint": str(step)}, "seconds": 1.0, "root": str(out)}
        (out / "stages" / f"sft_{method}.json").write_text(json.dumps(record))
    claim = claim_bundle._Claim(out)
    assert claim._stage_of("sft_s3.seed1.sft_checkpoint") == "sft_s3.seed1"
    assert claim._stage_of("sft_s3.sft_checkpoint") == "sft_s3"
    assert claim._stage_of("reader.reader") == "reader"
    claim.select()
    carried = {name for name in claim.files if "adapter_model" in name}
    # seed 0's arms are pending and load both cold starts: both carried; nothing named for another seed
    assert len(carried) == 2 and not any("seed1" in name or "seed2" in name for name in carried), carried
