"""`trainer.loggers`: a real tiny training run reports its config, every step and a final report to
W&B (offline), MLflow (file store) and TensorBoard, read back through each library's own files."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest

from sleuth.rl.config import recipe_from_dict

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))

STEPS = 2


def _recipe(small_world: Path, out_dir: Path, loggers: list[str], tmp_path: Path) -> dict:
    return {
        "name": "tracked",
        "seed": 0,
        "model": {"policy": "tiny"},
        "data": {"train": str(small_world / "train.jsonl")},
        "retriever": {"index": str(small_world / "bm25")},
        "agent": {
            "loop": "search_r1",
            "max_turns": 1,
            "max_new_tokens_per_turn": 8,
            "max_response_tokens": 64,
            "max_obs_tokens": 16,
        },
        "plugins": ["sleuth_test_rewards"],
        "reward": {"name": "test_token_fraction"},
        "algorithm": {
            "name": "grpo",
            "n": 2,
            "prompts_per_step": 1,
            "minibatch_size": 2,
            "micro_batch_size": 2,
        },
        "trainer": {
            "total_steps": STEPS,
            "save_every": STEPS,
            "out_dir": str(out_dir),
            "loggers": loggers,
            "wandb": {"mode": "offline", "project": "sleuth-test"},
            "mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri(), "experiment": "sleuth-test"},
        },
    }


def _wandb_records(path: Path):
    """Records of a W&B transaction log (`run-*.wandb`): a LevelDB-style log of protobuf `Record`s.
    wandb 0.2x+ ships no Python reader (its Go core writes the file), so the test reads the framing."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):  # FULL or LAST: a complete record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _items(items) -> dict[str, object]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


@pytest.mark.slow
def test_every_tracker_gets_config_steps_and_report(small_world: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sleuth.rl.trainer import train

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    recipe = recipe_from_dict(
        _recipe(small_world, out, ["jsonl", "tensorboard", "wandb", "mlflow"], tmp_path)
    )
    result = train(recipe)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    ids = json.loads((out / "trackers.json").read_text())

    # MLflow: flattened config as params, every metric of every step, config and report artifacts
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["recipe.algorithm.n"] == "2" and run.data.params["recipe.name"] == "tracked"
    for key in ("reward/mean", "lr"):
        history = client.get_metric_history(ids["mlflow"], key)
        assert [(m.step, m.value) for m in history] == [(s["step"], pytest.approx(s[key])) for s in steps]
    artifacts = Path(client.download_artifacts(ids["mlflow"], "report.json", str(tmp_path / "dl")))
    report = json.loads(artifacts.read_text())
    assert report["checkpoint"] == result["checkpoint"] and report["final_metrics"][
        "reward/mean"
    ] == pytest.approx(steps[-1]["reward/mean"])

    # W&B offline: config, one history row per step with the same values, the report in the summary
    (wandb_file,) = (out / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    records = list(_wandb_records(wandb_file))
    config: dict[str, object] = {}
    history, summary = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update(_items(record.run.config.update))
        elif kind == "config":
            config.update(_items(record.config.update))
        elif kind == "history":
            history.append(_items(record.history.item))
        elif kind == "summary":
            summary.update(_items(record.summary.update))
    assert config["recipe"]["algorithm"]["n"] == 2 and config["ranks"] == 1
    assert [(h["_step"], h["reward/mean"]) for h in history] == [
        (s["step"], pytest.approx(s["reward/mean"])) for s in steps
    ]
    assert summary["report/checkpoint"] == result["checkpoint"]
    assert summary["report/final_metrics.reward/mean"] == pytest.approx(steps[-1]["reward/mean"])

    # TensorBoard: every step's scalars, the config and report as text
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [
        (s["step"], pytest.approx(s["reward/mean"])) for s in steps
    ]
    assert {"config/text_summary", "report/text_summary"} <= set(acc.Tags()["tensors"])


def test_resume_continues_the_same_tracker_run(small_world: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from sleuth.rl.trainer import train

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    data = _recipe(small_world, out, ["jsonl", "mlflow"], tmp_path)
    data["trainer"].update(total_steps=1, save_every=1)
    train(recipe_from_dict(data))
    first = json.loads((out / "trackers.json").read_text())["mlflow"]
    data["trainer"]["total_steps"] = 2
    train(recipe_from_dict(data), resume=True)
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == first
    history = MlflowClient((tmp_path / "mlruns").as_uri()).get_metric_history(first, "reward/mean")
    assert [m.step for m in history] == [1, 2]


def test_unknown_logger_and_missing_library_are_clear_errors(
    small_world: Path, tmp_path: Path, monkeypatch
) -> None:
    from sleuth.errors import ConfigError
    from sleuth.rl.loggers import open_loggers

    with pytest.raises(ConfigError, match="unknown logger.*neptune"):
        open_loggers(["jsonl", "neptune"], tmp_path, run_name="x")
    with pytest.raises(ConfigError, match="trainer.loggers"):
        recipe_from_dict(_recipe(small_world, tmp_path, ["jsonl", "comet"], tmp_path))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install"):
        open_loggers(["jsonl", "wandb"], tmp_path, run_name="x")


def _readme_tracker_yaml() -> dict:
    """The `trainer:` YAML block the README shows for the trackers, parsed as written."""
    import re

    import yaml

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [
        b for b in re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL) if "loggers:" in b and "mlflow" in b
    ]
    return yaml.safe_load(block)["trainer"]


@pytest.mark.slow
def test_the_readme_tracker_yaml_works_offline_with_local_stores(
    small_world: Path, tmp_path: Path, monkeypatch
) -> None:
    """No MLFLOW_* or WANDB_* variable, no ~/.netrc: MLflow writes a file store in the run directory
    (mlflow-skinny cannot open MLflow 3's sqlite default) and W&B runs offline."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient

    from sleuth.rl.trainer import train

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.setenv(var, "")  # recorded, so what sleuth sets is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = _readme_tracker_yaml()
    if trainer.get("wandb", {}).get("mode") == "offline":
        trainer["wandb"].pop("mode")  # the default must be offline too
    data = _recipe(small_world, tmp_path / "run", trainer["loggers"], tmp_path)
    data["trainer"] = {**data["trainer"], **trainer}
    out = tmp_path / "run"
    train(recipe_from_dict(data))
    ids = json.loads((out / "trackers.json").read_text())
    run = MlflowClient((out / "mlruns").resolve().as_uri()).get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and "reward/mean" in run.data.metrics
    assert list((out / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_local_defaults_and_what_keeps_them_off(tmp_path: Path, monkeypatch) -> None:
    from sleuth.rl.loggers import mlflow_tracking_uri, wandb_default_mode

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.setenv(var, "")  # recorded, so what sleuth sets is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert mlflow_tracking_uri(tmp_path, None) == (tmp_path.resolve() / "mlruns").as_uri()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    assert mlflow_tracking_uri(tmp_path, "http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # a server needs no file-store switch
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert mlflow_tracking_uri(tmp_path, None) is None  # the variable is MLflow's own to read

    assert wandb_default_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password KEY\n")
    assert wandb_default_mode() is None  # `wandb login` was run: wandb decides
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_default_mode() is None


def test_the_readme_mlflow_read_back_works_in_a_fresh_shell(tmp_path: Path) -> None:
    """The README's read-back line, run as written (a new shell: no MLFLOW_* variable), on a local file
    store like the one sleuth writes; and the UI line names the package that has the server."""
    import os
    import re
    import subprocess
    import sys

    pytest.importorskip("mlflow")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL) if "search_runs" in b]
    read_back = next(line for line in block.splitlines() if "search_runs" in line)
    assert "pip install mlflow " in block and "mlflow ui --backend-store-uri runs/x/mlruns" in block
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    store = tmp_path / "runs" / "x" / "mlruns"
    write = (
        f"import mlflow; mlflow.set_tracking_uri({store.as_uri()!r}); mlflow.set_experiment('sleuth')\n"
        "with mlflow.start_run(run_name='readme'): mlflow.log_metric('reward/mean', 0.25, step=1)"
    )
    subprocess.run(
        [sys.executable, "-c", write],
        env={**env, "MLFLOW_ALLOW_FILE_STORE": "true"},
        check=True,
        capture_output=True,
        timeout=300,
    )
    command = read_back.replace("python -c", f"{sys.executable} -c", 1)
    result = subprocess.run(
        command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "readme" in result.stdout and "0.25" in result.stdout
