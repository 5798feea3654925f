"""One self-contained HTML page for a run directory: training curves, eval tables, trajectories.

The page must open on an offline machine and be safe to share, so plots are embedded as base64
PNG (matplotlib, Agg canvas, no pyplot global state), CSS/JS are inline, and every piece of text
from a run (questions, retrieved documents that may contain `<script>`) goes through jinja's
autoescape or through `highlight_text`, which escapes each segment itself.

A run directory is searched recursively, because a demo run nests a training run and several
eval directories (eval_before/, eval_after/...):
- training: `metrics.jsonl` (+ sibling `run.json`, `rollouts/step_*.jsonl`) from the trainer;
- evaluation: `summary.json` with a "methods" mapping (+ `<method>/predictions.jsonl`) from the harness.

One module per part: `run_data` (what is read), `format` (pure helpers), `figures` (the PNG canvas),
`training_plots` (the training section), `eval_tables` (the evaluation section), `trajectories` (the
trajectory viewer), `page` (the page). Their public names are importable from here.
"""

from __future__ import annotations

from sleuth.eval.report.eval_tables import (
    SCATTER_ACCURACY_PREFERENCE,
    build_table,
    comparison_table,
    dodge,
    eval_tables,
    paired_table,
    plot_scatter,
    scatter_points,
)
from sleuth.eval.report.figures import (
    COLORS,
    new_figure,
    png_data_uri,
)
from sleuth.eval.report.format import (
    AGENT_TAGS,
    LOWER_IS_BETTER,
    MAX_TEXT_CHARS,
    METRIC_ORDER,
    best_indices,
    column_decimals,
    contains_answer,
    ema_smooth,
    format_value,
    highlight_text,
    is_number,
    order_metrics,
    smoothing_weight,
)
from sleuth.eval.report.page import (
    build_report,
    render_report,
    without_home,
)
from sleuth.eval.report.run_data import (
    EvalRun,
    RunData,
    TrainingRun,
    Validation,
    discover,
    load_eval_run,
    load_training_run,
    load_validations,
    read_jsonl,
    validation_change,
    validation_slope,
)
from sleuth.eval.report.training_plots import (
    HEALTH_KEYS,
    filtered_steps,
    guard_thresholds,
    health_figure,
    health_verdict,
    plot_behaviour,
    plot_health,
    plot_memory,
    plot_optimisation,
    plot_rewards,
    plot_time,
    training_verdict,
    training_verdicts,
)
from sleuth.eval.report.trajectories import (
    MAX_TRAJECTORIES,
    collect_trajectories,
    trajectory_view,
)

__all__ = [
    "AGENT_TAGS",
    "COLORS",
    "EvalRun",
    "HEALTH_KEYS",
    "LOWER_IS_BETTER",
    "MAX_TEXT_CHARS",
    "MAX_TRAJECTORIES",
    "METRIC_ORDER",
    "RunData",
    "SCATTER_ACCURACY_PREFERENCE",
    "TrainingRun",
    "Validation",
    "best_indices",
    "build_report",
    "build_table",
    "collect_trajectories",
    "column_decimals",
    "comparison_table",
    "contains_answer",
    "discover",
    "dodge",
    "ema_smooth",
    "eval_tables",
    "filtered_steps",
    "format_value",
    "guard_thresholds",
    "health_figure",
    "health_verdict",
    "highlight_text",
    "is_number",
    "load_eval_run",
    "load_training_run",
    "load_validations",
    "new_figure",
    "order_metrics",
    "paired_table",
    "plot_behaviour",
    "plot_health",
    "plot_memory",
    "plot_optimisation",
    "plot_rewards",
    "plot_scatter",
    "plot_time",
    "png_data_uri",
    "read_jsonl",
    "render_report",
    "scatter_points",
    "smoothing_weight",
    "training_verdict",
    "training_verdicts",
    "trajectory_view",
    "validation_change",
    "validation_slope",
    "without_home",
]
