"""The s3 oracle's plan (issue 42 item 2): one search per fact of the chain, whatever the question's own window
holds, and every supporting passage a window holds selected at the rank the retriever gave it."""

from __future__ import annotations

import json
import random
import re

from sleuth.agent import get_loop
from sleuth.agent import s3 as s3_method
from sleuth.agent.oracle_plan import question_facts
from sleuth.agent.s3 import plan_s3
from sleuth.data.formats import QAExample
from sleuth.retrieval.base import Hit

# a 2-hop chain: Ann --born_in--> Oslo --mayor--> Bo; passages "p1" and "p2" state the two facts
QUESTION = QAExample(
    "q",
    "Who is the mayor of the city where Ann was born?",
    ["Bo"],
    {"supporting_ids": ["p1", "p2"], "chain": ["Ann", "Oslo", "Bo"], "relations": ["born_in", "mayor"]},
)


def _hit(doc: str) -> Hit:
    return Hit(doc, doc, f"passage {doc}", 1.0)


class Ranked:
    """A retriever whose windows are fixed: the question's own search ranks both supporting passages low (3rd and
    5th); any search naming Ann ranks p1 2nd, any other ranks p2 4th."""

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        def window(query: str) -> list[str]:
            if query == QUESTION.question:
                return ["d1", "d2", "p1", "d3", "p2"]
            return ["d4", "p1", "d5", "d6"] if "Ann" in query else ["d7", "d8", "d9", "p2"]

        return [[_hit(d) for d in window(q)][:k] for q in queries]


def _selections(turns: list[str]) -> list[list[int]]:
    return [json.loads(m) for t in turns for m in re.findall(r"<important_info>(.*?)</important_info>", t)]


def test_every_fact_is_searched_and_selections_follow_the_passages_not_rank_one() -> None:
    loop = get_loop("s3", top_k=5, max_turns=3)
    plan = plan_s3(QUESTION, question_facts(QUESTION), Ranked(), loop, random.Random(0))
    # the question's window already holds the whole chain, yet each fact is searched once, in chain order
    assert [t.count("<query>") for t in plan.turns] == [1, 1, 0] and plan.found_all
    assert [f.fact.doc_id for f in plan.facts] == ["p1", "p2"]
    # p1 and p2 where they are ranked: 3rd and 5th, then 2nd, then 4th; never a positional [1]
    assert _selections(plan.turns) == [[3, 5], [2], [4]]
    assert plan.turns[-1].endswith("<search_complete>True</search_complete>")


def test_the_short_oracle_searches_only_what_the_first_window_lacks(monkeypatch) -> None:
    monkeypatch.setattr(s3_method, "S3_FULL_ORACLE", False)
    loop = get_loop("s3", top_k=5, max_turns=3)
    plan = plan_s3(QUESTION, question_facts(QUESTION), Ranked(), loop, random.Random(0))
    assert len(plan.turns) == 1 and _selections(plan.turns) == [[3, 5]] and plan.found_all
