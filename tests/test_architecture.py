"""Structural rules of issue 12: what a method is lives in the registry, not in rl/, eval/ or serve/."""

from __future__ import annotations

import ast
from pathlib import Path

from sleuth.agent.registry import methods

SRC = Path(__file__).resolve().parent.parent / "src" / "sleuth"


def _method_names() -> set[str]:
    names: set[str] = set()
    for m in methods():
        names |= {m.name, m.display_name, *m.aliases}
    return names


def test_no_method_name_string_tests_outside_the_methods() -> None:
    """No `x == "s3"`, `x in ("s3", ...)` or a table keyed by a method's name in rl/, eval/ or serve/."""
    names = _method_names()
    found = []
    for floor in ("rl", "eval", "serve"):
        for path in (SRC / floor).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Compare):
                    consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                    found += [f"{path.name}:{c.lineno} compares with {c.value!r}" for c in consts]
                if isinstance(node, ast.Dict):
                    found += [f"{path.name}:{k.lineno} keys a table by {k.value!r}" for k in node.keys
                              if isinstance(k, ast.Constant) and k.value in names]
    assert not found, found


def test_the_trainer_stays_small() -> None:
    assert len((SRC / "rl" / "trainer.py").read_text(encoding="utf-8").splitlines()) <= 500


def test_the_registry_finds_the_rule_breakers() -> None:
    """The check above can fail: a method-name comparison is found in a snippet."""
    names = _method_names()
    tree = ast.parse('if loop != "s3":\n    pass\n')
    assert any(isinstance(c, ast.Constant) and c.value in names for c in ast.walk(tree))
