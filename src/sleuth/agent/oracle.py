"""An oracle policy for cold-start trajectories on the synthetic world.

The oracle knows each question's gold chain (`metadata.supporting_ids`, `chain`,
`relations`, written by `sleuth.data.synth`) and plays a loop in that loop's own
protocol. It is a `Generator`: the real rollout engine drives it, the real
retriever answers its queries and the real environment inserts the documents, so
its trajectories carry exactly the token ids and loss masks an RL rollout builds.

Before the rollout the oracle plans every question: for each fact of the chain it
tries query wordings (a question, a noun phrase, keywords; shuffled by the seed so
the model learns to search, not one template) against the same retriever and keeps
the first whose top-k holds the fact's passage. At generation time it replays the
plan one stop string at a time, as a model that stops at `</search>` would.

`oracle_check` says whether a finished trajectory is worth training on: the needed
passages were retrieved (s3: selected) and the answer is correct.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import encode_prompt
from sleuth.agent.registry import get_method, methods
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.data.synth import RELATIONS
from sleuth.errors import ConfigError
from sleuth.llm.base import Generation, SamplingParams
from sleuth.retrieval.base import Hit, Retriever
from sleuth.rewards.metrics import exact_match

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
        return [Fact(chain[0], relations[0], support[0], values[0]), Fact(chain[1], relations[0], support[1], values[1])]
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
    forms = [f"{fact.subject} {kw}" for kw in _KEYWORDS.get(fact.relation, (fact.relation.replace("_", " "),))]
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


def find_fact(fact: Fact, retriever: Retriever, k: int, rng: random.Random, keyword_first: bool = False) -> FoundFact:
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


def _need(fact: Fact) -> str:
    rel = RELATIONS.get(fact.relation)
    if rel is not None and rel.phrases:
        return rel.phrases[0].format(x=fact.subject)
    words = _KEYWORDS.get(fact.relation, (fact.relation.replace("_", " "),))[0]
    return f"the {words} of {fact.subject}"


def _lc(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def _steps_text(found: list[FoundFact], i: int, answer: str, rng: random.Random) -> str:
    """Reasoning after fact i-1 was found and before fact i is searched (or the answer, i == len)."""
    if i == 0:
        return rng.choice(_THINK_FIRST).format(need=_need(found[0].fact))
    statement = found[i - 1].fact.statement()
    if i == len(found):
        return rng.choice(_THINK_DONE).format(statement=statement, answer=answer)
    return rng.choice(_THINK_NEXT).format(statement=statement, statement_lc=_lc(statement), need=_need(found[i].fact))


@dataclass
class Plan:
    turns: list[str]  # one entry per generation turn; the oracle cuts each at the engine's stop strings
    found_all: bool
    facts: list[FoundFact] = field(default_factory=list)


def plan_search_r1(example, facts, retriever, loop, rng) -> Plan:
    found = [find_fact(f, retriever, loop.top_k, rng) for f in facts]
    answer = example.golden_answers[0]
    turns = [f"<think>{_steps_text(found, i, answer, rng)}</think>\n<search> {ff.query} </search>" for i, ff in enumerate(found)]
    turns.append(f"<think>{_steps_text(found, len(found), answer, rng)}</think>\n<answer> {answer} </answer>")
    return Plan(turns, all(ff.found for ff in found), found)


def plan_staged(example, facts, retriever, loop, rng) -> Plan:
    found = [find_fact(f, retriever, loop.top_k, rng, keyword_first=True) for f in facts]
    answer = example.golden_answers[0]
    sketch = rng.choice(("I do not know", "My internal knowledge does not cover", "I have no knowledge of"))
    turns = [f"<think>{sketch} {_need(found[0].fact)}; I need to search.</think>\n<search>{found[0].query}</search>"]
    for i in range(1, len(found)):
        reflect = _steps_text(found, i, answer, rng)
        turns.append(f"<reflect>{reflect}</reflect>\n<search>{found[i].query}</search>")
    turns.append(f"<reflect>{_steps_text(found, len(found), answer, rng)}</reflect>\n<answer>{answer}</answer>")
    return Plan(turns, all(ff.found for ff in found), found)


def plan_r_search(example, facts, retriever, loop, rng) -> Plan:
    found = [find_fact(f, retriever, loop.top_k, rng) for f in facts]
    answer = example.golden_answers[0]
    turns = [f"{_steps_text(found, i, answer, rng)}\n<search>{ff.query}</search>" for i, ff in enumerate(found)]
    evidence = "\n".join(dict.fromkeys(evidence_sentence(ff.hit, ff.fact) for ff in found))
    turns.append(
        f"{_steps_text(found, len(found), answer, rng)}\n<original_evidence>\n{evidence}\n</original_evidence>\n"
        f"<answer>{answer}</answer>"
    )
    return Plan(turns, all(ff.found for ff in found), found)


def _qagent_rounds(facts: list[Fact]) -> list[list[int]]:
    """Facts searched together: independent facts (the two sides of a comparison) share a round."""
    if len(facts) == 2 and facts[0].subject not in (facts[1].subject,) and facts[0].answer != facts[1].subject:
        return [[0, 1]]
    if len(facts) == 4 and facts[1].subject == facts[0].answer and facts[3].subject == facts[2].answer:
        return [[0, 2], [1, 3]]
    return [[i] for i in range(len(facts))]


def plan_qagent(example, facts, retriever, loop, rng) -> Plan:
    answer = example.golden_answers[0]
    found = [find_fact(f, retriever, loop.top_k, rng) for f in facts]
    turns: list[str] = []
    reflection = ""
    for r, group in enumerate(_qagent_rounds(facts)):
        needs = " and ".join(_need(found[i].fact) for i in group)
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


# An s3 oracle that stops as soon as the initial (naive-RAG) window holds the chain does so on ~60% of
# synthetic questions, and a model fine-tuned on that learns to stop after the initial search on 97% of
# questions (measured: accuracy = naive RAG's). Searching at least once teaches the searcher to search.
S3_MIN_SEARCHES = 1


def plan_s3(example, facts, retriever, loop, rng) -> Plan:
    """Begin with search (the question), then per window: select the needed passages, search the next;
    at least `S3_MIN_SEARCHES` searches (a needed fact again, in another wording, when none is missing)."""
    window = retriever.search([example.question.strip()], loop.top_k)[0] if loop.begin_with_search else []
    needed = {f.doc_id for f in facts}
    have: set[str] = set()
    turns: list[str] = []
    found_facts: list[FoundFact] = []
    for _ in range(loop.max_turns + 1):
        ids = [i + 1 for i, h in enumerate(window) if h.doc_id in needed - have][: loop.max_selected]
        have |= {window[i - 1].doc_id for i in ids}
        select = f"<important_info>{json.dumps(ids)}</important_info>\n" if window else ""
        missing = [f for f in facts if f.doc_id not in have]
        if (not missing and len(turns) >= S3_MIN_SEARCHES) or len(turns) == loop.max_turns:
            turns.append(f"{select}<search_complete>True</search_complete>")
            break
        ff = find_fact(missing[0] if missing else facts[-1], retriever, loop.top_k, rng)
        found_facts.append(ff)
        query = json.dumps({"query": ff.query})
        turns.append(f"{select}<search_complete>False</search_complete>\n<query>{query}</query>")
        window = ff.hits
    return Plan(turns, needed <= have, found_facts)




class OracleGenerator:
    """Replays per-question plans through the rollout engine (token-in/token-out, like a model)."""

    def __init__(self, loop: AgentLoop, retriever: Retriever, tokenizer, examples: Sequence[QAExample], seed: int = 0):
        planner = get_method(loop.name).oracle_planner
        if planner is None:
            with_oracle = [m.name for m in methods() if m.oracle_planner is not None]
            raise ConfigError(f"no oracle for loop {loop.name!r}; oracles exist for: {', '.join(sorted(with_oracle))}")
        self.tokenizer = tokenizer
        self.loop = loop
        self.plans: dict[tuple[int, ...], Plan] = {}
        self._progress: dict[tuple[int, ...], list[int]] = {}  # [turn index, characters of it emitted]
        self._lengths: set[int] = set()
        rng = random.Random(seed)
        for ex in examples:
            plan = planner(ex, question_facts(ex), retriever, loop, rng)
            initial = [retriever.search([q], loop.top_k)[0] for q in loop.initial_queries(ex)]
            ids, _ = encode_prompt(tokenizer, loop.build_messages(ex, initial))
            key = tuple(ids)
            self.plans[key] = plan
            self._progress[key] = [0, 0]
            self._lengths.add(len(key))

    def _key(self, row: list[int]) -> tuple[int, ...]:
        for n in self._lengths:
            key = tuple(row[:n])
            if key in self.plans:
                return key
        raise ConfigError("oracle: a prompt the oracle did not plan for (examples and loop must match the rollout)")

    def generate(self, batch, stop=None, params: SamplingParams | None = None) -> list[Generation]:
        out: list[Generation] = []
        for i, row in enumerate(batch):
            stops = stop[i] if stop and isinstance(stop[0], list) else (stop or [])
            key = self._key(list(row))
            plan, progress = self.plans[key], self._progress[key]
            if progress[0] >= len(plan.turns):  # the engine asks for more than planned (forced final turn)
                text, reason, hit = self.tokenizer.eos_token or "", "eos", None
            else:
                rest = plan.turns[progress[0]][progress[1] :]
                first = min(((rest.find(s), s) for s in stops if s and s in rest), default=None)
                hit = first[1] if first else None
                cut = first[0] + len(first[1]) if first else len(rest)
                text = rest[:cut]
                reason = "stop" if hit else "eos"
                if cut >= len(rest):
                    progress[0], progress[1] = progress[0] + 1, 0
                else:
                    progress[1] += cut
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if reason == "eos" and self.tokenizer.eos_token_id is not None and text != self.tokenizer.eos_token:
                ids.append(self.tokenizer.eos_token_id)
            out.append(Generation(text=text, token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=reason, stop=hit))
        return out


def oracle_check(traj: Trajectory, example: QAExample) -> bool:
    """The needed passages were gathered (s3: selected) and the final answer, if the loop answers, is right."""
    needed = {f.doc_id for f in question_facts(example)}
    if not get_method(traj.method).answers:  # a searcher only (s3): judged by the documents it selected
        return needed <= {str(h["doc_id"]) for h in traj.selected}
    retrieved = {str(h["doc_id"]) for hits in traj.retrieved for h in hits}
    return needed <= retrieved and traj.answer is not None and exact_match(traj.answer, example.golden_answers) > 0
