"""QAgent (paper 003): <plan>, <search><query>q1</query><query>q2</query></search>, <information>,
<reflection>, <answer>; rollout = paper Algorithm 1.

Each generation stops at </search>, </answer> or EOS. A search runs its queries
(at most 3, top-1 each by default) and appends one <information> block; an
answer ends the rollout; anything else appends a "rethink" prompt. At most 5
action rounds, no forced final answer. The passage set (deduplicated) is what
the agent serves as a submodule.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.base import (
    AgentLoop,
    RolloutState,
    StepOutcome,
    first_action,
    innermost_blocks,
    tag_sequence,
)
from sleuth.agent.oracle_plan import Fact, Plan, find_fact, need_phrase, query_wordings
from sleuth.agent.registry import Method, Reader, register_method
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit, Retriever, passages_to_string

QAGENT_USER_TEMPLATE = """Search for information to answer the given question. You can search as many times as needed if you find you lack some knowledge. You will go through a loop of:
"<plan>xxx</plan>
<search>xxx</search>
<information>xxx</information>
<reflection>xxx</reflection>
<plan>xxx</plan>(if not complete)
<reflection>xxx</reflection>
<answer>xxx</answer>".
You must conduct planning inside <plan> and </plan> first every time you call a search engine.
After planning, you can call a search engine to search multiple queries (no more than 3) by
<search>
<query>query1</query>
<query>query2</query>
<query>queryk</query>
</search>,
and it will return the searched results between <information> and </information>.
After getting information, you must conduct a reflection on the information and place your reflection between the <reflection> and </reflection> tags.
Note that you must plan within <plan> and </plan> before searching, and reflect within <reflection> and </reflection> after receiving information.
Note that each query must be enclosed between <query> and </query>, and all queries must be placed between <search> and </search>, such as <search>
 <query>query1</query>
 <query>query2</query>
 <query>queryk</query>
 </search>.
If the task is not yet complete, begin a new <plan>.
If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer> without detailed illustrations.
For example, <answer>
 xxx
 </answer>.
The answer, "xxx", should be a few short words.
Question: {question}."""

# The paper names a rethink prompt (Algorithm 1, line 18) without giving its text.
QAGENT_RETHINK = (
    "\nMy previous response contains no valid action. I should plan inside <plan> and </plan>, then search "
    "with <search><query>...</query></search>, or give the final answer inside <answer> and </answer>. "
    "Let me rethink.\n"
)

_STRUCTURE = re.compile(r"^(?:plan search information reflection )*(?:plan |reflection )*answer $")


def qagent_format_ok(response_text: str) -> bool:
    """Plan before every search, a reflection after every information block, one final answer."""
    seq = tag_sequence(response_text, ("plan", "search", "information", "reflection", "reflect", "answer"))
    seq = ["reflection" if t == "reflect" else t for t in seq]
    return bool(_STRUCTURE.match("".join(t + " " for t in seq)))


@dataclass
class QAgentLoop(AgentLoop):
    name: ClassVar[str] = "qagent"
    top_k: int = 1  # top-1 passage per query
    max_turns: int = 5
    forced_final_answer: bool = False  # Algorithm 1 just stops
    max_queries: int = 3
    system_template: str | None = None
    user_template: str = QAGENT_USER_TEMPLATE
    invalid_action_message: str = QAGENT_RETHINK

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_queries < 1:
            raise ConfigError(f"qagent: max_queries must be >= 1, got {self.max_queries}")

    def stop_strings(self, state: RolloutState) -> list[str]:
        return ["</search>", "</answer>"]

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        extra = state.traj.extra
        action = first_action(text, ("search", "answer"))
        if action is None:
            return StepOutcome(feedback=self.invalid_action_message, invalid=True)
        tag, content = action
        if tag == "answer":
            return StepOutcome(done=True, finish_reason="answer")
        queries = [q.strip() for q in innermost_blocks(content, "query")]
        if not queries and "<query>" not in content and content.strip():
            # <search>q</search> without <query> tags: one query, noted for the format reward
            queries = [content.strip()]
            extra["search_without_query_tags"] = extra.get("search_without_query_tags", 0) + 1
        empty = sum(1 for q in queries if not q)
        if empty:
            extra["empty_queries"] = extra.get("empty_queries", 0) + empty
        queries = [q for q in queries if q]
        if len(queries) > self.max_queries:
            extra["queries_dropped"] = extra.get("queries_dropped", 0) + len(queries) - self.max_queries
            queries = queries[: self.max_queries]
        if not queries:
            return StepOutcome(feedback=self.invalid_action_message, invalid=True)
        return StepOutcome(queries=queries)

    def finalize(self, state: RolloutState) -> None:
        super().finalize(state)
        traj = state.traj
        traj.extra["format_ok"] = qagent_format_ok(traj.response_text)
        traj.extra["num_passages"] = len(traj.served_context)


# QAgent (paper 003) gives no generator prompt; its reader is FlashRAG's default naive-RAG prompt, the
# toolkit whose generator setup QAgent's baselines follow (an assumption). FlashRAG's reference block
# keeps `format_reference`'s trailing newline.
FLASHRAG_SYSTEM_PROMPT = (
    "Answer the question based on the given document. Only give me the answer and do not output any other words."
    "\nThe following are given documents.\n\n{context}"
)
FLASHRAG_USER_PROMPT = "Question: {question}"


def qagent_reader_prompt(question: str, hits: Sequence[Hit]) -> list[dict]:
    return [
        {"role": "system", "content": FLASHRAG_SYSTEM_PROMPT.format(context=passages_to_string(list(hits)))},
        {"role": "user", "content": FLASHRAG_USER_PROMPT.format(question=question)},
    ]


QAGENT_READER = Reader("qagent", qagent_reader_prompt)


def _qagent_rounds(facts: list[Fact]) -> list[list[int]]:
    """Facts searched together: independent facts (the two sides of a comparison) share a round."""
    if (
        len(facts) == 2
        and facts[0].subject not in (facts[1].subject,)
        and facts[0].answer != facts[1].subject
    ):
        return [[0, 1]]
    if len(facts) == 4 and facts[1].subject == facts[0].answer and facts[3].subject == facts[2].answer:
        return [[0, 2], [1, 3]]
    return [[i] for i in range(len(facts))]


def plan_qagent(
    example: QAExample, facts: list[Fact], retriever: Retriever, loop: QAgentLoop, rng: random.Random
) -> Plan:
    answer = example.golden_answers[0]
    found = [find_fact(f, retriever, loop.top_k, rng) for f in facts]
    turns: list[str] = []
    reflection = ""
    for r, group in enumerate(_qagent_rounds(facts)):
        needs = " and ".join(need_phrase(found[i].fact) for i in group)
        queries = [found[i].query for i in group]
        for i in group:  # a second wording of a single fact, when the query budget allows
            alt = [w for w in query_wordings(found[i].fact, rng) if w != found[i].query]
            if len(queries) < min(2, loop.max_queries) and alt:
                queries.append(alt[0])
        plan = f"<plan>I need to find {needs}.</plan>" if r == 0 else f"<plan>Next I need {needs}.</plan>"
        query_block = "".join(f"<query>{q}</query>\n" for q in queries[: loop.max_queries])
        turns.append(f"{reflection}{plan}\n<search>\n{query_block}</search>")
        reflection = "<reflection>" + " ".join(found[i].fact.statement() for i in group) + "</reflection>\n"
    turns.append(f"{reflection}<answer>{answer}</answer>")
    return Plan(turns, all(ff.found for ff in found), found)


register_method(
    Method(
        loop=QAgentLoop,
        title="a QAgent (plan, several queries, reflect) trained end to end on format x strict EM (stage 1)",
        reader=QAGENT_READER,
        evaluated_by_reader=True,
        default_reward={"name": "qagent_stage1"},
        new_tokens_factor=2,
        oracle_planner=plan_qagent,
    )
)
