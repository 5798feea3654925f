"""s3 (paper 000): a searcher that selects documents for a frozen generator.

Begin with search: the question itself is searched (k docs) and shown in the
prompt. Then per turn the searcher may select up to 3 ids of the current window
(`<important_info>[1, 3]</important_info>`), declares
`<search_complete>True|False</search_complete>`, and if not complete emits
`<query>{"query": "..."}</query>`, answered by `<information>`. Only the selected
documents (deduplicated, in order) are served to the generator; a window with no
`<important_info>` contributes all its documents (paper A.5), unless
`include_unselected_windows` is off.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sleuth.agent.base import (
    AgentLoop,
    RolloutState,
    StepOutcome,
    all_retrieved,
    dedup_hits,
    innermost_blocks,
)
from sleuth.agent.oracle_plan import Fact, FoundFact, Plan, find_fact
from sleuth.agent.registry import Method, Reader, register_method
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit, Retriever, s3_generator_context

S3_SEARCHER_PROMPT = """You are a search copilot for a generation model. Based on a user's query and initial searched results, you will first determine if the searched results are enough to produce an answer.

If the searched results are enough, you will use <search_complete>True</search_complete> to indicate that you have gathered enough information for the generation model to produce an answer.

If the searched results are not enough, you will go through a loop of <query> -> <information> -> <important_info> -> <search_complete> -> <query> (if not complete) ..., to help the generation model to generate a better answer with more relevant information searched.

You should show the search query between <query> and </query> in JSON format.

Based on the search query, we will return the top searched results between <information> and </information>. You need to put the doc ids of the important documents (up to 3 documents, within the current information window) between <important_info> and </important_info> (e.g., <important_info>[1, 4]</important_info>).

A search query MUST be followed by a <search_complete> tag if the search is not complete.

After reviewing the information, you must decide whether to continue searching with a new query or indicate that the search is complete. If you need more information, use <search_complete>False</search_complete>. Otherwise, use <search_complete>True</search_complete> to terminate the search.

Note: Only the content between <important_info> will be used by the generation model to produce an answer.

An abstract example of the loop:
<important_info>[1, 2]</important_info>
<search_complete>False</search_complete>
<query>{{"query": "a new, more specific search query"}}</query>
<information>Doc 1(Title: ...) ...</information>
<important_info>[3]</important_info>
<search_complete>True</search_complete>

<question>
{question}
</question>
"""

# s3's data preprocessing puts the question's own search results right after "</question>\n"
S3_INITIAL_INFORMATION = "<information>\n{documents}\n</information>\n"

# The s3 reference's reply to a turn without a usable action: it reopens a query for the searcher.
S3_INVALID_ACTION = (
    "\n\nThe information is not enough to answer the question. Let me dive deeper by generating a brand new "
    "search query between <query> and </query> tags in JSON format:\n<query>\n"
)

_TRUE = {"true", "yes", "1", "y"}


# Longest rejected item kept for the logs; a generation can be a megabyte of one "id".
_MAX_LOGGED_ITEM = 200
# An id longer than this cannot be a window position (and int() refuses past 4,300 digits).
_MAX_ID_DIGITS = 18


def _json_or_none(body: str) -> tuple[Any, bool]:
    """json.loads that turns every failure on generated text into (None, False): malformed JSON,
    over-long integers (ValueError) and nesting deeper than the decoder's stack (RecursionError)."""
    try:
        return json.loads(body), True
    except (ValueError, RecursionError):
        return None, False


def parse_query(raw: str) -> tuple[str, bool]:
    """Query text from a `<query>` block: JSON `{"query": ...}` or, failing that, the raw text.

    Returns (query, parsed_as_json). Never raises."""
    body = raw.strip()
    data, ok = _json_or_none(body)
    if not ok:
        return body, False
    if isinstance(data, dict) and "query" in data:
        q = data["query"]
        if isinstance(q, list):
            q = q[0] if q else ""
        if isinstance(q, str):
            return q.strip(), True
    if isinstance(data, str):
        return data.strip(), True
    return body, False


def _loggable(item: Any) -> Any:
    """A rejected item as it is kept in `traj.extra`: scalars as they are, text cut short, nested
    JSON by its type name (a deeply nested list would not serialise)."""
    if item is None or isinstance(item, (bool, int, float)):
        return item
    if isinstance(item, str):
        return item[:_MAX_LOGGED_ITEM]
    return type(item).__name__


def parse_selection(raw: str, window_size: int, limit: int) -> tuple[list[int], list[Any]]:
    """Doc ids (1-based, within the window) from an `<important_info>` block: (kept ids, rejected items).

    Non-integers, out-of-range ids, repeats and ids beyond `limit` are rejected. Never raises."""
    body = raw.strip()
    data, ok = _json_or_none(body)
    if ok:
        items = data if isinstance(data, list) else [data]
    else:
        # "[1, 3" or "1 and 3": take the numbers that are there, note the malformed block
        numbers = re.findall(r"-?\d+", body)
        items = [int(x) if len(x.lstrip("-")) <= _MAX_ID_DIGITS else x for x in numbers] or [body]
    kept: list[int] = []
    rejected: list[Any] = []
    for item in items:
        ok = isinstance(item, int) and not isinstance(item, bool) and 1 <= item <= window_size
        if ok and item not in kept and len(kept) < limit:
            kept.append(item)
        else:
            rejected.append(_loggable(item))
    return kept, rejected


@dataclass
class S3Loop(AgentLoop):
    name: ClassVar[str] = "s3"
    top_k: int = 8  # documents per search, the initial one included
    max_turns: int = 3
    forced_final_answer: bool = True
    max_selected: int = 3  # ids per <important_info>
    use_selection: bool = True  # ablation "w/o selection": serve everything retrieved
    begin_with_search: bool = True  # ablation "w/o begin with search"
    # paper A.5: a window without <important_info> serves all its docs
    include_unselected_windows: bool = True
    system_template: str | None = None
    user_template: str = S3_SEARCHER_PROMPT
    initial_information_template: str = S3_INITIAL_INFORMATION
    invalid_action_message: str = S3_INVALID_ACTION
    max_continuations: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_selected < 1:
            raise ConfigError(f"s3: max_selected must be >= 1, got {self.max_selected}")

    def stop_strings(self, state: RolloutState) -> list[str]:
        return ["</query>", "</search_complete>"]

    def initial_queries(self, example: QAExample) -> list[str]:
        return [example.question.strip()] if self.begin_with_search else []

    def build_messages(self, example: QAExample, initial_hits: list[list[Hit]]) -> list[dict]:
        content = self.user_template.format(question=example.question.strip())
        if initial_hits:
            docs = self.format_documents([h for hits in initial_hits for h in hits])
            content += self.initial_information_template.format(documents=docs)
        messages = [{"role": "system", "content": self.system_template}] if self.system_template else []
        return messages + [{"role": "user", "content": content}]

    def _select(self, state: RolloutState, text: str) -> None:
        extra = state.traj.extra
        selections: dict[int, list[int]] = state.data.setdefault("selections", {})
        for raw in innermost_blocks(text, "important_info"):
            if not state.windows:
                extra.setdefault("invalid_selection_ids", []).append(_loggable(raw.strip()))
                continue
            w = len(state.windows) - 1
            already = selections.get(w, [])
            ids, rejected = parse_selection(raw, len(state.windows[w]), self.max_selected - len(already))
            selections[w] = already + [i for i in ids if i not in already]
            extra.setdefault("selection_ids", []).append({"window": w, "ids": ids})
            if rejected:
                extra.setdefault("invalid_selection_ids", []).extend(rejected)

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        if state.data.pop("query_reopened", False) and "<query>" not in text.split("</query>")[0]:
            # the previous feedback ended with an open "<query>" tag that this turn closes
            text = "<query>" + text
        self._select(state, text)
        complete = innermost_blocks(text, "search_complete")
        if any(c.strip().lower() in _TRUE for c in complete):
            state.traj.extra["search_complete"] = True
            return StepOutcome(done=True, finish_reason="search_complete")
        queries = innermost_blocks(text, "query")
        if queries:
            query, as_json = parse_query(queries[0])
            if not as_json:
                state.traj.extra["query_not_json"] = state.traj.extra.get("query_not_json", 0) + 1
            if query:
                return StepOutcome(queries=[query])
            state.traj.extra["empty_queries"] = state.traj.extra.get("empty_queries", 0) + 1
        elif complete and text.rstrip().endswith("</search_complete>") and not state.final:
            # "<search_complete>False</search_complete>" ends the generation before the query it announces
            return StepOutcome(continue_generation=True)
        state.data["query_reopened"] = self.invalid_action_message.rstrip().endswith("<query>")
        return StepOutcome(feedback=self.invalid_action_message, invalid=True)

    def finalize(self, state: RolloutState) -> None:
        traj = state.traj
        traj.answer = None  # the searcher never answers; the frozen generator does
        selections: dict[int, list[int]] = state.data.get("selections", {})
        chosen: list[dict] = []
        served: list[dict] = []
        for w, window in enumerate(state.windows):
            ids = selections.get(w)
            picked = [window[i - 1].to_dict() for i in ids] if ids else []
            chosen.extend(picked)
            if ids is None and self.include_unselected_windows:
                served.extend(h.to_dict() for h in window)
            else:
                served.extend(picked)
        traj.selected = dedup_hits(chosen)
        traj.served_context = dedup_hits(served) if self.use_selection else all_retrieved(traj)
        traj.extra.setdefault("search_complete", False)
        traj.extra["use_selection"] = self.use_selection
        traj.extra["begin_with_search"] = self.begin_with_search


# The s3 reader: the s3 code's `generator_llms/local_inst.py` (system message with the contexts, the
# question as the user message; the paper's Fig. 12/13 lay them out slightly differently) and its
# `rag_2.py` context format `Doc {i} (Title: {title})\n{text}\n\n`. sleuth's default reader.
S3_GENERATOR_SYSTEM_PROMPT = (
    "Use the following contexts (some might be irrelevant) on demand:\n"
    "Contexts:\n"
    "{context}\n"
    "\n"
    "Important: You MUST directly answer the question without any other text and thinking."
)


def s3_reader_prompt(question: str, hits: Sequence[Hit]) -> list[dict]:
    return [
        {
            "role": "system",
            "content": S3_GENERATOR_SYSTEM_PROMPT.format(context=s3_generator_context(list(hits))),
        },
        {"role": "user", "content": question},
    ]


S3_READER = Reader("s3", s3_reader_prompt)


# The s3 oracle searches every fact of the question's chain, one search each in chain order, whatever the initial
# window (the question as query) already holds, and selects every supporting passage a window holds: an oracle that
# searched only the facts that window lacked (which it reads off the world's labels) taught a search count the
# searcher cannot infer from the passages, and the searcher stopped early (docs/results.md, the s3 claim: 2.53
# searches on 3-hop chains against search_r1's 3). Off: the short oracle of before (the tests' easy format): only the
# facts the initial window lacks are searched, none when it holds the chain, and only passages not yet selected are.
S3_FULL_ORACLE = True


def plan_s3(
    example: QAExample, facts: list[Fact], retriever: Retriever, loop: S3Loop, rng: random.Random
) -> Plan:
    """Begin with search (the question), then per window: select every supporting passage it holds, at whatever
    rank the retriever put it, and search the next fact of the chain (`S3_FULL_ORACLE`)."""
    window = retriever.search([example.question.strip()], loop.top_k)[0] if loop.begin_with_search else []
    needed = {f.doc_id for f in facts}
    have: set[str] = set()
    turns: list[str] = []
    found_facts: list[FoundFact] = []
    pending: list[Fact] | None = list(facts) if S3_FULL_ORACLE else None
    for _ in range(loop.max_turns + 1):
        # every supporting passage of the window, not only those still missing: selecting just the searched fact's
        # passage, which the retriever ranks first most often, made 76% of the oracle's selections document 1
        wanted = needed if S3_FULL_ORACLE else needed - have
        ids = [i + 1 for i, h in enumerate(window) if h.doc_id in wanted][: loop.max_selected]
        have |= {window[i - 1].doc_id for i in ids}
        select = f"<important_info>{json.dumps(ids)}</important_info>\n" if window else ""
        todo = pending if pending is not None else [f for f in facts if f.doc_id not in have]
        if not todo or len(turns) == loop.max_turns:
            turns.append(f"{select}<search_complete>True</search_complete>")
            break
        ff = find_fact(todo.pop(0), retriever, loop.top_k, rng)
        found_facts.append(ff)
        query = json.dumps({"query": ff.query})
        turns.append(f"{select}<search_complete>False</search_complete>\n<query>{query}</query>")
        window = ff.hits
    return Plan(turns, needed <= have, found_facts)


def s3_demo_reward(reward: Mapping[str, Any], out: Path, steps: int) -> dict[str, Any]:
    """The demo computes the naive-RAG baseline of Gain Beyond RAG once per question, in its run directory."""
    return {**reward, "baseline_cache": str(out / "train" / "naive_rag_cache.jsonl")}


register_method(
    Method(
        loop=S3Loop,
        title="an s3 searcher trained against a frozen generator",
        answers=False,
        reader=S3_READER,
        evaluated_by_reader=True,
        default_reward={
            "name": "s3_gbr",
            "options": {"form": "code", "rag_k": 3, "generator_max_new_tokens": 24, "use_judge": False},
            "generator": "policy-base",
        },
        oracle_planner=plan_s3,
        demo_reward=s3_demo_reward,
    )
)
