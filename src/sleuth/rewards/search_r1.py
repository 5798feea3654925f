"""Search-R1 rewards.

"search_r1_em": exact match of the last `<answer>` the policy wrote (never the prompt's
example, never a document's text).

"search_r1_format_em": the format-aware variant of the public Search-R1 code
(verl/utils/reward_score/qa_em_format.py, `compute_score_em`). With the structure checked by
`is_valid_sequence` -- think, then (search, information, think)*, then answer, nothing but
whitespace between blocks -- and `retrieval_correct` = some gold answer is a substring of a
retrieved information block (normalised), the reward is:

    no answer:      valid ? structure_format_score (+ retrieval_score if retrieval_correct) : 0
    answer correct: valid ? score : score - structure_format_score
    answer wrong:   valid ? structure_format_score (+ retrieval_score if retrieval_correct)
                          : final_format_score

Defaults 0.2 / 0.1 / 0.1 are the values annotated in that code's comments (0.3 = 0.2 + 0.1,
0.8 = 1 - 0.2, 0.1). Differences from the code, on purpose: the answer is read from policy text
only (the code needs >= 2 `<answer>` matches because its string includes the prompt's example),
and an inserted span counts as an information block only if it is one; any other inserted text
(the "invalid action" message) breaks the structure, as it does in the code.

`answer_source: upstream` (both rewards) reads the answer as the code's `extract_solution` does:
the last `<answer>` block of prompt + response text, and none when there are fewer than two. The
prompt holds two (`<answer> and </answer>`, `<answer> Beijing </answer>`), so a response without an
answer is scored as answering "Beijing". `policy` (default) scores it as no answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.trajectory import Trajectory
from sleuth.rewards.base import Reward, RewardResult, RewardServices, check_choice, register_reward
from sleuth.rewards.metrics import exact_match, extract_answer, normalize_answer
from sleuth.rewards.structure import parse_response, policy_answer, symbol_string

ANSWER_SOURCES = ("policy", "upstream")

_SEARCH_R1_STRUCTURE = re.compile(r"T(?:SIT)*A")


def search_r1_valid_sequence(traj: Trajectory) -> bool:
    parsed = parse_response(
        traj, tags=("think", "search", "information", "answer"), env_tags=("information",)
    )
    if not parsed.well_formed:
        return False
    symbols = symbol_string(parsed, {"think": "T", "search": "S", "answer": "A"}, {"information": "I"})
    return _SEARCH_R1_STRUCTURE.fullmatch(symbols) is not None


def _information_contents(traj: Trajectory) -> list[str]:
    parsed = parse_response(traj, tags=("answer",), env_tags=("information",))
    out = []
    for s in parsed.segments:
        if s.kind == "env" and s.tag == "information":
            inner = s.content.strip()
            out.append(inner[len("<information>") : -len("</information>")])
    return out


def search_r1_upstream_answer(traj: Trajectory) -> str | None:
    """Search-R1's `extract_solution` (qa_em.py, qa_em_format.py) on the decoded prompt + response:
    `re.finditer(r"<answer>(.*?)</answer>", ..., re.DOTALL)`, None for 0 or 1 matches, else the
    last match stripped."""
    return extract_answer(traj.prompt_text + traj.response_text, "upstream")


def search_r1_answer(traj: Trajectory, source: str) -> str | None:
    """The answer a Search-R1 reward scores: the policy's last `<answer>` ("policy") or the
    upstream code's reading ("upstream")."""
    return search_r1_upstream_answer(traj) if source == "upstream" else policy_answer(traj)


def retrieval_contains_gold(traj: Trajectory) -> bool:
    golds = [normalize_answer(g) for g in traj.golden_answers]
    golds = [g for g in golds if g]
    return any(g in normalize_answer(block) for block in _information_contents(traj) for g in golds)


@register_reward("search_r1_em")
@dataclass
class SearchR1EM(Reward):
    components: ClassVar[tuple[str, ...] | None] = ("em", "has_answer")
    answer_source: str = "policy"  # "upstream": the code's extract_solution (module docstring)

    def __post_init__(self) -> None:
        check_choice("answer_source", self.answer_source, ANSWER_SOURCES)

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        results = []
        for traj in trajs:
            answer = search_r1_answer(traj, self.answer_source)
            em = exact_match(answer, traj.golden_answers)
            results.append(RewardResult(em, {"em": em, "has_answer": float(answer is not None)}))
        return results


@register_reward("search_r1_format_em")
@dataclass
class SearchR1FormatEM(Reward):
    components: ClassVar[tuple[str, ...] | None] = ("em", "format_valid", "retrieval_hit", "has_answer")
    structure_format_score: float = 0.2
    final_format_score: float = 0.1
    retrieval_score: float = 0.1
    score: float = 1.0
    answer_source: str = "policy"  # "upstream": the code's extract_solution (module docstring)

    def __post_init__(self) -> None:
        check_choice("answer_source", self.answer_source, ANSWER_SOURCES)

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        results = []
        for traj in trajs:
            answer = search_r1_answer(traj, self.answer_source)
            valid = search_r1_valid_sequence(traj)
            retrieval_correct = valid and retrieval_contains_gold(traj)
            em = exact_match(answer, traj.golden_answers)
            format_part = self.structure_format_score + (self.retrieval_score if retrieval_correct else 0.0)
            if answer is None:
                total = format_part if valid else 0.0
            elif em:
                total = self.score if valid else self.score - self.structure_format_score
            else:
                total = format_part if valid else self.final_format_score
            results.append(
                RewardResult(
                    total,
                    {
                        "em": em,
                        "format_valid": float(valid),
                        "retrieval_hit": float(retrieval_correct),
                        "has_answer": float(answer is not None),
                    },
                )
            )
        return results
