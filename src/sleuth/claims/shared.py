"""The first stages of the plain-world claims (r_search, qagent, s3): the world and the trained reader."""

from __future__ import annotations

from sleuth.claims.base import Stage
from sleuth.claims.reuse import reader_stage
from sleuth.claims.steps import build_world


def world_and_reader() -> list[Stage]:
    return [
        Stage("world", lambda run: build_world(run.world, run.profile)),
        Stage(
            "reader",
            lambda run: reader_stage(run.world, run.out / "reader", run.profile, run.reuse, run.console),
        ),
    ]
