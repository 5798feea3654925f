"""Evaluation: `evaluate(methods, examples, retriever, model, ...)` and the `sleuth eval` command.

Names are loaded lazily so that importing the package (the CLI does) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "evaluate": "sleuth.eval.harness",
    "EvalConfig": "sleuth.eval.harness",
    "METHODS": "sleuth.eval.harness",
    "load_eval_data": "sleuth.eval.harness",
    "parse_methods": "sleuth.eval.harness",
    "score_predictions": "sleuth.eval.harness",
    "summary_markdown": "sleuth.eval.harness",
    "SearchO1Loop": "sleuth.eval.search_o1",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sleuth.eval' has no attribute {name!r}")
