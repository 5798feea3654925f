"""A generated world: its entity tables, facts and questions, and the passages it states them in (text made
lazily while the corpus streams to disk)."""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

from sleuth.data.formats import Passage, QAExample
from sleuth.data.names import (
    BOOK_KINDS,
    DIRECTIONS,
    GENRES,
    INDUSTRIES,
    MUSIC,
    OCCUPATIONS,
)
from sleuth.data.world_schema import ENTITY_TYPES, EXTRA_PASSAGE, RELATIONS, RELATIONS_BY_SUBJECT


@dataclass
class World:
    """Entity tables, questions and the recipe for passages (text is generated on iteration)."""

    seed: int
    hops: tuple[int, int]
    num_passages: int
    names: list[str]  # by global entity id (gid); entity types occupy contiguous gid ranges
    type_start: dict[str, int]
    type_count: dict[str, int]
    facts: dict[str, list[int]]  # relation -> target gid or year, indexed by gid - type_start[subject]
    official_names: list[str]  # per country (local index)
    similar: dict[int, int]  # gid -> a confusable entity's gid
    works: dict[int, list[tuple[str, int]]]  # person gid -> [(relation, subject gid)] (reverse facts)
    country_cities: dict[int, list[int]]  # country gid -> a few of its cities
    extra_passage: dict[int, int]  # gid -> passage number of its second passage
    questions: list[QAExample] = field(default_factory=list)
    # Share of facts the model is taught closed-book (`knowledge_statements`); None: no knowledge boundary.
    known_fraction: float | None = None

    def __post_init__(self) -> None:
        self._starts = [self.type_start[t] for t in ENTITY_TYPES]

    # -- lookups ----------------------------------------------------------
    @property
    def num_entities(self) -> int:
        return len(self.names)

    def type_of(self, gid: int) -> str:
        return ENTITY_TYPES[bisect_right(self._starts, gid) - 1]

    def fact(self, relation: str, gid: int) -> int:
        r = RELATIONS[relation]
        return self.facts[relation][gid - self.type_start[r.subject]]

    def fact_passage_id(self, relation: str, gid: int) -> str:
        """The id of the passage stating `relation` of entity `gid`."""
        etype = RELATIONS[relation].subject
        extra = EXTRA_PASSAGE.get(etype)
        if extra is not None and relation in extra[1] and gid in self.extra_passage:
            return str(self.extra_passage[gid])
        return str(gid)

    def is_known(self, relation: str, gid: int) -> bool:
        """Whether fact `relation` of entity `gid` is on the known side of the knowledge boundary.

        A fixed function of (seed, relation, gid) through a stable hash, so every fact keeps its side
        whatever the number of questions, and a fact's side is independent of every other fact's."""
        if self.known_fraction is None:
            return False
        digest = hashlib.blake2b(f"{self.seed}/known/{relation}/{gid}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.known_fraction

    def answers_for(self, gid: int) -> list[str]:
        """Golden answers for an entity: its name, plus the official form for countries."""
        if self.type_of(gid) == "country":
            return [self.names[gid], self.official_names[gid - self.type_start["country"]]]
        return [self.names[gid]]

    def mention(self, gid: int) -> str:
        etype = self.type_of(gid)
        if etype in ("film", "book", "band"):
            return f"the {etype} {self.names[gid]}"
        return self.names[gid]

    # -- passages ---------------------------------------------------------
    def iter_passages(self) -> Iterator[Passage]:
        """All passages in id order: one main passage per entity ("0".."E-1"), then second passages."""
        rng = random.Random(f"{self.seed}/passages")
        for gid in range(self.num_entities):
            yield self._main_passage(gid, rng)
        for gid, number in sorted(self.extra_passage.items(), key=lambda kv: kv[1]):
            yield self._extra_passage(gid, number, rng)

    def _fact_sentence(self, relation: str, gid: int, rng: random.Random) -> str:
        r = RELATIONS[relation]
        value = self.fact(relation, gid)
        target = str(value) if r.target == "year" else self.names[value]
        template = r.sentences[rng.randrange(len(r.sentences))]
        return template.format(s=self.names[gid], o=target, dir=DIRECTIONS[rng.randrange(len(DIRECTIONS))])

    def _facts_in(self, gid: int, etype: str, in_extra: bool) -> list[str]:
        extra = EXTRA_PASSAGE.get(etype)
        moved = extra[1] if extra is not None and gid in self.extra_passage else ()
        return [r.name for r in RELATIONS_BY_SUBJECT[etype] if (r.name in moved) == in_extra]

    def _main_passage(self, gid: int, rng: random.Random) -> Passage:
        etype = self.type_of(gid)
        name = self.names[gid]
        pick = rng.choice
        sentences: list[str] = []
        if etype == "person":
            sentences.append(f"{name} is a {pick(OCCUPATIONS)}.")
        elif etype == "country":
            local = gid - self.type_start["country"]
            sentences.append(f"{name}, officially the {self.official_names[local]}, is a sovereign country.")
        elif etype == "organization":
            sentences.append(f"{name} is a {pick(INDUSTRIES)} organization.")
        elif etype == "film":
            sentences.append(f"{name} is a {pick(GENRES)} film.")
        elif etype == "book":
            sentences.append(f"{name} is a {pick(BOOK_KINDS)}.")
        elif etype == "band":
            sentences.append(f"{name} is a {pick(MUSIC)} band.")
        relations = self._facts_in(gid, etype, in_extra=False)
        rng.shuffle(relations)
        sentences.extend(self._fact_sentence(r, gid, rng) for r in relations)
        sentences.extend(self._context_sentences(gid, etype, rng))
        return Passage(id=str(gid), title=name, text=" ".join(sentences))

    def _extra_passage(self, gid: int, number: int, rng: random.Random) -> Passage:
        etype = self.type_of(gid)
        suffix = EXTRA_PASSAGE[etype][0]
        name = self.names[gid]
        sentences = [f"This article covers the {suffix} of {name}."]
        sentences.extend(self._fact_sentence(r, gid, rng) for r in self._facts_in(gid, etype, in_extra=True))
        # A true fact about a confusable entity makes the second passage a retrieval distractor too.
        other = self.similar.get(gid)
        if other is not None:
            r = EXTRA_PASSAGE[etype][1][-1]
            sentences.append(
                f"It should not be confused with {self.names[other]}: " + self._fact_sentence(r, other, rng)
            )
        return Passage(id=str(number), title=f"{name} ({suffix})", text=" ".join(sentences))

    def _context_sentences(self, gid: int, etype: str, rng: random.Random) -> list[str]:
        """True facts about related or similarly named entities: retrieval distractors."""
        out: list[str] = []
        names = self.names
        other = self.similar.get(gid)
        if etype == "person":
            for relation, subject in self.works.get(gid, [])[:3]:
                verb = {
                    "directed_by": "directed",
                    "written_by": "wrote",
                    "founded_by": "founded",
                    "lead_singer": "is the lead singer of",
                    "mayor": "is the mayor of",
                }[relation]
                out.append(f"{names[gid]} {verb} {names[subject]}.")
            if other is not None:
                city = names[self.fact("born_in", other)]
                out.append(f"{names[gid]} is not to be confused with {names[other]}, who was born in {city}.")
        elif etype == "city":
            if other is not None:
                country = names[self.fact("located_in", other)]
                out.append(f"Not to be confused with {names[other]}, a city in {country}.")
        elif etype == "country":
            cities = [c for c in self.country_cities.get(gid, []) if c != self.fact("capital", gid)][:3]
            if cities:
                out.append(f"Other cities in {names[gid]} include {', '.join(names[c] for c in cities)}.")
        elif other is not None:
            # organization / film / book / band: the similar entity's first entity fact.
            relation = next(r.name for r in RELATIONS_BY_SUBJECT[etype] if r.target != "year")
            out.append(f"It is unrelated to {names[other]}; " + self._fact_sentence(relation, other, rng))
        if rng.random() < 0.5:
            out.append(rng.choice(_FILLER[etype]).format(s=names[gid]))
        return out


_FILLER = {
    "country": (
        "{s} has a long coastline.",
        "{s} is known for its mountain passes.",
        "{s} has two official languages.",
    ),
    "city": (
        "{s} is known for its river harbour.",
        "The old town of {s} dates back several centuries.",
        "{s} hosts an annual autumn fair.",
    ),
    "person": (
        "{s} has received several regional awards.",
        "{s} rarely gives interviews.",
        "{s} is known for meticulous work.",
    ),
    "organization": (
        "{s} employs several thousand people.",
        "{s} publishes an annual report.",
        "{s} operates in several countries.",
    ),
    "film": (
        "The film received mixed reviews.",
        "The film was shot on location.",
        "Critics praised its score.",
    ),
    "book": (
        "The book has been translated into several languages.",
        "It was a modest commercial success.",
        "Critics noted its unusual structure.",
    ),
    "band": (
        "The band has released four studio albums.",
        "The band tours every summer.",
        "Its debut single became a regional hit.",
    ),
}
