"""Where a training run reports: `trainer.loggers: [jsonl, tensorboard, wandb, mlflow]`.

Every logger gets the same three things: the run's config once at the start, the metrics of
each step, and a final report when the run ends. jsonl (`metrics.jsonl`, read by `sleuth report`
and the benches) is always on; the others go through their own libraries, so their offline
modes, environment variables (WANDB_*, MLFLOW_*) and UIs work as their users expect.

A run resumed with `--resume` continues the same W&B / MLflow run: their run ids are kept in
`trackers.json` in the run directory.

Local by default, so `pip install 'sleuth[trackers]'` works offline with no server or account:
- MLflow without `tracking_uri` or MLFLOW_TRACKING_URI logs to a file store in `<run>/mlruns`
  (`mlflow ui --backend-store-uri <run>/mlruns`). MLflow 3's default is `sqlite:///mlflow.db`, which
  mlflow-skinny cannot open (no SQLAlchemy), and it refuses file stores unless
  MLFLOW_ALLOW_FILE_STORE is set: sleuth sets it for a local file store it was given or chose,
  unless the variable is already set.
- W&B without `mode` runs offline (`<run>/wandb`, `wandb sync` uploads it) unless WANDB_MODE or
  WANDB_API_KEY is set or `wandb login` stored a key in ~/.netrc.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from sleuth.appendlog import read_appended
from sleuth.errors import ConfigError
from sleuth.run_layout import METRICS, VALIDATION
from sleuth.utils import atomic_write_json, atomic_write_text

LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
TRACKERS_FILE = "trackers.json"
_INSTALL_HINT = "pip install 'sleuth[trackers]' (or pip install {package})"


class RunLogger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_report(self, report: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class JsonlLogger:
    """One JSON line per step in `metrics.jsonl` (or `file_name`: validation.jsonl). Step k = after k updates;
    on resume after `resume_step` updates, lines of later steps will be redone and are dropped."""

    def __init__(self, out_dir: Path, resume_step: int, file_name: str = METRICS):
        self.path = out_dir / file_name
        if self.path.exists():
            # a torn last line (a kill or full disk mid-append) is dropped with a warning, never a crash
            kept = [r for r in read_appended(self.path).records if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log_config(self, config: dict[str, Any]) -> None:
        pass  # run.json holds the config (written by the trainer)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()

    def log_report(self, report: dict[str, Any]) -> None:
        pass  # the trainer's return value and the last line of metrics.jsonl carry it

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, out_dir: Path):
        try:
            # deferred: an optional tracker that imports tensorboard
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                f"trainer.loggers has tensorboard: {_INSTALL_HINT.format(package='tensorboard')}"
            ) from err
        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log_config(self, config: dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_report(self, report: dict[str, Any]) -> None:
        self.writer.add_text("report", "```\n" + json.dumps(report, indent=2, default=str) + "\n```")

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run (`wandb.init`); `mode: offline` writes it under the run directory for `wandb sync`."""

    def __init__(self, out_dir: Path, run_name: str, options: dict[str, Any], run_id: str | None):
        try:
            import wandb  # deferred: an optional tracker that starts a service process on import use
        except ImportError as err:
            raise ConfigError(f"trainer.loggers has wandb: {_INSTALL_HINT.format(package='wandb')}") from err
        options = dict(options)
        if options.get("mode") is None:
            options["mode"] = wandb_default_mode()
        self.run = wandb.init(
            project=options.pop("project"),
            name=options.pop("name", None) or run_name,
            dir=str(out_dir),
            id=run_id,
            resume="allow" if run_id else None,
            **{k: v for k, v in options.items() if v is not None},
        )
        self.run_id = self.run.id

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_report(self, report: dict[str, Any]) -> None:
        self.run.summary.update({f"report/{k}": v for k, v in flatten(report).items()})

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on one parameter value


def wandb_default_mode() -> str | None:
    """ "offline" unless the user set up W&B (WANDB_MODE / WANDB_API_KEY, or a key `wandb login` saved
    in ~/.netrc); None leaves the choice to wandb."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if "api.wandb.ai" in netrc.read_text(errors="replace"):
            return None
    except OSError:
        pass
    return "offline"


def mlflow_tracking_uri(out_dir: Path, configured: str | None) -> str | None:
    """The tracking URI to set: `configured`, else (no MLFLOW_TRACKING_URI) a file store in
    `out_dir/mlruns`; None keeps MLFLOW_TRACKING_URI. A local file store gets MLFLOW_ALLOW_FILE_STORE
    (MLflow 3 refuses file stores without it) unless that variable is already set."""
    if configured:
        uri = configured
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        uri = os.environ["MLFLOW_TRACKING_URI"]
        configured = None
    else:
        uri = configured = (Path(out_dir).resolve() / "mlruns").as_uri()
    scheme = urlparse(uri).scheme
    if scheme in ("", "file") or len(scheme) == 1:  # a path, a file: URI, a Windows drive letter
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return configured


class MlflowLogger:
    """An MLflow run: params (flattened config), metrics per step, the config and report as JSON artifacts."""

    def __init__(self, out_dir: Path, run_name: str, options: dict[str, Any], run_id: str | None):
        try:
            import mlflow  # deferred: an optional tracker with a heavy import
        except ImportError as err:
            raise ConfigError(
                f"trainer.loggers has mlflow: {_INSTALL_HINT.format(package='mlflow')}"
            ) from err
        self.mlflow = mlflow
        uri = mlflow_tracking_uri(out_dir, options.get("tracking_uri"))
        if uri is not None:
            mlflow.set_tracking_uri(uri)
        try:
            experiment = mlflow.set_experiment(options["experiment"])
            self.run = mlflow.start_run(
                run_id=run_id,
                run_name=None if run_id else (options.get("run_name") or run_name),
                experiment_id=None if run_id else experiment.experiment_id,
            )
        except mlflow.exceptions.MlflowException as err:
            raise ConfigError(
                f"trainer.mlflow: could not open an MLflow run at {mlflow.get_tracking_uri()!r}: {err}"
            ) from err
        self.run_id = self.run.info.run_id
        self._params_logged = run_id is not None  # params are write-once in MLflow

    def log_config(self, config: dict[str, Any]) -> None:
        if not self._params_logged:
            params = {
                _MLFLOW_BAD_CHARS.sub("_", key): json.dumps(value, default=str)[:_MLFLOW_PARAM_CHARS]
                if not isinstance(value, str)
                else value[:_MLFLOW_PARAM_CHARS]
                for key, value in flatten(config).items()
            }
            self.mlflow.log_params(params, run_id=self.run_id)
        self.mlflow.log_dict(config, "config.json", run_id=self.run_id)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        named = {_MLFLOW_BAD_CHARS.sub("_", k): float(v) for k, v in metrics.items()}
        self.mlflow.log_metrics(named, step=step, run_id=self.run_id)

    def log_report(self, report: dict[str, Any]) -> None:
        self.mlflow.log_dict(report, "report.json", run_id=self.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


class RunLoggers:
    """Every logger the recipe names, written to together."""

    def __init__(self, loggers: dict[str, RunLogger], validation: JsonlLogger | None = None):
        self.loggers = loggers
        self.validation = validation

    def write_validation(self, step: int, metrics: dict[str, float]) -> None:
        """A validation's metrics: its own jsonl (metrics.jsonl keeps one line per training step); the
        trackers get them at the same step as the training metrics."""
        if self.validation is not None:
            self.validation.log_metrics(step, metrics)
        for name, logger in self.loggers.items():
            if name != "jsonl":
                logger.log_metrics(step, metrics)

    def log_config(self, config: dict[str, Any]) -> None:
        for logger in self.loggers.values():
            logger.log_config(config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.loggers.values():
            logger.log_metrics(step, metrics)

    def finish(self, report: dict[str, Any]) -> None:
        for logger in self.loggers.values():
            logger.log_report(report)
        self.close()

    def close(self) -> None:
        for logger in self.loggers.values():
            logger.close()


def open_loggers(
    names: list[str],
    out_dir: Path,
    *,
    run_name: str,
    resume_step: int = 0,
    wandb_options: dict[str, Any] | None = None,
    mlflow_options: dict[str, Any] | None = None,
) -> RunLoggers:
    """Open the named loggers; tracker run ids are saved in `out_dir/trackers.json` so a resumed run continues them."""
    unknown = sorted(set(names) - set(LOGGER_NAMES))
    if unknown:
        raise ConfigError(
            f"trainer.loggers: unknown logger(s) {', '.join(unknown)}; choose from {', '.join(LOGGER_NAMES)}"
        )
    ids_path = out_dir / TRACKERS_FILE
    # Only a resumed run continues the tracker runs of an earlier one.
    ids: dict[str, str] = json.loads(ids_path.read_text()) if resume_step > 0 and ids_path.exists() else {}
    loggers: dict[str, RunLogger] = {"jsonl": JsonlLogger(out_dir, resume_step)}
    try:
        if "tensorboard" in names:
            loggers["tensorboard"] = TensorBoardLogger(out_dir)
        if "wandb" in names:
            loggers["wandb"] = WandbLogger(
                out_dir, run_name, wandb_options or {"project": "sleuth"}, ids.get("wandb")
            )
        if "mlflow" in names:
            loggers["mlflow"] = MlflowLogger(
                out_dir, run_name, mlflow_options or {"experiment": "sleuth"}, ids.get("mlflow")
            )
    except BaseException:
        RunLoggers(loggers).close()  # a tracker run already opened must not stay open
        raise
    new_ids = {name: logger.run_id for name, logger in loggers.items() if hasattr(logger, "run_id")}
    if new_ids:
        atomic_write_json(ids_path, new_ids)
    # a fresh run (resume_step 0) drops an earlier run's validation before training too
    return RunLoggers(loggers, JsonlLogger(out_dir, resume_step if resume_step > 0 else -1, VALIDATION))


def open_recipe_loggers(recipe: Any, out_dir: Path, resume_step: int) -> RunLoggers:
    """The loggers `recipe.trainer` asks for (`tensorboard: true` counts as listing tensorboard)."""
    trainer = recipe.trainer
    names = list(trainer.loggers) + (["tensorboard"] if trainer.tensorboard else [])
    return open_loggers(
        names,
        out_dir,
        run_name=recipe.name,
        resume_step=resume_step,
        wandb_options=trainer.wandb.model_dump(),
        mlflow_options=trainer.mlflow.model_dump(),
    )
