"""The health panel of a committed GPU run, rendered by sleuth's report code, and the numbers docs/results.md
quotes for it.

    python bench/health_panel.py bench/results/guard40_h100 --run-dir runs/guard40 \
        --out docs/guard40_h100/health.png
    sleuth report runs/guard40          # the HTML report and its one-line verdict per run

From the committed files (run.json, metrics.jsonl, sft_metrics.jsonl) it lays out a run folder as
`sleuth demo` wrote it (RUN_DIR/train/, RUN_DIR/train/sft/), renders `health_figure` of the RL run to a PNG
(written atomically; its "Source" text chunk names the sha256 of the metrics and run.json it was drawn from)
and prints: the verdict `sleuth report` prints, the reward / EM of the first and last 8 steps (mean, SD,
range), the step time split, and, when the folder holds eval_after_partial_em.jsonl, that evaluation's EM
with a 95% Wilson interval.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from sleuth.eval.report import health_figure, load_training_run, training_verdicts
from sleuth.run_layout import METRICS, RUN_INFO, SFT_DIR
from sleuth.utils import atomic_path

TREND_STEPS = 8
PARTIAL_EVAL = "eval_after_partial_em.jsonl"
WILSON_Z = 1.959963984540054  # two-sided 95%


def source_text(results: Path) -> str:
    """What the PNG's Source chunk says: the sha256 of each file the panel is drawn from."""
    return "; ".join(
        f"{name} sha256 {hashlib.sha256((results / name).read_bytes()).hexdigest()}"
        for name in (METRICS, RUN_INFO)
    )


def build_run_dir(results: Path, run_dir: Path) -> Path:
    """RUN_DIR/train/{run.json, metrics.jsonl} and RUN_DIR/train/sft/metrics.jsonl from the committed files;
    returns the RL run's folder."""
    for name in (METRICS, RUN_INFO):
        if not (results / name).is_file():
            raise SystemExit(
                f"error: {results / name} is missing; pass a committed run folder that has "
                f"{METRICS} and {RUN_INFO}"
            )
    train = run_dir / "train"
    (train / SFT_DIR).mkdir(parents=True, exist_ok=True)
    for name in (METRICS, RUN_INFO):
        shutil.copyfile(results / name, train / name)
    if (results / "sft_metrics.jsonl").is_file():
        shutil.copyfile(results / "sft_metrics.jsonl", train / SFT_DIR / METRICS)
    return train


def render_health_png(train: Path, out: Path, source: str) -> None:
    """The RL run's health panel as a PNG at `out`, written atomically."""
    fig = health_figure(load_training_run(train / METRICS, train.parent, []))
    if fig is None:
        raise SystemExit(f"error: {train / METRICS} has no health/ metrics; nothing to draw")
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", metadata={"Source": source})


def wilson_interval(successes: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return centre - half, centre + half


def window_summary(values: Sequence[float]) -> str:
    return (
        f"{statistics.fmean(values):.3f} (SD {statistics.stdev(values):.3f}, "
        f"range {min(values):.3f}-{max(values):.3f})"
    )


def trend_lines(rows: Sequence[dict], keys: Sequence[str] = ("reward/mean", "accuracy/em")) -> list[str]:
    """First vs last TREND_STEPS steps of each key: mean, SD over those steps, range, and the difference."""
    out = []
    for key in keys:
        values = [float(r[key]) for r in rows]
        first, last = values[:TREND_STEPS], values[-TREND_STEPS:]
        out.append(
            f"{key}: steps 1-{TREND_STEPS} {window_summary(first)}; steps {len(values) - TREND_STEPS + 1}-"
            f"{len(values)} {window_summary(last)}; difference "
            f"{statistics.fmean(last) - statistics.fmean(first):+.3f}"
        )
    return out


def time_line(rows: Sequence[dict]) -> str:
    """Median rollout / update / step seconds over the steps that compiled nothing, and what compiling cost."""
    compiled = [r for r in rows if float(r.get("time/decode_compile", 0.0)) > 0]
    plain = [r for r in rows if r not in compiled]
    med = {
        k: statistics.median(float(r[k]) for r in plain) for k in ("time/rollout", "time/update", "time/step")
    }
    return (
        f"time: {sum(float(r['time/step']) for r in rows):.0f} s for {len(rows)} steps; median over the "
        f"{len(plain)} steps without decode compilation: rollout {med['time/rollout']:.1f} s, update "
        f"{med['time/update']:.1f} s, step {med['time/step']:.1f} s; steps "
        f"{[int(r['step']) for r in compiled]} compiled decoding for "
        f"{sum(float(r['time/decode_compile']) for r in compiled):.0f} s"
    )


def partial_eval_line(path: Path) -> str:
    em = [float(json.loads(line)["metrics"]["em"]) for line in path.read_text().splitlines() if line.strip()]
    hits = round(sum(em))
    lo, hi = wilson_interval(hits, len(em))
    return (
        f"final evaluation (partial, {len(em)} questions): EM {hits}/{len(em)} = {100 * hits / len(em):.1f}% "
        f"[{100 * lo:.1f}, {100 * hi:.1f}] (95% Wilson)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="committed run folder (run.json, metrics.jsonl, ...)")
    ap.add_argument(
        "--run-dir", type=Path, required=True, help="where to lay out the run folder for sleuth report"
    )
    ap.add_argument("--out", type=Path, required=True, help="the health panel PNG to write")
    args = ap.parse_args(argv)
    train = build_run_dir(args.results, args.run_dir)
    render_health_png(train, args.out, source_text(args.results))
    print(f"health panel: {args.out}")
    for label, verdict in training_verdicts(args.run_dir):
        print(f"{label}: {verdict}")
    rows = [json.loads(line) for line in (args.results / METRICS).read_text().splitlines() if line.strip()]
    for line in [*trend_lines(rows), time_line(rows)]:
        print(line)
    if (args.results / PARTIAL_EVAL).is_file():
        print(partial_eval_line(args.results / PARTIAL_EVAL))


if __name__ == "__main__":
    main(sys.argv[1:])
