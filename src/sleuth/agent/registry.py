"""Loop registry: `get_loop("s3", top_k=5)` builds a loop with the papers' defaults overridden by config."""

from __future__ import annotations

from typing import Any

from sleuth.agent.base import AgentLoop
from sleuth.errors import ConfigError


def _loops() -> dict[str, type[AgentLoop]]:
    from sleuth.agent.qagent import QAgentLoop
    from sleuth.agent.r_search import RSearchLoop
    from sleuth.agent.s3 import S3Loop
    from sleuth.agent.search_r1 import SearchR1Loop
    from sleuth.agent.staged import StagedLoop

    return {cls.name: cls for cls in (SearchR1Loop, S3Loop, RSearchLoop, StagedLoop, QAgentLoop)}


def loop_names() -> list[str]:
    return sorted(_loops())


def get_loop(name: str, **cfg: Any) -> AgentLoop:
    loops = _loops()
    key = name.strip().lower().replace("-", "_")
    aliases = {"searchr1": "search_r1", "rsearch": "r_search", "staged_reward": "staged"}
    key = aliases.get(key, key)
    if key not in loops:
        raise ConfigError(f"unknown agent loop {name!r}; choose one of: {', '.join(sorted(loops))}")
    cls = loops[key]
    allowed = cls.config_fields()
    unknown = sorted(set(cfg) - set(allowed))
    if unknown:
        raise ConfigError(
            f"loop {key!r} has no option(s) {', '.join(unknown)}; its options are: {', '.join(allowed)}"
        )
    return cls(**cfg)
