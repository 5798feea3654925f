"""`sleuth reproduce --reuse DIR`: a trained reader or injected model replaces training one only when it learned
the run's world, and the stage measures it again on the run's test questions."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sleuth.claims.reuse import WORLD_RECORD, reused_model, world_fingerprint, write_world_record
from sleuth.claims.runner import reproduce
from sleuth.claims.stages import STOP_AFTER_ENV, StagesStopped
from sleuth.cli import app
from sleuth.errors import ConfigError

CLAIMS = Path(__file__).resolve().parent.parent / "checkpoints" / "claims"


def _world(path: Path, seed_text: str) -> Path:
    path.mkdir(parents=True)
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        (path / name).write_text(f"{name} {seed_text}\n")
    return path


def _model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "searcher.json").write_text("{}")
    return path


def test_reused_model_is_refused_unless_it_learned_this_world(tmp_path: Path) -> None:
    world, other = _world(tmp_path / "w", "a"), _world(tmp_path / "o", "b")
    reuse = tmp_path / "reuse"
    with pytest.raises(
        ConfigError, match=r"--reuse .*: no trained reader there \(.*reader/searcher.json missing\)"
    ):
        reused_model(reuse, "reader", world)
    model = _model(reuse / "reader")
    with pytest.raises(ConfigError, match=f"has no {WORLD_RECORD}, so the world it learned is unknown"):
        reused_model(reuse, "reader", world)
    write_world_record(model, other)
    with pytest.raises(
        ConfigError, match=r"was trained on another world \(corpus.jsonl, train.jsonl, test.jsonl"
    ):
        reused_model(reuse, "reader", world)
    (world / "test.jsonl").write_text((other / "test.jsonl").read_text())  # one split alike is not enough
    with pytest.raises(ConfigError, match=r"another world \(corpus.jsonl, train.jsonl differ"):
        reused_model(reuse, "reader", world)
    write_world_record(model, world)
    assert reused_model(reuse, "reader", world) == model
    # the training settings, where the record names them, must be the run profile's
    trained = {"epochs": 2, "lr": 0.0003, "distractors": 2}
    write_world_record(model, world, trained)
    assert reused_model(reuse, "reader", world, dict(trained)) == model
    assert reused_model(reuse, "reader", world) == model  # no settings asked: the world alone decides
    with pytest.raises(
        ConfigError, match=r"trained with other settings than this run's profile \(epochs: 2 there, 3 here\)"
    ):
        reused_model(reuse, "reader", world, {**trained, "epochs": 3})
    write_world_record(model, world)  # an older record without settings: the world alone decides
    assert reused_model(reuse, "reader", world, {**trained, "epochs": 3}) == model
    (world / "train.jsonl").unlink()
    with pytest.raises(ConfigError, match="train.jsonl missing"):
        world_fingerprint(world)


@pytest.mark.parametrize("name", ["injected", "reader"])
def test_committed_claim_models_record_the_gpu_worlds(name: str) -> None:
    """The committed adapters carry the record `--reuse` checks: the test split is the one their CPU checks use."""
    from tests.test_claim_checkpoints import PLAIN_TEST_SHA, STAGED_TEST_SHA

    record = json.loads((CLAIMS / name / WORLD_RECORD).read_text())
    files = record["files"]
    assert files["test.jsonl"] == (STAGED_TEST_SHA if name == "injected" else PLAIN_TEST_SHA)
    assert set(files) == {"corpus.jsonl", "train.jsonl", "test.jsonl"}
    # and the settings they were trained with, which the gpu profile's would train them with again: from the
    # checkpoints' own counts (searcher.json), reader 12,800 records / 16 a step = 800 steps an epoch, 1,600 steps
    # = 2 epochs; injection 12,498 statements / 128 a step = 98 steps an epoch, 1,176 steps = 12 epochs
    done = json.loads((CLAIMS / name / "searcher.json").read_text())
    settings = record["settings"]
    steps_an_epoch = -(-done["records"] // settings["batch_size"])
    assert done["steps"] == settings["epochs"] * steps_an_epoch
    if name == "reader":
        from sleuth.claims.profiles import PLAIN_PROFILES

        assert settings == json.loads(json.dumps(asdict(PLAIN_PROFILES["gpu"].reader)))
    else:
        from sleuth.claims.staged import PROFILES

        gpu = PROFILES["gpu"]
        assert (settings["epochs"], settings["lr"], settings["batch_size"]) == (
            gpu.inject_epochs,
            gpu.inject_lr,
            gpu.inject_batch,
        )


def _stop_after(monkeypatch: pytest.MonkeyPatch, stages: int) -> None:
    monkeypatch.setenv(STOP_AFTER_ENV, str(stages))


def test_staged_reuses_an_injected_model_and_measures_it_again(tmp_path: Path, monkeypatch) -> None:
    """Run A injects (world, inject; then stops); run B reuses A's injected model: no injection trained, the
    boundary measured on B's test questions equals A's (the same model, greedy)."""
    _stop_after(monkeypatch, 2)
    first, second = tmp_path / "a", tmp_path / "b"
    with pytest.raises(StagesStopped):
        reproduce("staged", first, "cpu")
    injected = json.loads((first / "stages" / "inject.json").read_text())["result"]
    assert injected["reused"] is None and (Path(injected["checkpoint"]) / WORLD_RECORD).is_file()
    shutil.copytree(injected["checkpoint"], tmp_path / "models" / "injected")
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "staged",
            "--profile",
            "cpu",
            "--out",
            str(second),
            "--reuse",
            str(tmp_path / "models"),
        ],
        terminal_width=300,
    )
    assert result.exit_code == 2 and "stopped before stage labels" in result.output, result.output
    reused = json.loads((second / "stages" / "inject.json").read_text())["result"]
    assert reused["reused"] == str(tmp_path / "models" / "injected")
    assert (
        Path(reused["checkpoint"]).parent == second / "inject"
    )  # copied under OUT: the run holds what it loads
    assert not (second / "inject" / "knowledge_sft.jsonl").exists()  # nothing trained
    assert reused["boundary"] == injected["boundary"]


@pytest.mark.slow
def test_reader_is_reused_from_a_checkpoint_or_an_export_and_refused_for_another_world(
    tmp_path: Path, monkeypatch
) -> None:
    """r_search's reader trained once (run A), then reused from its SFT checkpoint (adapters merged) and from its
    export: the same gold-passage EM on the same test questions; staged's world is another one, so it refuses."""
    _stop_after(monkeypatch, 2)
    with pytest.raises(StagesStopped):
        reproduce("r_search", tmp_path / "a", "cpu")
    trained = json.loads((tmp_path / "a" / "stages" / "reader.json").read_text())["result"]
    done = json.loads((tmp_path / "a" / "reader" / "reader.json").read_text())
    exported, checkpoint = tmp_path / "export" / "reader", tmp_path / "checkpoint" / "reader"
    shutil.copytree(trained["reader"], exported)
    shutil.copytree(done["checkpoint"], checkpoint)
    write_world_record(checkpoint, tmp_path / "a" / "world")
    for reuse, run in ((exported.parent, "b"), (checkpoint.parent, "c")):
        with pytest.raises(StagesStopped):
            reproduce(
                "qagent", tmp_path / run, "cpu", reuse=reuse
            )  # qagent's world is r_search's (one profile)
        reused = json.loads((tmp_path / run / "stages" / "reader.json").read_text())["result"]
        assert reused["reused"] == str(reuse / "reader") and reused["reader"] == str(
            tmp_path / run / "reader" / "reader"
        )
        assert reused["gold_passage_em"] == trained["gold_passage_em"]
    # reused from a checkpoint, the export is made from a copy inside the run, so a claim bundle can rebuild it
    origin = json.loads((tmp_path / "c" / "reader" / "reader" / "searcher.json").read_text())["exported_from"]
    assert Path(origin) == tmp_path / "c" / "reader" / "reused"
    shutil.copytree(checkpoint, tmp_path / "checkpoint" / "injected")
    with pytest.raises(ConfigError, match="was trained on another world"):
        reproduce("staged", tmp_path / "d", "cpu", reuse=tmp_path / "checkpoint")
