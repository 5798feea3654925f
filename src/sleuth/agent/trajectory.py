"""A trajectory: everything one rollout of an agent loop produced.

The token view (`response_ids`, `loss_mask`, `logprobs`) is what the trainer
consumes; the semantic view (queries, documents, answer...) is what rewards,
evaluation and reports consume. Both are built at generation time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sleuth.data.formats import iter_json_lines
from sleuth.errors import DataFormatError
from sleuth.utils import atomic_write_text


@dataclass
class Turn:
    """A contiguous span of response tokens: [start, end) in `response_ids`."""

    start: int
    end: int
    role: str  # "policy" (generated, trained) or "env" (inserted by the environment, masked)
    text: str


@dataclass
class Trajectory:
    question_id: str
    question: str
    golden_answers: list[str]
    method: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = policy token, 0 = inserted token
    logprobs: list[float] = field(default_factory=list)  # sampling log-probs, 0.0 on inserted tokens
    turns: list[Turn] = field(default_factory=list)
    prompt_text: str = ""
    response_text: str = ""
    queries: list[str] = field(default_factory=list)
    # one list of hit dicts (sleuth.retrieval.base.Hit.to_dict) per search call
    retrieved: list[list[dict]] = field(default_factory=list)
    selected: list[dict] = field(default_factory=list)  # s3: docs the searcher kept
    evidence: str | None = None  # R-Search: the <original_evidence> block
    answer: str | None = None  # the final answer, None if the agent gave none
    # what a frozen generator is handed when the loop is used as a submodule
    served_context: list[dict] = field(default_factory=list)
    retrieval_count: int = 0
    num_turns: int = 0
    finish_reason: str = ""  # "answer", "search_complete", "max_turns", "length", "no_action"
    # set by the rollout engine for every loop
    group: int = 0  # index of the question in its rollout call (the n samples of a question share it)
    sample: int = 0  # which of the question's n samples
    sampling_round: int = (
        1  # the trainer's draw (DAPO's dynamic sampling draws several); (round, group) is a GRPO group
    )
    invalid_actions: int = 0  # turns that held no recognised action
    forced_final: bool = False  # the last generation was the forced, search-free one
    search_after_limit: bool = False  # that forced generation still asked to search
    obs_truncated_tokens: int = 0  # inserted tokens cut to max_obs_tokens
    logprobs_missing: bool = False  # the backend returned no per-token log-probs
    initial_search: bool = False  # documents were retrieved before the first generation (s3)
    initial_queries: int = (
        0  # how many of `queries` the loop ran before the first generation (not the policy's)
    )
    generation_finish_reasons: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # loop-specific flags (format checks...)
    rewards: dict[str, float] = field(default_factory=dict)  # filled by the reward function
    # one per policy turn when the reward gives per-turn rewards (RewardResult.turn_rewards); else empty
    turn_rewards: list[float] = field(default_factory=list)

    @property
    def num_policy_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def num_env_tokens(self) -> int:
        return len(self.loss_mask) - self.num_policy_tokens

    def policy_text_spans(self) -> list[str]:
        return [t.text for t in self.turns if t.role == "policy"]

    def policy_turn_ends(self) -> list[int]:
        """The exclusive end, in `response_ids`, of each policy turn: where a turn's reward is put."""
        return [t.end for t in self.turns if t.role == "policy" and t.end > t.start]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = dict(d)
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        extra = dict(d.get("extra") or {})
        for name in ENGINE_FIELDS:  # files written before these were typed fields kept them in `extra`
            if name in extra and name not in d:
                d[name] = extra.pop(name)
        d["extra"] = extra
        if isinstance(d.get("group"), str):  # the trainer once stored "round:group"
            round_, _, group = d["group"].partition(":")
            d["sampling_round"], d["group"] = int(round_), int(group or 0)
        return cls(**d)


ENGINE_FIELDS = (
    "group",
    "sample",
    "invalid_actions",
    "forced_final",
    "search_after_limit",
    "obs_truncated_tokens",
    "logprobs_missing",
    "initial_search",
    "initial_queries",
    "generation_finish_reasons",
)


def write_trajectories(path: str | Path, trajectories: Iterable[Trajectory]) -> None:
    """Write JSONL atomically (temp file then rename), so a crash never leaves half a file."""
    lines = [json.dumps(t.to_dict(), ensure_ascii=False) for t in trajectories]
    atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))


def read_trajectories(path: str | Path) -> Iterator[Trajectory]:
    for lineno, rec in iter_json_lines(path, "trajectory file"):
        try:
            yield Trajectory.from_dict(rec)
        except (TypeError, KeyError, AttributeError) as err:
            raise DataFormatError(str(path), lineno, f"not a trajectory record: {err}") from err
