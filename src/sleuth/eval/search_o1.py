"""Search-o1 (Li et al., 2025) as a prompted agent loop on the shared rollout engine; no training.

The model writes `<|begin_search_query|>q<|end_search_query|>`; generation stops
there, the query is searched and the documents come back between
`<|begin_search_result|>` and `<|end_search_result|>`; the model then continues
its reasoning. A turn without a search query ends the rollout; the answer is the
last `\\boxed{...}` (Search-o1's answer format), else the last `<answer>` block,
else the last non-empty line of the final turn.

Prompts are the public Search-o1 code's (`get_multiqa_search_o1_instruction`
followed by `get_task_instruction_openqa`, sent as one user message). What is
simplified: Search-o1's "Reason-in-Documents" step (a second model call that
condenses the retrieved pages before they are inserted) is left out, so the raw
top-k documents are inserted, as in Search-R1. That makes this the Search-R1 loop
with Search-o1's prompt, tags and answer format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.base import AgentLoop, Observation, RolloutState, StepOutcome, all_retrieved, last_block
from sleuth.data.formats import QAExample
from sleuth.retrieval.base import Hit

BEGIN_SEARCH_QUERY = "<|begin_search_query|>"
END_SEARCH_QUERY = "<|end_search_query|>"
BEGIN_SEARCH_RESULT = "<|begin_search_result|>"
END_SEARCH_RESULT = "<|end_search_result|>"

SEARCH_O1_INSTRUCTION = (
    "You are a reasoning assistant with the ability to perform web searches to help "
    "you answer the user's question accurately. You have special tools:\n\n"
    "- To perform a search: write <|begin_search_query|> your query here <|end_search_query|>.\n"
    "Then, the system will search and analyze relevant web pages, then provide you with helpful information "
    "in the format <|begin_search_result|> ...search results... <|end_search_result|>.\n\n"
    "You can repeat the search process multiple times if necessary. The maximum number of search attempts "
    "is limited to {max_searches}.\n\n"
    "Once you have all the information you need, continue your reasoning.\n\n"
    "Example:\n"
    'Question: "Alice David is the voice of Lara Croft in a video game developed by which company?"\n'
    "Assistant thinking steps:\n"
    "- I need to find out who voices Lara Croft in the video game.\n"
    "- Then, I need to determine which company developed that video game.\n\n"
    "Assistant:\n"
    "<|begin_search_query|>Alice David Lara Croft voice<|end_search_query|>\n\n"
    "(System returns processed information from relevant web pages)\n\n"
    "Assistant thinks: The search results indicate that Alice David is the voice of Lara Croft in a specific "
    "video game. Now, I need to find out which company developed that game.\n\n"
    "Assistant:\n"
    "<|begin_search_query|>video game developed by Alice David Lara Croft<|end_search_query|>\n\n"
    "(System returns processed information from relevant web pages)\n\n"
    "Assistant continues reasoning with the new information...\n\n"
    "Remember:\n"
    "- Use <|begin_search_query|> to request a web search and end with <|end_search_query|>.\n"
    "- When done searching, continue your reasoning.\n\n"
)
SEARCH_O1_TASK = (
    "Please answer the following question. You should think step by step to solve it.\n\n"
    "Provide your final answer in the format \\boxed{{YOUR_ANSWER}}.\n\n"
    "Question:\n{question}\n\n"
)

_QUERY_RE = re.compile(re.escape(BEGIN_SEARCH_QUERY) + r"(.*?)" + re.escape(END_SEARCH_QUERY), re.DOTALL)
_SPECIAL_RE = re.compile(r"<\|(?:im_end|im_start|endoftext|eot_id|end_of_text)\|>")
_TEXT_RE = re.compile(r"^\\text\{(.*)\}$", re.DOTALL)


def boxed_answer(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (braces matched at any depth; `\\text{x}` unwrapped)."""
    found: str | None = None
    for m in re.finditer(r"\\boxed\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    if found is None:
        return None
    answer = found.strip()
    m = _TEXT_RE.match(answer)
    return (m.group(1) if m else answer).strip()


@dataclass
class SearchO1Loop(AgentLoop):
    name: ClassVar[str] = "search_o1"
    top_k: int = 3
    max_turns: int = 5  # Search-o1's search limit for single-hop QA
    forced_final_answer: bool = True
    system_template: str | None = None
    user_template: str = SEARCH_O1_INSTRUCTION + SEARCH_O1_TASK

    def build_messages(self, example: QAExample, initial_hits: list[list[Hit]]) -> list[dict]:
        # formatted here, not in __post_init__, so that a max_turns override reaches the prompt
        user = self.user_template.replace("{max_searches}", str(self.max_turns))
        user = user.format(question=example.question.strip())
        messages = [{"role": "system", "content": self.system_template}] if self.system_template else []
        return messages + [{"role": "user", "content": user}]

    def stop_strings(self, state: RolloutState) -> list[str]:
        return [END_SEARCH_QUERY]

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        queries = [q.strip() for q in _QUERY_RE.findall(text)]
        if queries and queries[-1]:
            return StepOutcome(queries=[queries[-1]])
        if queries:
            state.traj.extra["empty_queries"] = state.traj.extra.get("empty_queries", 0) + 1
        return StepOutcome(done=True, finish_reason="answer")

    def observe(self, state: RolloutState, outcome: StepOutcome, hits: list[list[Hit]]) -> Observation:
        flat = [h for per_query in hits for h in per_query]
        return Observation(
            f"\n\n{BEGIN_SEARCH_RESULT}\n", self.format_documents(flat).strip(), f"\n{END_SEARCH_RESULT}\n\n"
        )

    def finalize(self, state: RolloutState) -> None:
        traj = state.traj
        text = state.policy_text
        answer = boxed_answer(text)
        source = "boxed"
        if answer is None:
            tagged = last_block(text, "answer")
            answer, source = (tagged.strip(), "answer_tag") if tagged is not None else (None, "last_line")
        if answer is None:
            # what the model wrote after its last search, minus an unfinished query and special tokens
            final = _SPECIAL_RE.sub("", text.rsplit(END_SEARCH_QUERY, 1)[-1])
            lines = [ln.strip() for ln in final.splitlines() if ln.strip() and BEGIN_SEARCH_QUERY not in ln]
            answer = lines[-1] if lines else None
        traj.answer = answer or None
        traj.served_context = all_retrieved(traj)
        traj.extra["answer_source"] = source if traj.answer is not None else "none"
