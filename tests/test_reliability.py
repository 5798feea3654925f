"""A run's history is never lost or mixed up (issue 28): torn append-only files, reused run directories,
checkpoints that do not fit the recipe, full or read-only disks, bad corpus input, bad service input.
Each test reproduces one failure seen on main before the fix (tiny model, CPU)."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from sleuth.errors import CheckpointError, ConfigError
from tiny_recipe import tiny_grpo_recipe


def _recipe(small_world: Path, out_dir: Path, steps: int = 2, **overrides) -> dict:
    return tiny_grpo_recipe(small_world, out_dir, "reliable", steps, **overrides)


def _train(data: dict, **kwargs) -> dict:
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.trainer import train

    return train(recipe_from_dict(data), **kwargs)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- 1. torn append-only files


def test_resume_survives_torn_last_lines_of_metrics_and_validation(
    small_world: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kill or full disk during an append leaves a torn last line; on main `--resume` died with a
    JSONDecodeError. Now the line is dropped with a warning naming the file and its byte offset."""
    out = tmp_path / "run"
    dev = {"data": {"train": str(small_world / "train.jsonl"), "dev": str(small_world / "dev.jsonl")}}
    data = _recipe(small_world, out, **dev, **{"trainer.eval_examples": 2, "trainer.eval_every": 1})
    _train(data)
    metrics, validation = out / "metrics.jsonl", out / "validation.jsonl"
    offsets = {}
    for path in (metrics, validation):
        offsets[path] = path.stat().st_size
        with open(path, "ab") as f:
            f.write(b'{"step": 3, "reward/me')  # what a kill mid-append leaves
    data["trainer"]["total_steps"] = 3
    with caplog.at_level("WARNING", logger="sleuth.appendlog"):
        _train(data, resume=True)
    assert _steps(metrics) == [1, 2, 3]
    assert _steps(validation) == [0, 1, 2, 3]
    for path, offset in offsets.items():
        assert any(str(path) in r.message and f"at byte {offset}" in r.message for r in caplog.records), path


def test_one_reader_for_every_append_only_file(tmp_path: Path) -> None:
    """Metrics (report), validation (trainer) and predictions (eval) go through the same tolerant reader:
    a torn last line is dropped, a torn line elsewhere is named by file:line."""
    from sleuth.errors import DataFormatError
    from sleuth.eval.harness import load_predictions
    from sleuth.eval.report import read_jsonl

    path = tmp_path / "predictions.jsonl"
    good = b'{"id": "a", "dataset": "d"}\n'
    path.write_bytes(good + b'{"id": "b", "data')
    records, warnings = read_jsonl(path)
    assert [r["id"] for r in records] == ["a"] and f"at byte {len(good)}" in warnings[0]
    assert list(load_predictions(path)) == [("d", "a")]
    assert path.read_bytes() == good  # repaired: the next append starts a clean line
    path.write_bytes(b'{"id": "a", "da\n' + good)
    with pytest.raises(DataFormatError, match=re.escape(f"{path}:1")):
        read_jsonl(path)


# ----------------------------------------------------------------------------- 2. a run directory knows its run


def test_fresh_run_into_an_old_run_refuses_and_overwrite_moves_it_aside(
    small_world: Path, tmp_path: Path
) -> None:
    """On main a 6-step run into a 20-step run's directory exited 0 naming the old step_000020, pruned its
    own checkpoints and cut metrics.jsonl to 6 lines."""
    out = tmp_path / "run"
    _train(_recipe(small_world, out, steps=3))
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as err:
        _train(_recipe(small_world, out, steps=2))
    message = str(err.value)
    assert "\n" not in message and str(out) in message and "3 logged step(s)" in message
    assert "--resume" in message and "--overwrite" in message
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    result = _train(_recipe(small_world, out, steps=2), overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1
    moved = {p.relative_to(aside[0]).as_posix(): p.read_bytes() for p in aside[0].rglob("*") if p.is_file()}
    assert moved == before  # nothing deleted
    assert _steps(out / "metrics.jsonl") == [1, 2]
    assert result["checkpoint"] == str(out / "checkpoints" / "step_000002")
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]


def test_resume_with_every_checkpoint_damaged_refuses_and_keeps_the_history(
    small_world: Path, tmp_path: Path
) -> None:
    """On main `--resume` silently started over and truncated metrics.jsonl."""
    out = tmp_path / "run"
    _train(_recipe(small_world, out, steps=2))
    for state in (out / "checkpoints").glob("step_*/state.pt"):
        state.write_bytes(b"")
    metrics = (out / "metrics.jsonl").read_bytes()
    data = _recipe(small_world, out, steps=3)
    with pytest.raises(CheckpointError) as err:
        _train(data, resume=True)
    message = str(err.value)
    assert "\n" not in message and "no usable checkpoint" in message and "2 logged step(s)" in message
    assert "--overwrite" in message
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_the_final_checkpoint_is_the_one_this_run_wrote(small_world: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app

    out = tmp_path / "run"
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(_recipe(small_world, out, steps=2, **{"trainer.save_every": 5})))
    result = CliRunner().invoke(app, ["train", str(recipe_path)])
    assert result.exit_code == 0, result.output
    # the console wraps long lines: words are compared with the breaks folded, the path with them removed
    assert "2 steps" in " ".join(result.output.split()) and "step_000002" in result.output.replace("\n", "")


def test_pruning_keeps_the_checkpoint_just_written_whatever_sorts_after_it(tmp_path: Path) -> None:
    """Leftover higher-numbered checkpoints (skipped as damaged on resume) are superseded, not kept in place
    of the new ones."""
    from sleuth.rl.checkpoint import prune_checkpoints

    for step in range(1, 6):
        (tmp_path / f"step_{step:06d}").mkdir()
    prune_checkpoints(tmp_path, tmp_path / "step_000002", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]


# ----------------------------------------------------------------------------- 3. checkpoints that do not fit


LORA = {"policy": "tiny", "lora": {"enabled": True, "r": 2, "alpha": 4}}


@pytest.fixture(scope="module")
def full_and_lora_runs(small_world: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished 1-step full fine-tuning run and a LoRA run (read-only: refusals write nothing)."""
    runs = {}
    for name, model in (("full", {"policy": "tiny"}), ("lora", LORA)):
        out = tmp_path_factory.mktemp(name) / "run"
        _train(_recipe(small_world, out, steps=1, model=model))
        runs[name] = out
    return runs


def _tiny_variant(tmp_path: Path, name: str, **spec) -> str:
    from sleuth.llm.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path / "models" / name, **spec))


@pytest.mark.parametrize(
    ("run", "override", "named", "instead"),
    [
        (
            "full",
            {"agent.loop": "r_search", "reward.name": "search_r1_em"},
            "agent.loop differs",
            "agent.loop=search_r1",
        ),
        ("full", {"reward.name": "search_r1_format_em"}, "reward.name differs", "reward.name=search_r1_em"),
        (
            "full",
            {"algorithm.name": "ppo", "algorithm.n": 1},
            "algorithm.name differs",
            "algorithm.name=grpo",
        ),
        ("lora", {"model": {"policy": "tiny"}}, "model.lora.enabled differs", "model.lora.enabled=true"),
        ("full", {"model": LORA}, "model.lora.enabled differs", "model.lora.enabled=false"),
        ("full", {"model": {"policy": "OTHER"}}, "model.policy differs", "model.policy=tiny"),
        ("full", {"model": {"policy": "VOCAB"}}, "vocabulary differs", "model.policy it was trained on"),
    ],
    ids=["loop", "reward", "grpo-to-ppo", "lora-onto-full", "full-onto-lora", "base-model", "vocabulary"],
)
def test_resume_refuses_a_checkpoint_of_another_run_naming_the_field(
    small_world: Path,
    tmp_path: Path,
    full_and_lora_runs: dict[str, Path],
    run: str,
    override: dict,
    named: str,
    instead: str,
) -> None:
    """On main: another loop resumed silently (rc 0), GRPO -> PPO died with FileNotFoundError, LoRA onto full
    with HFValidationError, full onto LoRA with 'optimizer got an empty parameter list'."""
    out = full_and_lora_runs[run]
    override = json.loads(json.dumps(override))
    if "model" in override and override["model"]["policy"] == "OTHER":
        override["model"]["policy"] = _tiny_variant(tmp_path, "other", hidden_size=32)
    if "model" in override and override["model"]["policy"] == "VOCAB":  # a directory named like the alias
        override["model"]["policy"] = _tiny_variant(tmp_path / "v", "tiny", vocab_size=400)
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError) as err:
        _train(_recipe(small_world, out, steps=2, **override), resume=True)
    message = str(err.value)
    assert (
        "\n" not in message and message.startswith("--resume: ") and named in message and instead in message
    )
    assert (out / "metrics.jsonl").read_bytes() == before


def test_resume_logs_the_allowed_changes(
    small_world: Path, tmp_path: Path, full_and_lora_runs: dict[str, Path]
) -> None:
    out = tmp_path / "run"
    shutil.copytree(full_and_lora_runs["full"], out)
    console = Console(record=True, width=400)
    data = _recipe(small_world, out, steps=2, **{"optim.lr": 1e-4})
    data["data"]["train"] = str(small_world / "dev.jsonl")
    _train(data, resume=True, console=console)
    printed = console.export_text()
    assert (
        f"resume changes data.train: {small_world / 'train.jsonl'} -> {small_world / 'dev.jsonl'}" in printed
    )
    assert "resume changes optim.lr" in printed and "resume changes trainer.total_steps: 1 -> 2" in printed
    assert _steps(out / "metrics.jsonl") == [1, 2]


@pytest.mark.parametrize(
    ("init", "model", "named", "instead"),
    [
        ("full", LORA, "holds fully fine-tuned weights", "model.policy="),
        ("lora", {"policy": "tiny"}, "holds LoRA adapters", "model.lora.enabled=true"),
    ],
    ids=["full-into-lora", "lora-into-full"],
)
def test_init_from_refuses_weights_that_do_not_fit(
    small_world: Path,
    tmp_path: Path,
    full_and_lora_runs: dict[str, Path],
    init: str,
    model: dict,
    named: str,
    instead: str,
) -> None:
    """On main: `Can't find 'adapter_config.json'` (full into LoRA), HFValidationError (LoRA into full)."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        _train(_recipe(small_world, out, model={**model, "init_from": str(full_and_lora_runs[init])}))
    message = str(err.value)
    assert (
        "\n" not in message
        and message.startswith("model.init_from: ")
        and named in message
        and instead in message
    )
    assert not out.exists()


def test_init_from_the_suggested_policy_directory_trains_lora_on_full_weights(
    small_world: Path, tmp_path: Path, full_and_lora_runs: dict[str, Path]
) -> None:
    """The refusal's alternative works: fresh adapters on a fully fine-tuned checkpoint's weights."""
    policy = full_and_lora_runs["full"] / "checkpoints" / "step_000001" / "policy"
    result = _train(_recipe(small_world, tmp_path / "run", steps=1, model={**LORA, "policy": str(policy)}))
    assert (Path(result["checkpoint"]) / "policy" / "adapter_config.json").is_file()


# ----------------------------------------------------------------------------- 4. full disks, read-only outputs


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _safetensors_full(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'
    )


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_disk_full_while_saving_a_checkpoint_keeps_the_last_good_one(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """On main: a SafetensorError traceback. Now one line with the path and bytes; no temp directory left."""
    import torch
    import transformers.modeling_utils

    from sleuth.errors import OutputError
    from sleuth.rl.checkpoint import resumable_checkpoint

    out = tmp_path / "run"
    _train(_recipe(small_world, out, steps=1))
    (out / "checkpoints" / ".tmp_step_000007").mkdir()  # what a save killed by SIGKILL leaves
    with monkeypatch.context() as patch:
        if writer == "torch.save":
            patch.setattr(torch, "save", _enospc)
        else:
            patch.setattr(transformers.modeling_utils, "safe_save_file", _safetensors_full)
        with pytest.raises(OutputError) as err:
            _train(_recipe(small_world, out, steps=2), resume=True)
    message = str(err.value)
    assert "\n" not in message and str(out / "checkpoints") in message and "checkpoint step_000002" in message
    assert re.search(r"needs about [\d,]+ bytes, [\d,]+ free", message) and "step_000001 is intact" in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert resumable_checkpoint(out) == (out / "checkpoints" / "step_000001", [])
    _train(_recipe(small_world, out, steps=2), resume=True)  # space freed: resume works
    assert _steps(out / "metrics.jsonl") == [1, 2]


def test_read_only_run_directory_is_one_line(
    small_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On main: a traceback from `sleuth train`."""
    import tempfile

    from sleuth.errors import OutputError

    def read_only(*args, dir=None, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(dir))

    out = tmp_path / "run"
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OutputError) as err:
        _train(_recipe(small_world, out, steps=1))
    message = str(err.value)
    assert (
        "\n" not in message and f"at {out}: Read-only file system" in message and "no checkpoint" in message
    )
    assert not out.exists()


def test_index_build_on_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On main: tracebacks from `sleuth index`."""
    import tempfile

    from typer.testing import CliRunner

    from sleuth.cli import app
    from sleuth.retrieval import index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "contents": "\\"A\\"\\nalpha"}\n')

    def half_then_full(docstore, out_dir, **kwargs):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "part").write_bytes(b"x" * 5000)
        _enospc()

    with monkeypatch.context() as patch:
        patch.setattr(index, "build_bm25_sharded", half_then_full)
        result = CliRunner().invoke(
            app, ["index", str(corpus), "--kind", "bm25", "--out", str(tmp_path / "idx")]
        )
    printed = " ".join(result.output.split())  # the console wraps long lines
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit) and "Traceback" not in printed
    assert f"cannot write bm25 index at {tmp_path / 'idx'}: No space left on device" in printed
    assert re.search(r"needs at least [\d,]+ bytes, [\d,]+ free there", printed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]

    def read_only(*args, dir=None, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(dir))

    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "mkdtemp", read_only)
        result = CliRunner().invoke(
            app, ["index", str(corpus), "--kind", "bm25", "--out", str(tmp_path / "idx")]
        )
    assert result.exit_code == 2 and "Read-only file system" in " ".join(result.output.split())


def test_a_killed_index_build_is_cleaned_by_the_next_one(tmp_path: Path) -> None:
    """On main a SIGKILLed build left `.NAME.building-*` beside the output forever."""
    import os
    import subprocess
    import sys

    from sleuth.retrieval import build_index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "contents": "\\"A\\"\\nalpha"}\n')
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    killed, old, running = (tmp_path / f".idx.building-{s}" for s in ("killed", "old", "running"))
    for path, pid in ((killed, dead.stdout.strip()), (old, None), (running, str(os.getpid()))):
        path.mkdir()
        (path / "docstore").mkdir()
        if pid is not None:
            (path / ".builder-pid").write_text(pid)
    build_index(corpus, "bm25", tmp_path / "idx", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".idx.building-running", "corpus.jsonl", "idx"]


# ----------------------------------------------------------------------------- 5. corpus input


@pytest.mark.parametrize(
    ("lines", "where", "message"),
    [
        ([b'{"id": "1", "contents": "a"}', b'{"id": "", "contents": "b"}'], ":2: ", "empty id"),
        ([b'{"id": "1", "contents": "a"}', b'{"id": "  ", "contents": "b"}'], ":2: ", "empty id"),
        ([b'{"id": null, "contents": "a"}'], ":1: ", "empty id"),
        ([b'{"id": "1", "contents": "a"}', b'{"id": "1", "contents": "b"}'], ":2: ", "duplicate id '1'"),
        ([b""], ": ", "holds no passages"),
    ],
    ids=["empty-id", "blank-id", "null-id", "duplicate-id", "empty-corpus"],
)
def test_bad_corpus_ids_and_empty_corpora_are_refused(
    tmp_path: Path, lines: list[bytes], where: str, message: str
) -> None:
    """On main an empty id was indexed and an empty corpus built a 0-passage index that training ran on."""
    from sleuth.errors import DataFormatError
    from sleuth.retrieval import build_index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataFormatError) as err:
        build_index(corpus, "bm25", tmp_path / "idx", show_progress=False)
    assert str(err.value).startswith(f"{corpus}{where}") and message in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def test_byte_order_marks_are_stripped(tmp_path: Path) -> None:
    """A BOM opens files saved by some editors (line 1) and every part of concatenated ones."""
    from sleuth.retrieval import build_index, load_retriever

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        b'\xef\xbb\xbf{"id": "1", "contents": "\\"A\\"\\nzebra"}\n'
        b'\xef\xbb\xbf{"id": "2", "contents": "\\"B\\"\\nquokka"}\n'
    )
    build_index(corpus, "bm25", tmp_path / "idx", show_progress=False)
    retriever = load_retriever(tmp_path / "idx")
    assert [hits[0].doc_id for hits in retriever.search(["zebra", "quokka"], 1)] == ["1", "2"]


# ----------------------------------------------------------------------------- 6. service input


class _CountingRetriever:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def search(self, queries: list[str], k: int):
        self.calls += 1
        return self.inner.search(queries, k)


BAD_TEXT = [
    (b'"where is a\\ud800b"', "is not valid Unicode (a lone surrogate at character 10)"),
    (b'"' + b"\\u0000" * 2000 + b'"', "is mostly control characters (2000 of 2000)"),
]


@pytest.mark.parametrize(("text", "message"), BAD_TEXT, ids=["lone-surrogate", "nul-flood"])
def test_retriever_refuses_unusable_queries_before_batching(text: bytes, message: str) -> None:
    """On main a lone surrogate failed its whole batch; 2,000 NULs slowed bursts 4.6x."""
    from fastapi.testclient import TestClient

    from sleuth.retrieval.server import create_app
    from toyworld import ToyRetriever

    retriever = _CountingRetriever(ToyRetriever())
    with TestClient(create_app(retriever)) as client:
        bad = client.post(
            "/retrieve",
            content=b'{"queries": ["Varonia", ' + text + b'], "topk": 1}',
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 422 and bad.json()["detail"] == f"queries[1] {message}; send " + (
            "UTF-8 text" if "Unicode" in message else "readable text"
        )
        assert retriever.calls == 0
        assert client.post("/retrieve", json={"queries": ["Varonia\ttab\n"], "topk": 1}).status_code == 200


@pytest.mark.parametrize(("text", "message"), BAD_TEXT, ids=["lone-surrogate", "nul-flood"])
def test_searcher_service_refuses_unusable_questions_at_once(
    small_world: Path, full_and_lora_runs: dict[str, Path], text: bytes, message: str
) -> None:
    """On main a lone surrogate got a 503 after 86-93 s and slowed the requests batched with it."""
    import time

    from fastapi.testclient import TestClient

    from sleuth.serve.loading import ServiceSpec, build_service
    from sleuth.serve.searcher_server import create_app

    service = build_service(
        ServiceSpec(checkpoint=full_and_lora_runs["full"], index=small_world / "bm25", generator="tiny")
    )
    try:
        with TestClient(create_app(service)) as client:
            start = time.perf_counter()
            bad = client.post(
                "/search",
                content=b'{"question": ' + text + b"}",
                headers={"content-type": "application/json"},
            )
            assert time.perf_counter() - start < 5.0
            assert bad.status_code == 422 and bad.json()["field"] == "question"
            assert bad.json()["detail"].startswith(f"question {message}")
    finally:
        service.close()


# ----------------------------------------------------------------------------- retriever body memory


def test_retriever_default_body_limit_and_budget_follow_the_query_limits() -> None:
    """Was 4096 x 2000 x 6 + 65536 = 49,217,536 bytes a request and no bound across requests."""
    from fastapi.testclient import TestClient

    from sleuth.retrieval.server import create_app
    from toyworld import ToyRetriever

    app = create_app(ToyRetriever())
    assert app.state.body_budget.total_bytes == 4 * (4096 * (2000 + 4) + 65536) == 33_095_680
    with TestClient(app) as client:
        health = client.get("/health").json()
        assert health["max_body_bytes"] == 8_273_920 and health["stats"]["body_budget_bytes"] == 33_095_680
        # a full request of ASCII queries at the length limit fits the default per-request limit
        full = json.dumps({"queries": ["x" * 2000] * 4096, "topk": 1}).encode()
        assert len(full) <= 8_273_920
        assert (
            client.post("/retrieve", content=full, headers={"content-type": "application/json"}).status_code
            == 200
        )
        assert client.post("/retrieve", content=b" " * 8_273_921).status_code == 413
    assert create_app(ToyRetriever(), max_queries=10, max_query_chars=100).state.body_budget.total_bytes == (
        4 * (10 * 104 + 65536)
    )
    with pytest.raises(ValueError, match="body_budget_bytes .* smaller than max_body_bytes"):
        from sleuth.http_errors import BodyBudget

        create_app(ToyRetriever(), max_body_bytes=1000, body_budget=BodyBudget(999))


def test_concurrent_near_limit_bodies_never_hold_more_than_the_budget() -> None:
    """16 concurrent bodies just under the limit: each is served or refused with 503 + Retry-After, the
    body bytes reserved and the bytes actually read by requests in progress never pass the budget."""
    import threading
    import time

    import httpx

    from sleuth.http_errors import BodyBudget
    from sleuth.retrieval.server import create_app
    from sleuth.serve.threaded import serve_in_thread
    from toyworld import ToyRetriever

    class SlowRetriever(ToyRetriever):  # keeps each request (and its body) in progress a while
        def search(self, queries, k):
            time.sleep(0.4)
            return super().search(queries, k)

    limit = 200_000
    body = json.dumps({"queries": ["Varonia " + "x" * 1990] * 99, "topk": 1}).encode()
    assert limit - 2_000 < len(body) <= limit
    budget = BodyBudget(2 * limit + limit // 2, wait_s=0.3)  # room for two bodies at once
    app = create_app(
        SlowRetriever(), max_body_bytes=limit, body_budget=budget, worker_threads=4, batch_wait_ms=0
    )
    responses: list[httpx.Response] = []
    with serve_in_thread(app) as base:
        start = threading.Barrier(16)

        def post() -> None:
            with httpx.Client(timeout=60) as client:
                start.wait()
                responses.append(
                    client.post(
                        base + "/retrieve", content=body, headers={"content-type": "application/json"}
                    )
                )

        threads = [threading.Thread(target=post) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    codes = sorted(r.status_code for r in responses)
    assert len(codes) == 16 and set(codes) <= {200, 503}, codes
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert served and refused, codes  # some fit, the rest were turned away instead of piling up
    assert all(len(r.json()["result"]) == 99 for r in served)
    assert all(
        r.headers["retry-after"] == "1" and "budget of 500000 bytes" in r.json()["detail"] for r in refused
    )
    assert budget.refused == len(refused)
    assert 2 * len(body) == budget.peak_held_bytes <= budget.total_bytes  # two held at once, never a third
    assert len(body) <= budget.peak_received_bytes <= budget.total_bytes  # the counter saw the bodies' bytes
    assert budget.held_bytes == budget.received_bytes == budget.in_progress == 0  # all released


def test_over_limit_body_gets_413_at_once_even_while_the_budget_is_full() -> None:
    import time

    from fastapi.testclient import TestClient

    from sleuth.http_errors import BodyBudget
    from sleuth.retrieval.server import create_app
    from toyworld import ToyRetriever

    budget = BodyBudget(10_000, wait_s=1.5)
    with TestClient(create_app(ToyRetriever(), max_body_bytes=10_000, body_budget=budget)) as client:
        budget.held_bytes = budget.total_bytes  # as if other requests held the whole budget
        began = time.monotonic()
        big = client.post("/retrieve", json={"queries": ["x" * 20_000], "topk": 1})
        assert big.status_code == 413 and time.monotonic() - began < 1.0  # not queued behind the budget
        assert client.get("/health").status_code == 200  # a request without a body needs no budget
        began = time.monotonic()
        small = client.post("/retrieve", json={"queries": ["Varonia"], "topk": 1})
        waited = time.monotonic() - began
        assert small.status_code == 503 and small.headers["retry-after"] == "1" and 1.5 <= waited < 10
        budget.held_bytes = 0
        assert client.post("/retrieve", json={"queries": ["Varonia"], "topk": 1}).status_code == 200
        assert budget.refused == 1 and budget.held_bytes == 0


def test_body_budget_wakes_a_waiter_when_bytes_are_released() -> None:
    import asyncio

    from sleuth.http_errors import BodyBudget

    async def main() -> tuple[bool, bool, float]:
        budget = BodyBudget(100, wait_s=2.0)
        assert await budget.acquire(100)
        loop = asyncio.get_running_loop()
        began = loop.time()
        waiter = asyncio.create_task(budget.acquire(60))
        await asyncio.sleep(0.05)
        assert not waiter.done() and budget.held_bytes == 100
        budget.release(100, 100)
        got = await waiter
        waited = loop.time() - began
        refused = await BodyBudget(10, wait_s=0.0).acquire(11)
        return got, refused, waited

    got, refused, waited = asyncio.run(main())
    assert got and not refused and waited < 1.0  # woken by the release, not by the 2 s deadline
