"""Import a script of bench/ (not a package: run as `python bench/NAME.py`) as a module for a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as the module `bench_NAME` (registered in sys.modules, which dataclasses need); bench/ joins
    sys.path, as when the script runs, so its `import _common` resolves."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    key = f"bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no bench/{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
