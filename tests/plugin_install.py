"""Install a plugin from plugins/ for one test module, as a recipe's `plugins:` list does (import it), and take
its registrations back afterwards, so tests that list the built-in methods see only those."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import sleuth.agent.registry as method_registry
import sleuth.retrieval.backends as backend_registry
import sleuth.rewards  # noqa: F401  (the built-in rewards registered before the snapshot)
import sleuth.rewards.base as reward_registry
import sleuth.rl.advantages as advantage_registry
import sleuth.rl.losses as loss_registry

PLUGINS = Path(__file__).parents[1] / "plugins"


@contextmanager
def installed(name: str) -> Iterator[ModuleType]:
    if str(PLUGINS) not in sys.path:
        sys.path.insert(0, str(PLUGINS))  # where a user's plugin sits on PYTHONPATH
    with registrations_taken_back(name):
        yield importlib.import_module(name)


@contextmanager
def registrations_taken_back(*modules: str) -> Iterator[None]:
    """Whatever registers while inside (plugin modules imported here or by a recipe's `plugins:` in an in-process
    command) is taken back on leaving, and the `modules` are forgotten, so a later import registers them again."""
    method_registry.loop_names()  # the built-in methods load lazily: registered before the snapshot, kept after it
    registries = (
        method_registry._METHODS,
        method_registry._READERS,
        reward_registry._REGISTRY,
        advantage_registry.ADVANTAGE_ESTIMATORS,
        backend_registry._BACKENDS,
        loss_registry.POLICY_LOSSES,
    )
    saved = tuple(dict(r) for r in registries)
    try:
        yield
    finally:
        for live, before in zip(registries, saved, strict=True):
            live.clear()
            live.update(before)
        for name in modules:
            sys.modules.pop(name, None)
