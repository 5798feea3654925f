"""The page: render every section into one self-contained HTML file (`build_report`)."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape

from sleuth.errors import ConfigError
from sleuth.eval.report.eval_tables import (
    comparison_table,
    eval_tables,
    paired_table,
    plot_scatter,
    scatter_points,
)
from sleuth.eval.report.run_data import RunData, TrainingRun, discover, validation_change
from sleuth.eval.report.training_plots import (
    _BEHAVIOUR_KEYS,
    _OPTIM_KEYS,
    _TIME_KEYS,
    plot_behaviour,
    plot_health,
    plot_memory,
    plot_optimisation,
    plot_rewards,
    plot_time,
    training_verdict,
)
from sleuth.eval.report.trajectories import MAX_TRAJECTORIES, collect_trajectories
from sleuth.utils import atomic_write_text


def _run_info(run: TrainingRun) -> list[tuple[str, str]]:
    recipe = run.recipe
    steps_done = run.rows[-1]["step"] if run.rows else 0
    # an SFT folder's steps are sft.json's, not the recipe's RL steps
    total = (
        run.info.get("steps")
        if run.info.get("kind") == "sft"
        else (recipe.get("trainer") or {}).get("total_steps")
    )
    info = [
        ("recipe", recipe.get("name")),
        ("model", (recipe.get("model") or {}).get("policy")),
        ("model path", run.info.get("model_path")),
        ("loop", (recipe.get("agent") or {}).get("loop")),
        ("reward", (recipe.get("reward") or {}).get("name")),
        ("algorithm", (recipe.get("algorithm") or {}).get("name")),
        ("steps", f"{steps_done} / {total}" if total else str(steps_done)),
        ("device", run.info.get("device")),
        ("SFT records", run.info.get("records") if run.info.get("kind") == "sft" else None),
    ]
    return [(k, str(v)) for k, v in info if v not in (None, "")]


def _config_items(config: dict) -> list[tuple[str, str]]:
    items = []
    for k, v in config.items():
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        items.append((str(k), text if len(text) <= 200 else text[:200] + "…"))
    return items


def _template_env():
    return Environment(
        loader=PackageLoader("sleuth.eval", "templates"),
        autoescape=select_autoescape(["html"], default_for_string=True, default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_report(data: RunData, title: str | None = None, notes: list[str] | None = None,
                  max_trajectories: int = MAX_TRAJECTORIES, headline: str | None = None) -> str:  # fmt: skip
    """The page as a string (no file written); `headline`, if given, opens it under the title."""
    training = []
    for run in data.training:
        training.append(
            {
                "label": run.label,
                "info": _run_info(run),
                "has_run_json": bool(run.info),
                "n_steps": len(run.rows),
                "validation": validation_change(run.validations),
                "verdict": training_verdict(run),
                "plots": [
                    (name, uri)
                    for name, uri in (
                        ("rewards", plot_rewards(run)),
                        ("behaviour", plot_behaviour(run)),
                        ("optimisation", plot_optimisation(run)),
                        ("health", plot_health(run)),
                        ("time", plot_time(run)),
                        ("memory", plot_memory(run)),
                    )
                    if uri
                ],
                "missing": [
                    name
                    for name, keys in (
                        ("reward", ("reward/mean",)),
                        ("accuracy / retrieval", _BEHAVIOUR_KEYS),
                        ("KL / entropy / loss", _OPTIM_KEYS),
                        ("time", _TIME_KEYS),
                    )
                    if not set(keys) & run.numeric_keys()
                ],
            }
        )
    evals = [
        {
            "label": e.label,
            "path": str(e.path),
            "config": _config_items(e.config),
            "tables": eval_tables(e),
            "paired": paired_table(e),
            "n_predictions": {m: len(r) for m, r in e.predictions.items()},
        }
        for e in data.evals
    ]
    metric, points = scatter_points(data.evals)
    scatter = plot_scatter(metric, points) if points else None
    views, total, sources = collect_trajectories(data, max_trajectories)
    if title is None:
        names = [r.recipe.get("name") for r in data.training if r.recipe.get("name")]
        title = f"sleuth report: {names[0] if names else data.root.resolve().name}"
    page = (
        _template_env()
        .get_template("report.html")
        .render(
            title=title,
            headline=headline,
            run_dir=str(data.root),
            generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            notes=[n for n in (notes or []) if n and n.strip()],
            training=training,
            evals=evals,
            comparison=comparison_table(data.evals),
            scatter=scatter,
            scatter_metric=metric,
            scatter_points=points,
            trajectories=views,
            n_trajectories_total=total,
            trajectory_sources=sources,
            max_trajectories=max_trajectories,
            warnings=data.warnings,
        )
    )
    return page


def without_home(text: str) -> str:
    """`text` with the home directory written as `~`: a shared report should not show the user's paths
    (model caches, checkpoints under $HOME)."""
    home = str(Path.home()).rstrip("/")
    if len(home) <= 1:  # HOME=/ : nothing to hide
        return text
    # data: URIs (the embedded plots) are left alone: base64 may spell the home path by chance
    pattern = re.compile(r"(data:[^\"'\s]*)|" + re.escape(home) + r"(?=/|\b|$)")
    return pattern.sub(lambda m: m.group(1) or "~", text)


GENERATOR_MARK = '<meta name="generator" content="sleuth report">'
FALLBACK_NAME = "sleuth_report.html"


def _written_by_us(path: Path) -> bool:
    """Whether `path` is absent or a page this function wrote (its generator mark in the head), so
    overwriting it loses nothing another command made (a claim report of `sleuth reproduce`)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(4096).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return True
    except IsADirectoryError:
        return False
    return GENERATOR_MARK in head


def _report_path(run_dir: Path, out: str | Path | None) -> Path:
    """Where the page goes: `out`, else RUN_DIR/report.html, else (that file being another command's report,
    e.g. `sleuth reproduce`'s claim table) RUN_DIR/sleuth_report.html. Never over another command's page."""
    candidates = [Path(out)] if out is not None else [run_dir / "report.html", run_dir / FALLBACK_NAME]
    for path in candidates:
        if _written_by_us(path):
            return path
    raise ConfigError(
        f"{candidates[-1]} exists and was not written by `sleuth report` (another command's report, e.g. "
        "`sleuth reproduce`'s claim table); pass another --out or move that file away"
    )


def build_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    title: str | None = None,
    notes: list[str] | None = None,
    max_trajectories: int = MAX_TRAJECTORIES,
    headline: str | None = None,
) -> Path:
    """Write the HTML report for `run_dir` (default `run_dir/report.html`, or `run_dir/sleuth_report.html`
    where report.html is another command's page) atomically; return its path. Never overwrites a page
    another command wrote (ConfigError naming it).
    `headline`: a line the page opens with (the demo's trained-searcher-vs-naive-RAG comparison)."""
    if max_trajectories < 0:
        raise ConfigError(f"max_trajectories must be >= 0, got {max_trajectories}")
    data = discover(run_dir)
    page = without_home(
        render_report(data, title=title, notes=notes, max_trajectories=max_trajectories, headline=headline)
    )
    out_path = _report_path(Path(run_dir), out)
    atomic_write_text(out_path, page)
    # The temp file behind the atomic write is private (0600); a report is meant to be shared.
    umask = os.umask(0)
    os.umask(umask)
    out_path.chmod(0o666 & ~umask)
    return out_path
