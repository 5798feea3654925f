"""Search-R1: <think>, <search>q</search>, <information>docs</information>, <answer>a</answer>.

Per turn the first complete `<search>` or `<answer>` block is the action; anything
else gets the fixed "my previous action is invalid" message. After `max_turns`
rounds, one last generation runs with search disabled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.base import AgentLoop, RolloutState, StepOutcome, count_tag, first_action, split_queries
from sleuth.agent.oracle_plan import Fact, Plan, find_fact, known_from_memory, recall_text, steps_text
from sleuth.agent.registry import Method, register_method
from sleuth.data.formats import QAExample
from sleuth.retrieval.base import Retriever

SEARCH_R1_USER_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

SEARCH_R1_INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)


def search_or_answer(
    state: RolloutState, text: str, invalid_message: str, answer_tag: str = "answer", max_queries: int = 1
) -> StepOutcome:
    """The Search-R1 family's action rule: first complete <search> or <answer> block; empty query is invalid.
    With `max_queries` > 1 the block holds up to that many `##`-separated queries (ParallelSearch); more is an
    invalid action (`extra["too_many_queries"]` counts such turns)."""
    action = first_action(text, ("search", answer_tag))
    if action is None:
        return StepOutcome(feedback=invalid_message, invalid=True)
    tag, content = action
    if tag == answer_tag:
        return StepOutcome(done=True, finish_reason="answer")
    queries = split_queries(content, max_queries)
    if not queries or not queries[0]:
        state.traj.extra["empty_queries"] = state.traj.extra.get("empty_queries", 0) + 1
        return StepOutcome(feedback=invalid_message, invalid=True)
    if len(queries) > max_queries:
        state.traj.extra["too_many_queries"] = state.traj.extra.get("too_many_queries", 0) + 1
        return StepOutcome(feedback=invalid_message, invalid=True)
    return StepOutcome(queries=queries)


@dataclass
class SearchR1Loop(AgentLoop):
    name: ClassVar[str] = "search_r1"
    top_k: int = 3
    max_turns: int = 4
    forced_final_answer: bool = True
    system_template: str | None = None
    user_template: str = SEARCH_R1_USER_TEMPLATE
    invalid_action_message: str = SEARCH_R1_INVALID_ACTION
    multi_query_turns: ClassVar[bool] = True

    def stop_strings(self, state: RolloutState) -> list[str]:
        return ["</search>", "</answer>"]

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        return search_or_answer(
            state, text, self.invalid_action_message, max_queries=self.max_queries_per_turn
        )

    def finalize(self, state: RolloutState) -> None:
        super().finalize(state)
        state.traj.extra["think_count"] = count_tag(state.policy_text, "think")


def plan_search_r1(
    example: QAExample, facts: list[Fact], retriever: Retriever, loop: SearchR1Loop, rng: random.Random
) -> Plan:
    answer = example.golden_answers[0]
    if known_from_memory(example):  # the prompt: answer directly when no external knowledge is needed
        return Plan([f"<think>{recall_text(facts, answer, rng)}</think>\n<answer> {answer} </answer>"], True)
    found = [find_fact(f, retriever, loop.top_k, rng) for f in facts]
    turns = [
        f"<think>{steps_text(found, i, answer, rng)}</think>\n<search> {ff.query} </search>"
        for i, ff in enumerate(found)
    ]
    turns.append(f"<think>{steps_text(found, len(found), answer, rng)}</think>\n<answer> {answer} </answer>")
    return Plan(turns, all(ff.found for ff in found), found)


register_method(
    Method(
        loop=SearchR1Loop,
        title="a Search-R1 agent (think, search, answer) trained on exact match",
        eval_name="search-r1",
        aliases=("searchr1",),
        default_reward={"name": "search_r1_em"},
        new_tokens_factor=2,
        oracle_planner=plan_search_r1,
    )
)
