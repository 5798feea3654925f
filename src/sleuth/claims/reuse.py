"""The shared models of `sleuth reproduce`, trained or reused: the reader (r_search, qagent, s3) and the injected
model (staged).

Training them is the costliest shared part of a claim (on an H100: the reader's 1,600 SFT steps, the injection's
1,176), and it gives the same result for the same world. So each is written with a record of the world it learned
(`claim_world.json`: the sha256 of the world's corpus and splits), and `sleuth reproduce --reuse DIR` takes
DIR/reader or DIR/injected (e.g. the committed `checkpoints/claims`) in place of training one, after checking that
record against the run's world and, where it records them, the settings it was trained with against the run's
profile: a model that learned another world, or learned it otherwise, is refused, never silently reused. Either
way the stage measures the model on the run's own test questions (the reader on gold passages, the injected
model closed-book), so a reused model is checked, not trusted.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sleuth.claims.knowledge import InjectionSettings, boundary_check, inject_knowledge
from sleuth.claims.reader import READER_DIR, reader_check, train_reader
from sleuth.errors import ConfigError
from sleuth.utils import atomic_write_json, sha256_file

WORLD_RECORD = "claim_world.json"
WORLD_FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl")
READER = "reader"  # DIR/reader: the trained reader (LoRA checkpoint or exported model)
INJECTED = "injected"  # DIR/injected: the knowledge-injected model (LoRA checkpoint)
REUSED_READER = "reused"  # OUT/reused: a reused reader checkpoint's copy, which OUT/reader is exported from


def world_fingerprint(world: Path) -> dict[str, str]:
    """sha256 of the world's corpus and splits: what a model trained on this world learned from."""
    missing = [name for name in WORLD_FILES if not (world / name).is_file()]
    if missing:
        raise ConfigError(f"world {world}: {', '.join(missing)} missing; rebuild it (sleuth synth)")
    return {name: sha256_file(world / name) for name in WORLD_FILES}


def write_world_record(model: Path, world: Path, settings: dict[str, Any] | None = None) -> None:
    """MODEL/claim_world.json: the world `model` was trained on and, where known, the settings it was trained with
    (`ReaderSettings`, `InjectionSettings` as dicts), so a later run can reuse it (`reused_model`)."""
    record: dict[str, Any] = {"files": world_fingerprint(world)}
    if settings is not None:
        record["settings"] = settings
    atomic_write_json(Path(model) / WORLD_RECORD, record)


def recorded_settings(model: Path) -> dict[str, Any] | None:
    """The training settings MODEL/claim_world.json records (None: a record without them, or none)."""
    record = Path(model) / WORLD_RECORD
    return json.loads(record.read_text()).get("settings") if record.is_file() else None


def _as_record(settings: Any) -> dict[str, Any]:
    """Settings as a record holds them (tuples as JSON lists), so a record read back compares equal."""
    return json.loads(json.dumps(asdict(settings)))


def world_differences(record: Path, world: Path) -> list[str]:
    """The world files whose sha256 differs from a `claim_world.json` record's (empty: the same world)."""
    expected = json.loads(Path(record).read_text()).get("files", {})
    actual = world_fingerprint(world)
    return [name for name in WORLD_FILES if expected.get(name) != actual[name]]


def reused_model(reuse: Path, name: str, world: Path, settings: dict[str, Any] | None = None) -> Path:
    """REUSE/NAME, checked to have been trained on `world` and, where its record names them, with `settings` (the
    run's profile would train it with those); a ConfigError saying what to fix otherwise."""
    model = Path(reuse) / name
    if not (model / "searcher.json").is_file():
        raise ConfigError(
            f"--reuse {reuse}: no trained {name} there ({model}/searcher.json missing); pass a folder "
            f"holding {name}/ (e.g. checkpoints/claims) or leave --reuse out to train it"
        )
    record = model / WORLD_RECORD
    if not record.is_file():
        raise ConfigError(
            f"--reuse {reuse}: {model} has no {WORLD_RECORD}, so the world it learned is unknown; "
            f"leave --reuse out to train it on this run's world"
        )
    differing = world_differences(record, world)
    if differing:
        raise ConfigError(
            f"--reuse {reuse}: {model} was trained on another world ({', '.join(differing)} differ "
            f"from {world}); leave --reuse out to train it on this run's world"
        )
    trained_with = recorded_settings(model)
    if settings is not None and trained_with is not None and trained_with != settings:
        differ = sorted(
            k for k in set(settings) | set(trained_with) if settings.get(k) != trained_with.get(k)
        )
        shown = ", ".join(f"{k}: {trained_with.get(k)!r} there, {settings.get(k)!r} here" for k in differ)
        raise ConfigError(
            f"--reuse {reuse}: {model} was trained with other settings than this run's profile ({shown}); "
            f"leave --reuse out to train it with this profile's settings"
        )
    return model


def _copy_model(model: Path, dest: Path) -> None:
    """`model`'s directory copied to `dest` (replaced), written under a temporary name and renamed into place."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def reader_stage(
    world: Path, out: Path, profile: Any, reuse: Path | None, console: Any = None
) -> dict[str, Any]:
    """The claim's trained reader under OUT (trained, or REUSE/reader exported there), with its gold-passage EM
    on the profile's test questions."""
    # deferred: the export loads model and hub code; `sleuth --help` imports this module
    from sleuth.agent.searcher import export_searcher

    settings = _as_record(profile.reader)
    if reuse is None:
        path = train_reader(world, out, profile.reader, console)
    else:
        # copied under OUT like a trained one, so the run directory holds all it loads (claim bundles carry it)
        model = reused_model(reuse, READER, world, settings)
        settings = recorded_settings(model)  # what that model records (None: an older record without them)
        path = out / READER_DIR
        if (model / "config.json").is_file():  # an exported reader (a Hugging Face directory)
            _copy_model(model, path)
        else:  # a checkpoint: copied under OUT, then its adapters merged into the base
            # the export records where it came from, and a claim bundle rebuilds it from there: that must lie in OUT
            copied = out / REUSED_READER
            _copy_model(model, copied)
            export_searcher(copied, path, overwrite=True)
    write_world_record(path, world, settings)
    return {
        "reader": str(path),
        "reused": str(reuse / READER) if reuse else None,
        "gold_passage_em": reader_check(world, str(path), out, "test", profile.test_questions),
    }


def inject_stage(
    world: Path, out: Path, profile: Any, reuse: Path | None, console: Any = None
) -> dict[str, Any]:
    """The staged claim's knowledge-injected model (trained under OUT, or REUSE/injected), with its closed-book EM
    per question type on the profile's test questions (the knowledge boundary)."""
    settings = InjectionSettings(
        model=profile.pipeline.model,
        epochs=profile.inject_epochs,
        lr=profile.inject_lr,
        batch_size=profile.inject_batch,
        lora=profile.lora,
    )
    if reuse is None:
        checkpoint = inject_knowledge(world, out, settings, console)
        write_world_record(checkpoint, world, _as_record(settings))
    else:
        checkpoint = out / "reused"
        _copy_model(reused_model(reuse, INJECTED, world, _as_record(settings)), checkpoint)
    return {
        "checkpoint": str(checkpoint),
        "reused": str(reuse / INJECTED) if reuse else None,
        "boundary": boundary_check(world, str(checkpoint), out, "test", profile.test_questions),
    }
