"""What an oracle planner is, and the pieces every method's planner shares.

The oracle (sleuth.agent.oracle) plays synthetic-world questions through the real rollout engine
to make cold-start trajectories. It knows each question's gold chain (`metadata.supporting_ids`,
`chain`, `relations`, written by `sleuth.data.synth`). Each method writes its own planner (an
`OraclePlanner`, in the method's module, named by `Method.oracle_planner`): for every question it
returns a `Plan`, the text of each generation turn in that loop's own protocol. The planners
share the facts of a question (`question_facts`), the query wordings tried against the retriever
(`find_fact`: a question, a noun phrase, keywords; shuffled by the seed so the model learns to
search, not one template) and the reasoning sentences (`steps_text`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Protocol

from sleuth.agent.base import AgentLoop
from sleuth.data.formats import QAExample
from sleuth.data.world_schema import RELATIONS
from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit, Retriever

# Keyword forms of each relation ("<subject> <keyword>"): the staged paper asks for keyword queries.
_KEYWORDS = {
    "born_in": ("birthplace", "born in"),
    "birth_year": ("birth year", "year of birth"),
    "works_for": ("employer", "works for"),
    "located_in": ("country", "located in country"),
    "mayor": ("mayor",),
    "capital": ("capital city", "capital"),
    "founded_by": ("founder", "founded by"),
    "headquartered_in": ("headquarters city", "headquartered in"),
    "founded_year": ("founding year", "founded in year"),
    "directed_by": ("director", "directed by"),
    "release_year": ("release year", "released in year"),
    "written_by": ("author", "written by"),
    "publication_year": ("publication year", "published in year"),
    "formed_in": ("city formed", "formed in city"),
    "lead_singer": ("lead singer", "vocalist"),
    "formed_year": ("year formed", "formation year"),
}


@dataclass(frozen=True)
class Fact:
    """One fact of a question's chain: `subject --relation--> answer`, stated by passage `doc_id`."""

    subject: str
    relation: str
    doc_id: str
    answer: str

    def statement(self) -> str:
        words = _KEYWORDS.get(self.relation, (self.relation.replace("_", " "),))[0]
        return f"The {words} of {self.subject} is {self.answer}."


def question_facts(example: QAExample) -> list[Fact]:
    """The facts a synthetic-world question needs, in the order a searcher finds them."""
    meta = example.metadata or {}
    try:
        support = [str(s) for s in meta["supporting_ids"]]
        chain = [str(c) for c in meta["chain"]]
        relations = list(meta["relations"])
    except (KeyError, TypeError) as err:
        raise ConfigError(
            f"question {example.id!r} has no gold chain (metadata.supporting_ids, chain, relations): the oracle "
            "plays synthetic-world questions (`sleuth synth`); use a teacher model for other data"
        ) from err
    if meta.get("type") != "comparison":
        if len(relations) != len(support) or len(chain) != len(relations) + 1:
            raise ConfigError(f"question {example.id!r}: chain, relations and supporting_ids disagree")
        return [Fact(chain[i], r, support[i], chain[i + 1]) for i, r in enumerate(relations)]
    values = [str(v) for v in meta.get("values", [])]
    if len(values) != 2:
        raise ConfigError(f"comparison question {example.id!r} lacks metadata.values")
    if len(relations) == 1:  # "Which was founded earlier, A or B?"
        return [
            Fact(chain[0], relations[0], support[0], values[0]),
            Fact(chain[1], relations[0], support[1], values[1]),
        ]
    via, year = relations
    return [
        Fact(chain[0], via, support[0], chain[1]),
        Fact(chain[1], year, support[1], values[0]),
        Fact(chain[2], via, support[2], chain[3]),
        Fact(chain[3], year, support[3], values[1]),
    ]


def query_wordings(fact: Fact, rng: random.Random) -> list[str]:
    """Several ways to ask for one fact, in a seeded random order."""
    rel = RELATIONS.get(fact.relation)
    forms = [
        f"{fact.subject} {kw}" for kw in _KEYWORDS.get(fact.relation, (fact.relation.replace("_", " "),))
    ]
    if rel is not None:
        forms += [q.format(x=fact.subject) for q in rel.questions]
        forms += [p.format(x=fact.subject) for p in rel.phrases]
    rng.shuffle(forms)
    return forms


def evidence_sentence(hit: Hit | None, fact: Fact) -> str:
    """The passage sentence that states the fact (its original wording), else the statement."""
    if hit is not None:
        for sentence in re.split(r"(?<=[.!?])\s+", hit.text):
            if fact.answer in sentence and (fact.subject in sentence or fact.subject.split()[0] in sentence):
                return sentence.strip()
        for sentence in re.split(r"(?<=[.!?])\s+", hit.text):
            if fact.answer in sentence:
                return sentence.strip()
    return fact.statement()


@dataclass
class FoundFact:
    fact: Fact
    query: str
    hits: list[Hit]  # what the query retrieves (the window the environment will insert)
    found: bool

    @property
    def hit(self) -> Hit | None:
        return next((h for h in self.hits if h.doc_id == self.fact.doc_id), None)


def find_fact(
    fact: Fact, retriever: Retriever, k: int, rng: random.Random, keyword_first: bool = False
) -> FoundFact:
    """The first wording whose top-k holds the fact's passage (else the first wording, not found)."""
    wordings = query_wordings(fact, rng)
    if keyword_first:
        wordings.sort(key=lambda w: "?" in w or w.lower().startswith("the "))
    first: FoundFact | None = None
    for query in wordings:
        hits = retriever.search([query], k)[0]
        found = FoundFact(fact, query, list(hits), any(h.doc_id == fact.doc_id for h in hits))
        if found.found:
            return found
        first = first or found
    assert first is not None
    return first


# -- scripts: what the oracle writes, one string per generation turn ------------------------------------


_THINK_FIRST = (
    "I need to find {need}.",
    "To answer this I first need {need}.",
    "Let me search for {need}.",
    "The question depends on {need}, which I do not know.",
)
_THINK_NEXT = (
    "{statement} Next I need {need}.",
    "{statement} Now I have to find {need}.",
    "So {statement_lc} I still need {need}.",
)
_THINK_DONE = (
    "{statement} So the answer is {answer}.",
    "{statement} That answers the question: {answer}.",
    "{statement} I can answer now.",
)


def need_phrase(fact: Fact) -> str:
    rel = RELATIONS.get(fact.relation)
    if rel is not None and rel.phrases:
        return rel.phrases[0].format(x=fact.subject)
    words = _KEYWORDS.get(fact.relation, (fact.relation.replace("_", " "),))[0]
    return f"the {words} of {fact.subject}"


def _lc(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def steps_text(found: list[FoundFact], i: int, answer: str, rng: random.Random) -> str:
    """Reasoning after fact i-1 was found and before fact i is searched (or the answer, i == len)."""
    if i == 0:
        return rng.choice(_THINK_FIRST).format(need=need_phrase(found[0].fact))
    statement = found[i - 1].fact.statement()
    if i == len(found):
        return rng.choice(_THINK_DONE).format(statement=statement, answer=answer)
    return rng.choice(_THINK_NEXT).format(
        statement=statement, statement_lc=_lc(statement), need=need_phrase(found[i].fact)
    )


_RECALL_SKETCH = (
    "My internal knowledge covers this question.",
    "I know the facts this question needs.",
    "I can answer this from what I know.",
)
_RECALL = (
    "I know this from memory: {statements} So the answer is {answer}.",
    "From my own knowledge: {statements} The answer is {answer}.",
    "I already know that {statements_lc} No search is needed: {answer}.",
)


def known_from_memory(example: QAExample) -> bool:
    """An all-known question of a knowledge-boundary world (`synth --known-fraction`): the model was taught every fact
    it needs, so an oracle that does what the staged and Search-R1 prompts say (answer without searching when internal
    knowledge suffices) answers it directly. False on worlds without knowledge labels."""
    return (example.metadata or {}).get("knowledge") == "all-known"


def recall_sketch(rng: random.Random) -> str:
    return rng.choice(_RECALL_SKETCH)


def recall_text(facts: list[Fact], answer: str, rng: random.Random) -> str:
    """Reasoning from memory: the question's facts stated, then the answer (a direct answer's think or reflect)."""
    statements = " ".join(f.statement() for f in facts)
    return rng.choice(_RECALL).format(statements=statements, statements_lc=_lc(statements), answer=answer)


@dataclass
class Plan:
    turns: list[str]  # one entry per generation turn; the oracle cuts each at the engine's stop strings
    found_all: bool
    facts: list[FoundFact] = field(default_factory=list)


class OraclePlanner(Protocol):
    """A method's oracle: the plan for one question, given its facts, the retriever the rollout uses,
    the loop (its options: top_k, max_turns, ...) and the seeded random source of wordings."""

    def __call__(
        self, example: QAExample, facts: list[Fact], retriever: Retriever, loop: AgentLoop, rng: random.Random
    ) -> Plan: ...
