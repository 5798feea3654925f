"""Evaluation: `evaluate(methods, examples, retriever, model, ...)` and the `sleuth eval` command.

Names are loaded lazily so that importing the package (the CLI does) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "evaluate": "sleuth.eval.harness",
    "EvalConfig": "sleuth.eval.config",
    "METHODS": "sleuth.eval.methods",
    "load_eval_data": "sleuth.eval.questions",
    "parse_methods": "sleuth.eval.methods",
    "score_predictions": "sleuth.eval.predictions",
    "summary_markdown": "sleuth.eval.summary",
    "SearchO1Loop": "sleuth.eval.search_o1",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sleuth.eval' has no attribute {name!r}")
