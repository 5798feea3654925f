"""Staged reward, "learning when to search" (paper 002): <think>, <search>, <information>, <reflect>, <answer>.

The rollout is Search-R1's; what differs is the prompt (paper B.4) and the
structure the format reward checks, computed here as `extra["format_ok"]`:
think, reflect, answer; or think, (search, information, reflect)+, answer.
RC (retrieval count) is `trajectory.retrieval_count`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sleuth.agent.base import RolloutState, count_tag, tag_sequence
from sleuth.agent.oracle_plan import (
    Fact,
    Plan,
    find_fact,
    known_from_memory,
    need_phrase,
    recall_sketch,
    recall_text,
    steps_text,
)
from sleuth.agent.registry import Method, register_method
from sleuth.agent.search_r1 import SearchR1Loop
from sleuth.data.formats import QAExample
from sleuth.retrieval.base import Retriever

STAGED_USER_TEMPLATE = """Please answer the given question by following the structured reasoning protocol below:

1. Always begin with <think>...</think> to provide a brief internal reasoning sketch. - This reasoning must primarily rely on your internal knowledge and reasoning abilities. - If your internal knowledge is sufficient to answer the question, do not assume the need for external tools.
2. If your internal knowledge is sufficient to answer the question: - Provide a concise summary of your reasoning inside <reflect>...</reflect>. - Then give the final answer inside <answer>...</answer>. - Under no circumstances should you generate a <search> block if your internal knowledge is adequate.
3. Only if your internal knowledge is genuinely insufficient to answer the question: - Generate a brief keyword-based search query inside <search>...</search>. The query should be as concise as possible but must include sufficient factual clues, such as names, dates, locations, key concepts, etc. - The query should be a brief description with multiple keywords instead of a natural language question.
4. When the system returns information inside <information>...</information>: - If the information is reliable and sufficient, integrate it with your reasoning inside <reflect>...</reflect>. - Then provide the final concise answer inside <answer>...</answer>.
5. If the retrieved information is insufficient or contradicts your internal knowledge: - Explain the issue within <reflect>...</reflect>. - If necessary, generate a revised <search> query.
6. Final rule: - The final answer must be concise and clear, placed inside <answer></answer>. - Internal reasoning (in <think>) must always be the primary method; tool usage should be a last resort, not the default.

Question: {question}
"""

_STRUCTURE_TAGS = ("think", "search", "information", "reflect", "answer")
_ALLOWED = re.compile(r"^think (?:reflect |(?:search information reflect )+)answer $")


def staged_format_ok(response_text: str) -> bool:
    """True if the complete blocks of the response follow one of the two allowed structures."""
    seq = tag_sequence(response_text, _STRUCTURE_TAGS)
    return bool(_ALLOWED.match("".join(t + " " for t in seq)))


@dataclass
class StagedLoop(SearchR1Loop):
    """Search-R1's action space (search or answer) with the paper's prompt, which adds <reflect>."""

    name: ClassVar[str] = "staged"
    top_k: int = 5  # the paper standardises on top-k 5
    max_turns: int = 5  # paper Table 5
    user_template: str = STAGED_USER_TEMPLATE

    def finalize(self, state: RolloutState) -> None:
        super().finalize(state)
        traj = state.traj
        traj.extra.update(
            format_ok=staged_format_ok(traj.response_text),
            rc=traj.retrieval_count,
            reflect_count=count_tag(state.policy_text, "reflect"),
        )


def plan_staged(
    example: QAExample, facts: list[Fact], retriever: Retriever, loop: StagedLoop, rng: random.Random
) -> Plan:
    answer = example.golden_answers[0]
    if known_from_memory(example):  # the prompt: no <search> block when internal knowledge is adequate
        return Plan(
            [
                f"<think>{recall_sketch(rng)}</think>\n<reflect>{recall_text(facts, answer, rng)}</reflect>\n"
                f"<answer>{answer}</answer>"
            ],
            True,
        )
    found = [find_fact(f, retriever, loop.top_k, rng, keyword_first=True) for f in facts]
    sketch = rng.choice(("I do not know", "My internal knowledge does not cover", "I have no knowledge of"))
    turns = [
        f"<think>{sketch} {need_phrase(found[0].fact)}; I need to search.</think>\n<search>{found[0].query}</search>"
    ]
    for i in range(1, len(found)):
        reflect = steps_text(found, i, answer, rng)
        turns.append(f"<reflect>{reflect}</reflect>\n<search>{found[i].query}</search>")
    turns.append(
        f"<reflect>{steps_text(found, len(found), answer, rng)}</reflect>\n<answer>{answer}</answer>"
    )
    return Plan(turns, all(ff.found for ff in found), found)


def staged_demo_reward(reward: Mapping[str, Any], out: Path, steps: int) -> dict[str, Any]:
    """The demo runs stage 2 for the second half of its steps."""
    return {**reward, "options": {**reward["options"], "switch_step": max(1, steps // 2)}}


register_method(
    Method(
        loop=StagedLoop,
        title="an agent trained with the staged reward (format, query conciseness and diversity, "
        "retrieval-dependent answer reward)",
        aliases=("staged_reward",),
        default_reward={"name": "staged", "options": {"beta": 0.3, "correctness": "f1"}, "encoder": "minilm"},
        new_tokens_factor=2,
        oracle_planner=plan_staged,
        demo_reward=staged_demo_reward,
    )
)
