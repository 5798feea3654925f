"""`sleuth eval`'s console summary stays readable in an 80-column terminal or a log file: no cell is cut
to an ellipsis, every value of summary.md appears, and no line is wider than the console."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from rich.console import Console

from sleuth.eval.commands import print_summary
from sleuth.eval.harness import summary_markdown, summary_rows

SUMMARY = {
    "config": {"model": "tiny"},
    "methods": {
        method: {
            dataset: {
                "n": 100,
                "em": 0.1234 + i / 10,
                "cover_em": 0.5,
                "f1": 0.25 + j / 100,
                "span_check": 0.4,
                "genacc": None,
                "judge": 0.75,
                "retrieval_count": 2.5,
                "input_tokens": 12345.0,
                "output_tokens": 321.0,
                "latency_s": 1.25,
            }
            for j, dataset in enumerate(["nq", "hotpotqa", "overall"])
        }
        for i, method in enumerate(["naive-rag", "search-r1", "r-search"])
    },
}


def _render(width: int, terminal: bool) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=terminal, color_system=None)
    header, rows = summary_rows(SUMMARY)
    print_summary(console, "sleuth eval -> out  (1.0 s)", header, rows)
    return buf.getvalue()


def _markdown_cells() -> list[list[str]]:
    lines = [line for line in summary_markdown(SUMMARY).splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def test_narrow_console_shows_every_value_without_ellipsis() -> None:
    for terminal in (True, False):
        text = _render(80, terminal)
        assert "…" not in text
        assert max(len(line) for line in text.splitlines()) <= 80
        header, rows = summary_rows(SUMMARY)
        assert len(rows) == len(_markdown_cells())  # every row of summary.md
        for method, dataset, n, *values in rows:
            block = re.search(
                rf"^{re.escape(method)} / {re.escape(dataset)} \(n={n}\)\n((?:  .*\n)+)", text, re.M
            )
            assert block, (method, dataset)
            flat = " ".join(line.strip() for line in block.group(1).splitlines())
            at = 0
            for name, value in zip(header[3:], values, strict=True):  # every value, in order, beside its name
                at = flat.index(f"{name}: {value}", at) + 1


def test_wide_console_gets_the_table() -> None:
    text = _render(200, True)
    assert "…" not in text
    header = summary_rows(SUMMARY)[0]
    (header_line,) = [line for line in text.splitlines() if "method" in line and "dataset" in line]
    assert all(name in header_line for name in header)
    assert sum("search-r1" in line for line in text.splitlines()) == 3  # one table row per dataset


def test_cli_summary_piped_at_80_columns(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sleuth.cli import app
    from sleuth.llm.registry import tiny_model_dir

    data = tmp_path / "mini.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": q, "golden_answers": ["x"]}) + "\n"
            for i, q in enumerate(["What is the capital of Varonia?", "Who directed Blue Harbor?"])
        )
    )
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "-m",
            "direct,cot",
            "--data",
            str(data),
            "--model",
            str(tiny_model_dir()),
            "--out",
            str(out),
            "--max-new-tokens",
            "4",
            "--answer-max-new-tokens",
            "4",
        ],
        env={"COLUMNS": "80"},
    )
    assert res.exit_code == 0, res.output
    report = res.output[res.output.index("sleuth eval -> ") :]  # after the progress bars
    assert "…" not in report
    assert max(len(line) for line in report.splitlines()) <= 80
    summary = json.loads((out / "summary.json").read_text())
    header, rows = summary_rows(summary)
    for row in rows:
        assert f"{row[0]} / {row[1]} ({header[2]}={row[2]})\n  {header[3]}: {row[3]}   " in report
    assert "| method | dataset |" in (out / "summary.md").read_text()  # the full table stays in summary.md
