"""The paper-scale rehearsal's loop (bench/paper_scale.py): Search-R1's, except that a turn without an action
searches anyway, with the question as its query.

Random weights never write `<search>`, so under Search-R1's own loop every turn would get the invalid-action
feedback and no retrieval would run. Here every turn that is not an answer ends in a search, so retrieval,
observation insertion and the growing context are exercised as in a real run. Loaded as a method plugin
(`reward.plugins: [sleuth_rehearsal]`, with bench/ on PYTHONPATH).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.base import RolloutState, StepOutcome
from sleuth.agent.registry import Method, register_method
from sleuth.agent.search_r1 import SearchR1Loop


@dataclass
class RehearsalLoop(SearchR1Loop):
    name: ClassVar[str] = "search_r1_rehearsal"
    # Search-R1's late-training shape (paper_scale.py --shape search-r1-late): each trajectory takes one of these
    # turn counts (drawn from its question id and sample, so ragged across a batch), searching in every turn but
    # its last, which ends it as an answer would. Empty: every turn runs to max_turns (the upper-bound rehearsal).
    turns_drawn: tuple[int, ...] = ()

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        if self.turns_drawn:
            key = zlib.crc32(f"{state.example.id}/{state.sample}".encode())
            if state.turns_taken + 1 >= self.turns_drawn[key % len(self.turns_drawn)]:
                return StepOutcome(done=True, finish_reason="answer")
        outcome = super().act(state, text)
        if outcome.invalid:  # the scripted query stands in for the action a trained model would write
            state.traj.extra["scripted_searches"] = state.traj.extra.get("scripted_searches", 0) + 1
            return StepOutcome(queries=[state.example.question])
        return outcome


register_method(
    Method(
        loop=RehearsalLoop,
        title="Search-R1's loop with a scripted search in every turn (benchmarks)",
        default_reward={"name": "search_r1_em"},
        new_tokens_factor=2,
    )
)
