"""The one-line comparison the demo prints and opens its report with, and the report's home-path masking."""

from __future__ import annotations

from pathlib import Path

import pytest


def _summary() -> dict:
    # 10 questions: the searcher right on 8, naive RAG on 3; hand-made intervals in the per-method rows
    return {
        "methods": {
            "search-r1": {"overall": {"genacc": 0.8, "genacc_ci": [0.5, 1.0], "n": 10}},
            "naive-rag": {"overall": {"genacc": 0.3, "genacc_ci": [0.0, 0.6], "n": 10}},
        },
        "paired": {
            "baseline": "naive-rag",
            "confidence": 0.95,
            "methods": {
                "search-r1": {
                    "genacc": {
                        "metric": "genacc",
                        "n": 10,
                        "mean_a": 0.8,
                        "mean_b": 0.3,
                        "diff": 0.5,
                        "ci": [0.2, 0.8],
                    },
                    "em": {
                        "metric": "em",
                        "n": 10,
                        "mean_a": 0.6,
                        "mean_b": 0.2,
                        "diff": 0.4,
                        "ci": [0.1, 0.7],
                    },
                }
            },
        },
    }


def test_headline_states_both_accuracies_and_the_paired_difference_with_intervals() -> None:
    from sleuth.eval.compare import headline

    assert headline(_summary(), "search-r1") == (
        "GenAcc on 10 questions: search-r1 80.0% [50.0, 100.0] vs naive-rag 30.0% [0.0, 60.0]; difference +50.0 "
        "[+20.0, +80.0] points (95% bootstrap intervals, the difference paired over the same questions)"
    )
    no_genacc = _summary()
    del no_genacc["paired"]["methods"]["search-r1"]["genacc"]
    assert headline(no_genacc, "search-r1").startswith(
        "EM on 10 questions: search-r1 60.0% vs naive-rag 20.0%;"
    )
    assert headline({"methods": {}}, "search-r1") is None and headline(_summary(), "s3") is None


def test_report_opens_with_the_headline_and_hides_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sleuth.eval.report import build_report, without_home

    monkeypatch.setenv("HOME", "/home/ada")
    assert without_home("model /home/ada/.cache/x and /home/adam/y and /home/ada") == (
        "model ~/.cache/x and /home/adam/y and ~"
    )
    plot = '<img src="data:image/png;base64,AB/home/ada/CD=="> /home/ada/x'
    assert without_home(plot) == '<img src="data:image/png;base64,AB/home/ada/CD=="> ~/x'  # images untouched
    page = build_report(
        tmp_path, title="t", notes=["note from /home/ada/runs"], headline="H: 1% vs 2%"
    ).read_text()
    assert page.index('id="headline"') < page.index('id="notes"') < page.index('id="training"')
    assert "H: 1% vs 2%" in page and "/home/ada/" not in page and "~/runs" in page
