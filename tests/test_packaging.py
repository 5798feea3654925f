"""Install metadata: torch is a range that admits the versions vLLM pins, while the Makefile's install
stays on the tested CPU wheel through constraints-cpu.txt."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


def _torch_requirement() -> Requirement:
    # the dependency lines of pyproject.toml (tomllib is Python 3.11+; sleuth supports 3.10)
    deps = re.findall(r'^\s*"(torch[^"]*)",', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    (torch,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return torch


def test_torch_is_a_range_that_admits_vllms_torch() -> None:
    spec = _torch_requirement().specifier
    # vLLM 0.10-0.11 pin torch 2.8.0, vLLM 0.12 pins 2.9.0; sleuth's tests run on 2.13.0
    for version in ("2.8.0", "2.9.0", "2.13.0"):
        assert spec.contains(version), f"torch {version} refused by {spec}"
    assert not any(s.operator == "==" for s in spec)


def test_makefile_install_is_constrained_to_the_tested_cpu_torch() -> None:
    constraints = [
        line.strip()
        for line in (REPO / "constraints-cpu.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert constraints == ["torch==2.13.0"]
    makefile = (REPO / "Makefile").read_text()
    installs = re.findall(r"pip install[^\n]*-e \"\.\[dev\]\"", makefile)
    assert installs and all("-c constraints-cpu.txt" in line for line in installs)


def test_package_data_names_exactly_the_files_that_ship() -> None:
    """pyproject's package-data patterns each match a file under src/sleuth, and every non-Python file there is
    matched: a pattern for a folder that does not exist, or a template left out of the wheel, fails here."""
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "sleuth"
    ]
    package = root / "src" / "sleuth"
    for pattern in patterns:
        assert list(package.glob(pattern)), f"package-data {pattern!r} matches no file under src/sleuth"
    shipped = {p for pattern in patterns for p in package.glob(pattern)}
    data = {
        p
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert data <= shipped, (
        f"not in package-data: {sorted(str(p.relative_to(package)) for p in data - shipped)}"
    )
