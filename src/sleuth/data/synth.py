"""A synthetic world: fictional entities, Wikipedia-like passages and multi-hop questions.

This is sleuth's contamination-free benchmark and the embedded demo's data. Every name is
built from syllables with at least one onset that English does not use word-initially
("zv", "kv", "xh" ...), so no pretrained model can answer from memory: a correct answer
requires retrieval. Every question is answerable from the corpus: its `supporting_ids` list,
hop by hop, the passage that states each fact used (tests check the answer string and each
bridge entity appear in them).

Everything is a deterministic function of the arguments: the same call writes byte-identical
files. Entities live in flat per-type lists (no per-entity objects) and passage text is
generated lazily while the corpus is streamed to disk, so 1M passages fit in modest memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.data.distractors import BLOCK as DISTRACTOR_BLOCK
from sleuth.data.formats import Passage, QAExample

GENERATOR_VERSION = "sleuth-synth/1"
MAX_HOPS = 5
MIN_PASSAGES = 40
KNOWLEDGE_FILE = "knowledge.jsonl"  # closed-book statements of the known facts (a world with a boundary)
LATEST_YEAR = 2024

ENTITY_TYPES = ("country", "city", "person", "organization", "film", "book", "band")
# Shares of the non-country entities; countries grow like sqrt(n) so each holds many cities.
_TYPE_SHARES = {"city": 0.12, "person": 0.38, "organization": 0.12, "film": 0.14, "book": 0.14, "band": 0.10}
# Fraction of passages that are a second passage about an already-described entity.
_EXTRA_PASSAGE_RATE = 0.12

# ---------------------------------------------------------------------------
# Relations
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Relation:
    """A functional fact `subject --name--> target`; target is an entity type or "year"."""

    name: str
    subject: str
    target: str
    phrases: tuple[str, ...]  # noun phrases denoting the target, `{x}` = the subject phrase
    questions: tuple[str, ...]  # questions asking for the target
    sentences: tuple[str, ...]  # passage sentences stating the fact: `{s}` subject, `{o}` target


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation(
            "born_in", "person", "city",
            ("the birthplace of {x}", "the city where {x} was born"),
            ("Where was {x} born?", "In which city was {x} born?", "What is the birthplace of {x}?"),
            ("{s} was born in {o}.", "{s} is a native of {o}.", "{s} was born and raised in {o}."),
        ),
        Relation(
            "birth_year", "person", "year", (),
            ("In which year was {x} born?", "What year was {x} born in?"),
            ("{s} was born in {o}.", "{s}'s year of birth is {o}."),
        ),
        Relation(
            "works_for", "person", "organization",
            ("the employer of {x}", "the organization {x} works for"),
            ("Which organization does {x} work for?", "Who is the employer of {x}?"),
            ("{s} works for {o}.", "{s} is employed by {o}.", "For most of their career, {s} has worked at {o}."),
        ),
        Relation(
            "located_in", "city", "country",
            ("the country where {x} is located", "the country that {x} is in"),
            ("In which country is {x}?", "Which country is {x} located in?"),
            ("{s} is a city in {o}.", "{s} is located in {o}.", "{s} lies in the {dir} of {o}."),
        ),
        Relation(
            "mayor", "city", "person",
            ("the mayor of {x}",),
            ("Who is the mayor of {x}?", "Who serves as mayor of {x}?"),
            ("The mayor of {s} is {o}.", "{o} serves as the mayor of {s}."),
        ),
        Relation(
            "capital", "country", "city",
            ("the capital of {x}", "the capital city of {x}"),
            ("What is the capital of {x}?", "Which city is the capital of {x}?"),
            ("The capital of {s} is {o}.", "{o} is the capital and largest city of {s}."),
        ),
        Relation(
            "founded_by", "organization", "person",
            ("the founder of {x}", "the person who founded {x}"),
            ("Who founded {x}?", "Who is the founder of {x}?"),
            ("{s} was founded by {o}.", "{o} founded {s}."),
        ),
        Relation(
            "headquartered_in", "organization", "city",
            ("the city where {x} is headquartered", "the headquarters city of {x}"),
            ("Where is {x} headquartered?", "In which city is {x} headquartered?"),
            ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}."),
        ),
        Relation(
            "founded_year", "organization", "year", (),
            ("In which year was {x} founded?", "When was {x} founded?"),
            ("{s} was founded in {o}.", "{s} was established in {o}."),
        ),
        Relation(
            "directed_by", "film", "person",
            ("the director of {x}", "the person who directed {x}"),
            ("Who directed {x}?", "Who is the director of {x}?"),
            ("{s} is a film directed by {o}.", "{s} was directed by {o}."),
        ),
        Relation(
            "release_year", "film", "year", (),
            ("In which year was {x} released?", "When was {x} released?"),
            ("{s} was released in {o}.", "{s} premiered in {o}."),
        ),
        Relation(
            "written_by", "book", "person",
            ("the author of {x}", "the writer of {x}"),
            ("Who wrote {x}?", "Who is the author of {x}?"),
            ("{s} is a book by {o}.", "{s} was written by {o}."),
        ),
        Relation(
            "publication_year", "book", "year", (),
            ("In which year was {x} published?", "When was {x} first published?"),
            ("{s} was first published in {o}.", "{s} appeared in print in {o}."),
        ),
        Relation(
            "formed_in", "band", "city",
            ("the city where {x} was formed", "the hometown of {x}"),
            ("In which city was {x} formed?", "Where was {x} formed?"),
            ("{s} is a band from {o}.", "{s} was formed in {o}."),
        ),
        Relation(
            "lead_singer", "band", "person",
            ("the lead singer of {x}", "the vocalist of {x}"),
            ("Who is the lead singer of {x}?", "Who sings lead vocals for {x}?"),
            ("The lead singer of {s} is {o}.", "{o} is the lead vocalist of {s}."),
        ),
        Relation(
            "formed_year", "band", "year", (),
            ("In which year was {x} formed?", "When was {x} formed?"),
            ("{s} formed in {o}.", "{s} was founded as a band in {o}."),
        ),
    )
}

_RELATIONS_BY_SUBJECT: dict[str, list[Relation]] = {t: [] for t in ENTITY_TYPES}
for _r in RELATIONS.values():
    _RELATIONS_BY_SUBJECT[_r.subject].append(_r)

# A chain may not use these consecutively: capital then located_in returns the start country.
_FORBIDDEN_PAIRS = {("capital", "located_in")}

# The year attribute of each type that has one (used by comparison questions).
_YEAR_OF = {
    "person": "birth_year", "organization": "founded_year", "film": "release_year",
    "book": "publication_year", "band": "formed_year",
}
_COMPARE_DIRECT = {
    "person": ("Who was born {cmp}, {a} or {b}?", "Which person was born {cmp}: {a} or {b}?"),
    "organization": ("Which organization was founded {cmp}, {a} or {b}?", "Which was founded {cmp}, {a} or {b}?"),
    "film": ("Which film was released {cmp}, {a} or {b}?", "Which came out {cmp}, the film {a} or the film {b}?"),
    "book": ("Which book was published {cmp}, {a} or {b}?", "Which was published {cmp}, the book {a} or the book {b}?"),
    "band": ("Which band was formed {cmp}, {a} or {b}?", "Which was formed {cmp}, the band {a} or the band {b}?"),
}
# Comparisons through a person: "Whose director was born earlier, film A or film B?"
_COMPARE_VIA = {
    "directed_by": ("Whose director was born {cmp}, the film {a} or the film {b}?",),
    "written_by": ("Whose author was born {cmp}, the book {a} or the book {b}?",),
    "founded_by": ("Whose founder was born {cmp}, {a} or {b}?",),
    "lead_singer": ("Whose lead singer was born {cmp}, the band {a} or the band {b}?",),
}

# Facts moved to an entity's second passage, and that passage's title suffix.
_EXTRA_PASSAGE = {
    "person": ("early life", ("born_in", "birth_year")),
    "organization": ("history", ("founded_by", "founded_year")),
    "film": ("release", ("release_year",)),
    "book": ("publication", ("publication_year",)),
    "band": ("history", ("formed_in", "formed_year")),
}

# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "h", "j", "th", "br", "dr")
# Word-initial clusters English does not have; every name word contains one of them.
_RARE_ONSETS = ("zv", "kv", "vr", "zh", "xh", "dz", "tl", "vh", "ghr", "skr", "thv", "kh", "qv", "mv")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "y", "ao")
_CODAS = ("", "", "", "n", "r", "s", "l", "k", "th", "x", "m", "sh", "rn")
_SYLLABLES = tuple(o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS)
_RARE_SYLLABLES = tuple(o + v + c for o in _RARE_ONSETS for v in _VOWELS for c in _CODAS)

_CITY_ENDINGS = ("ton", "ven", "ar", "holm", "mere", "ford", "wick", "grad", "by", "stead", "port")
_COUNTRY_ENDINGS = ("ia", "stan", "or", "and", "enia", "ovia", "esh", "aria")
_COUNTRY_FORMS = ("Republic", "Kingdom", "Federation", "Commonwealth", "Principality", "Union")
_ORG_SUFFIXES = ("Group", "Institute", "Works", "Foundation", "Holdings", "Laboratories", "Company", "Society", "Trust")
_TITLE_NOUNS = ("Tides", "Lantern", "Harvest", "Mirror", "Winter", "Echoes", "Garden", "Signal", "Crown",
                "River", "Ashes", "Horizon", "Orchard", "Silence", "Engine", "Compass", "Letters", "Shadows")
_BAND_NOUNS = ("Engines", "Sparrows", "Wolves", "Lanterns", "Machines", "Saints", "Rivers", "Giants", "Comets")

_OCCUPATIONS = ("painter", "engineer", "novelist", "physician", "architect", "composer", "chemist", "diplomat",
                "photographer", "economist", "sculptor", "historian", "lawyer")
_INDUSTRIES = ("shipping", "software", "textile", "publishing", "mining", "biotechnology", "insurance",
               "aviation", "agricultural", "energy")
_GENRES = ("drama", "comedy", "thriller", "documentary", "science fiction", "romance", "mystery", "western")
_BOOK_KINDS = ("novel", "memoir", "poetry collection", "short story collection", "history", "essay collection")
_MUSIC = ("folk", "post-punk", "jazz", "synth-pop", "metal", "indie rock", "electronic", "blues")
_DIRECTIONS = ("north", "south", "east", "west", "northeast", "southwest")


def _word(rng: random.Random, n_syllables: int) -> str:
    """A made-up word of `n_syllables` syllables, one (at a random position) with a rare onset."""
    rare_at = rng.randrange(n_syllables)
    parts = [
        _RARE_SYLLABLES[rng.randrange(len(_RARE_SYLLABLES))] if i == rare_at
        else _SYLLABLES[rng.randrange(len(_SYLLABLES))]
        for i in range(n_syllables)
    ]
    return "".join(parts).capitalize()


class _NameMaker:
    """Draws globally unique names; `similar` pairs names that differ in one part (confusable)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def unique(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError("could not draw a unique name; the name space is exhausted")

    def try_take(self, name: str) -> bool:
        if name in self.used:
            return False
        self.used.add(name)
        return True


# ---------------------------------------------------------------------------
# Hops parsing
# ---------------------------------------------------------------------------


def parse_hops(text: str) -> tuple[int, int]:
    """Parse "1-4" or "2" into an inclusive (min, max) hop range within 1..MAX_HOPS."""
    raw = text.strip()
    lo_text, sep, hi_text = raw.partition("-")
    if not sep:
        hi_text = lo_text
    try:
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        raise ValueError(f"hops must look like '1-4' or '2', got {text!r}") from None
    return check_hops((lo, hi))


def check_hops(hops: tuple[int, int]) -> tuple[int, int]:
    lo, hi = hops
    if not (1 <= lo <= hi <= MAX_HOPS):
        raise ValueError(f"hop range must satisfy 1 <= min <= max <= {MAX_HOPS}, got {lo}-{hi}")
    return int(lo), int(hi)


# ---------------------------------------------------------------------------
# The world
# ---------------------------------------------------------------------------


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
        extra = _EXTRA_PASSAGE.get(etype)
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
        return template.format(s=self.names[gid], o=target, dir=_DIRECTIONS[rng.randrange(len(_DIRECTIONS))])

    def _facts_in(self, gid: int, etype: str, in_extra: bool) -> list[str]:
        extra = _EXTRA_PASSAGE.get(etype)
        moved = extra[1] if extra is not None and gid in self.extra_passage else ()
        return [r.name for r in _RELATIONS_BY_SUBJECT[etype] if (r.name in moved) == in_extra]

    def _main_passage(self, gid: int, rng: random.Random) -> Passage:
        etype = self.type_of(gid)
        name = self.names[gid]
        pick = rng.choice
        sentences: list[str] = []
        if etype == "person":
            sentences.append(f"{name} is a {pick(_OCCUPATIONS)}.")
        elif etype == "country":
            local = gid - self.type_start["country"]
            sentences.append(f"{name}, officially the {self.official_names[local]}, is a sovereign country.")
        elif etype == "organization":
            sentences.append(f"{name} is a {pick(_INDUSTRIES)} organization.")
        elif etype == "film":
            sentences.append(f"{name} is a {pick(_GENRES)} film.")
        elif etype == "book":
            sentences.append(f"{name} is a {pick(_BOOK_KINDS)}.")
        elif etype == "band":
            sentences.append(f"{name} is a {pick(_MUSIC)} band.")
        relations = self._facts_in(gid, etype, in_extra=False)
        rng.shuffle(relations)
        sentences.extend(self._fact_sentence(r, gid, rng) for r in relations)
        sentences.extend(self._context_sentences(gid, etype, rng))
        return Passage(id=str(gid), title=name, text=" ".join(sentences))

    def _extra_passage(self, gid: int, number: int, rng: random.Random) -> Passage:
        etype = self.type_of(gid)
        suffix = _EXTRA_PASSAGE[etype][0]
        name = self.names[gid]
        sentences = [f"This article covers the {suffix} of {name}."]
        sentences.extend(self._fact_sentence(r, gid, rng) for r in self._facts_in(gid, etype, in_extra=True))
        # A true fact about a confusable entity makes the second passage a retrieval distractor too.
        other = self.similar.get(gid)
        if other is not None:
            r = _EXTRA_PASSAGE[etype][1][-1]
            sentences.append(f"It should not be confused with {self.names[other]}: "
                             + self._fact_sentence(r, other, rng))
        return Passage(id=str(number), title=f"{name} ({suffix})", text=" ".join(sentences))

    def _context_sentences(self, gid: int, etype: str, rng: random.Random) -> list[str]:
        """True facts about related or similarly named entities: retrieval distractors."""
        out: list[str] = []
        names = self.names
        other = self.similar.get(gid)
        if etype == "person":
            for relation, subject in self.works.get(gid, [])[:3]:
                verb = {"directed_by": "directed", "written_by": "wrote", "founded_by": "founded",
                        "lead_singer": "is the lead singer of", "mayor": "is the mayor of"}[relation]
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
            relation = next(r.name for r in _RELATIONS_BY_SUBJECT[etype] if r.target != "year")
            out.append(f"It is unrelated to {names[other]}; " + self._fact_sentence(relation, other, rng))
        if rng.random() < 0.5:
            out.append(rng.choice(_FILLER[etype]).format(s=names[gid]))
        return out


_FILLER = {
    "country": ("{s} has a long coastline.", "{s} is known for its mountain passes.", "{s} has two official languages."),
    "city": ("{s} is known for its river harbour.", "The old town of {s} dates back several centuries.",
             "{s} hosts an annual autumn fair."),
    "person": ("{s} has received several regional awards.", "{s} rarely gives interviews.",
               "{s} is known for meticulous work."),
    "organization": ("{s} employs several thousand people.", "{s} publishes an annual report.",
                     "{s} operates in several countries."),
    "film": ("The film received mixed reviews.", "The film was shot on location.", "Critics praised its score."),
    "book": ("The book has been translated into several languages.", "It was a modest commercial success.",
             "Critics noted its unusual structure."),
    "band": ("The band has released four studio albums.", "The band tours every summer.",
             "Its debut single became a regional hit."),
}

# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def _entity_counts(num_passages: int) -> dict[str, int]:
    n_entities = max(len(ENTITY_TYPES) * 4, round(num_passages / (1 + _EXTRA_PASSAGE_RATE)))
    n_entities = min(n_entities, num_passages)
    counts = {"country": max(3, round(math.sqrt(n_entities) / 2))}
    rest = n_entities - counts["country"]
    for etype, share in _TYPE_SHARES.items():
        counts[etype] = max(4, int(rest * share))
    counts["city"] = max(counts["city"], counts["country"])
    counts["person"] += n_entities - sum(counts.values())  # rounding remainder
    return {t: counts[t] for t in ENTITY_TYPES}


def _build_names(world_counts: dict[str, int], rng: random.Random) -> tuple[list[str], list[str], dict[int, int]]:
    """Names for every entity, countries' official names, and the confusable pairs."""
    maker = _NameMaker(rng)
    names: list[str] = []
    official: list[str] = []
    similar: dict[int, int] = {}

    def pair(a: int, b: int) -> None:
        similar.setdefault(a, b)
        similar.setdefault(b, a)

    for _ in range(world_counts["country"]):
        name = maker.unique(lambda: _word(rng, 2) + rng.choice(_COUNTRY_ENDINGS))
        official.append(f"{rng.choice(_COUNTRY_FORMS)} of {name}")
        names.append(name)

    def stem_family(count: int, make_stem: Callable[[], str], variants: tuple[str, ...],
                    join: Callable[[str, str], str]) -> None:
        """Names `join(stem, variant)`; ~25% reuse an earlier stem with another variant (confusable)."""
        stems: list[tuple[str, int]] = []  # (stem, gid of first name with it)
        for _ in range(count):
            gid = len(names)
            if stems and rng.random() < 0.25:
                stem, first = stems[rng.randrange(len(stems))]
                candidate = join(stem, rng.choice(variants))
                if maker.try_take(candidate):
                    names.append(candidate)
                    pair(gid, first)
                    continue
            stem = make_stem()
            name = maker.unique(lambda stem=stem: join(stem, rng.choice(variants)))
            stems.append((stem, gid))
            names.append(name)

    stem_family(world_counts["city"], lambda: _word(rng, 2), _CITY_ENDINGS, lambda s, v: s + v)

    # People: given name + family name; families are shared (about three members each), which
    # makes "X Vrakon" vs "Y Vrakon" the natural confusable pair.
    n_people = world_counts["person"]
    given = [_word(rng, 2) for _ in range(max(50, n_people // 8))]
    families = [_word(rng, rng.choice((2, 2, 3))) for _ in range(max(3, n_people // 3))]
    first_of_family: dict[int, int] = {}
    for _ in range(n_people):
        gid = len(names)
        family = rng.randrange(len(families))
        names.append(maker.unique(lambda f=family: f"{given[rng.randrange(len(given))]} {families[f]}"))
        if family in first_of_family:
            pair(gid, first_of_family[family])
        else:
            first_of_family[family] = gid

    stem_family(world_counts["organization"], lambda: _word(rng, 2), _ORG_SUFFIXES, lambda s, v: f"{s} {v}")
    stem_family(world_counts["film"], lambda: _word(rng, 2), _TITLE_NOUNS,
                lambda s, v: f"{s} {v}" if len(s) % 2 else f"The {v} of {s}")
    stem_family(world_counts["book"], lambda: _word(rng, 2), _TITLE_NOUNS,
                lambda s, v: f"The {s} {v}" if len(s) % 2 else f"{v} for {s}")
    stem_family(world_counts["band"], lambda: _word(rng, 2), _BAND_NOUNS, lambda s, v: f"The {s} {v}")
    return names, official, similar


def _build_facts(counts: dict[str, int], start: dict[str, int], rng: random.Random) -> tuple[
    dict[str, list[int]], dict[int, list[tuple[str, int]]], dict[int, list[int]]
]:
    rand = rng.randrange

    def gids(etype: str, n: int) -> list[int]:
        base, size = start[etype], counts[etype]
        return [base + rand(size) for _ in range(n)]

    facts: dict[str, list[int]] = {}
    n_country, n_city = counts["country"], counts["city"]
    # The first n_country cities are the capitals, so every country has one.
    located = [start["country"] + i for i in range(n_country)] + gids("country", n_city - n_country)
    facts["located_in"] = located
    facts["capital"] = [start["city"] + i for i in range(n_country)]
    country_cities: dict[int, list[int]] = {}
    for i, country in enumerate(located):
        members = country_cities.setdefault(country, [])
        if len(members) < 4:
            members.append(start["city"] + i)

    n_person = counts["person"]
    facts["born_in"] = gids("city", n_person)
    facts["birth_year"] = [1850 + rand(1986 - 1850) for _ in range(n_person)]
    facts["works_for"] = gids("organization", n_person)
    facts["mayor"] = gids("person", n_city)

    births = facts["birth_year"]
    person0 = start["person"]

    def year_after(people: list[int], lo: int, hi: int) -> list[int]:
        return [min(LATEST_YEAR, births[p - person0] + lo + rand(hi - lo)) for p in people]

    facts["founded_by"] = gids("person", counts["organization"])
    facts["headquartered_in"] = gids("city", counts["organization"])
    facts["founded_year"] = year_after(facts["founded_by"], 20, 50)
    facts["directed_by"] = gids("person", counts["film"])
    facts["release_year"] = year_after(facts["directed_by"], 22, 50)
    facts["written_by"] = gids("person", counts["book"])
    facts["publication_year"] = year_after(facts["written_by"], 18, 60)
    facts["formed_in"] = gids("city", counts["band"])
    facts["lead_singer"] = gids("person", counts["band"])
    facts["formed_year"] = year_after(facts["lead_singer"], 16, 30)

    works: dict[int, list[tuple[str, int]]] = {}
    for relation in ("directed_by", "written_by", "founded_by", "lead_singer", "mayor"):
        subject_start = start[RELATIONS[relation].subject]
        for i, person in enumerate(facts[relation]):
            listed = works.setdefault(person, [])
            if len(listed) < 3:
                listed.append((relation, subject_start + i))
    return facts, works, country_cities


def generate_world(
    num_passages: int,
    num_questions: int,
    hops: tuple[int, int] = (1, 4),
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    known_fraction: float | None = None,
) -> World:
    """Build a world with exactly `num_passages` passages and `num_questions` distinct questions.

    Hop counts are drawn uniformly from the inclusive `hops` range. A hop is one supporting
    passage: compositional questions follow a chain of that many facts; comparisons use 2
    passages (two years) or 4 (two entity->person links and two birth years).
    `progress(n)` is called with the number of questions made so far, now and then.
    `known_fraction` draws a knowledge boundary: that share of facts is *known* (`World.is_known`),
    each question records per hop whether it is known (`known_hops`) and its type (`knowledge`:
    all-known, mixed, all-unknown), and `write_world` writes the known facts' closed-book statements.
    """
    if num_passages < MIN_PASSAGES:
        raise ValueError(f"num_passages must be at least {MIN_PASSAGES}, got {num_passages}")
    if num_questions < 0:
        raise ValueError(f"num_questions must be >= 0, got {num_questions}")
    if known_fraction is not None and not 0.0 <= known_fraction <= 1.0:
        raise ValueError(f"known_fraction must be between 0 and 1, got {known_fraction}")
    hops = check_hops(tuple(hops))  # type: ignore[arg-type]
    counts = _entity_counts(num_passages)
    start: dict[str, int] = {}
    offset = 0
    for etype in ENTITY_TYPES:
        start[etype] = offset
        offset += counts[etype]
    n_entities = offset

    names, official, similar = _build_names(counts, random.Random(f"{seed}/names"))
    facts, works, country_cities = _build_facts(counts, start, random.Random(f"{seed}/facts"))

    # Second passages for some entities bring the total to exactly num_passages.
    rng = random.Random(f"{seed}/extra")
    eligible_types = [t for t in ENTITY_TYPES if t in _EXTRA_PASSAGE]
    eligible_total = sum(counts[t] for t in eligible_types)
    n_extra = num_passages - n_entities
    if n_extra > eligible_total:
        raise ValueError(f"cannot reach {num_passages} passages from {n_entities} entities")
    chosen = sorted(rng.sample(range(eligible_total), n_extra))
    extra_passage: dict[int, int] = {}
    for j, k in enumerate(chosen):
        for etype in eligible_types:
            if k < counts[etype]:
                extra_passage[start[etype] + k] = n_entities + j
                break
            k -= counts[etype]

    world = World(
        seed=seed, hops=hops, num_passages=num_passages, names=names, type_start=start, type_count=counts,
        facts=facts, official_names=official, similar=similar, works=works, country_cities=country_cities,
        extra_passage=extra_passage, known_fraction=known_fraction,
    )
    world.questions = _make_questions(world, num_questions, random.Random(f"{seed}/questions"), progress)
    return world


# ---------------------------------------------------------------------------
# Questions
# ---------------------------------------------------------------------------


def _random_entity(world: World, etype: str, rng: random.Random) -> int:
    return world.type_start[etype] + rng.randrange(world.type_count[etype])


def _chain_question(world: World, hops: int, rng: random.Random) -> tuple[tuple, QAExample] | None:
    """A compositional (or single-hop) question following `hops` facts; None if the walk failed."""
    etype = rng.choice(ENTITY_TYPES)
    gid = _random_entity(world, etype, rng)
    chain = [gid]
    relations: list[Relation] = []
    for step in range(hops):
        last = step == hops - 1
        options = [
            r for r in _RELATIONS_BY_SUBJECT[etype]
            if (last or r.target != "year")
            and not (relations and (relations[-1].name, r.name) in _FORBIDDEN_PAIRS)
        ]
        if not options:
            return None
        r = rng.choice(options)
        relations.append(r)
        value = world.fact(r.name, chain[-1])
        if r.target != "year":
            if value in chain:  # a cycle would make the answer appear in the question
                return None
            etype = r.target
        chain.append(value)

    phrase = world.mention(chain[0])
    for r in relations[:-1]:
        phrase = rng.choice(r.phrases).format(x=phrase)
    question = rng.choice(relations[-1].questions).format(x=phrase)
    final = relations[-1]
    answers = [str(chain[-1])] if final.target == "year" else world.answers_for(chain[-1])
    supporting = [world.fact_passage_id(r.name, g) for r, g in zip(relations, chain[:-1], strict=True)]
    chain_names = [world.names[g] for g in chain[:-1]] + [answers[0]]
    metadata = {
        "hops": hops,
        "type": "single" if hops == 1 else "compositional",
        "supporting_ids": supporting,
        "chain": chain_names,
        "relations": [r.name for r in relations],
    }
    _label_knowledge(world, metadata, [(r.name, g) for r, g in zip(relations, chain[:-1], strict=True)])
    key = ("chain", chain[0], tuple(r.name for r in relations))
    return key, QAExample(id="", question=question, golden_answers=answers, metadata=metadata)


def _comparison_question(world: World, hops: int, rng: random.Random) -> tuple[tuple, QAExample] | None:
    """'Which was founded earlier, A or B?' (2 hops) or 'Whose director was born earlier, ...' (4 hops)."""
    if hops == 2:
        etype = rng.choice(tuple(_COMPARE_DIRECT))
        via: str | None = None
        templates = _COMPARE_DIRECT[etype]
    else:
        via = rng.choice(tuple(_COMPARE_VIA))
        etype = RELATIONS[via].subject
        templates = _COMPARE_VIA[via]
    a, b = _random_entity(world, etype, rng), _random_entity(world, etype, rng)
    if a == b:
        return None

    def value_and_support(gid: int) -> tuple[int, list[str], list[int]]:
        if via is None:
            year_rel = _YEAR_OF[etype]
            return world.fact(year_rel, gid), [world.fact_passage_id(year_rel, gid)], [gid]
        person = world.fact(via, gid)
        return (
            world.fact("birth_year", person),
            [world.fact_passage_id(via, gid), world.fact_passage_id("birth_year", person)],
            [gid, person],
        )

    year_a, support_a, chain_a = value_and_support(a)
    year_b, support_b, chain_b = value_and_support(b)
    if year_a == year_b or set(chain_a) & set(chain_b):
        return None
    earlier = rng.random() < 0.5
    winner = a if (year_a < year_b) == earlier else b
    question = rng.choice(templates).format(cmp="earlier" if earlier else "later", a=world.names[a],
                                            b=world.names[b])
    metadata = {
        "hops": hops,
        "type": "comparison",
        "supporting_ids": support_a + support_b,
        "chain": [world.names[g] for g in chain_a + chain_b],
        "relations": ([via] if via else []) + [_YEAR_OF["person" if via else etype]],
        "compare": "earlier" if earlier else "later",
        "values": [year_a, year_b],
    }
    if via is None:
        facts = [(_YEAR_OF[etype], a), (_YEAR_OF[etype], b)]
    else:
        facts = [(via, a), ("birth_year", world.fact(via, a)), (via, b), ("birth_year", world.fact(via, b))]
    _label_knowledge(world, metadata, facts)
    key = ("compare", min(a, b), max(a, b), via)
    return key, QAExample(id="", question=question, golden_answers=[world.names[winner]], metadata=metadata)


KNOWLEDGE_TYPES = ("all-known", "mixed", "all-unknown")


def knowledge_type(known_hops: list[bool]) -> str:
    """A question's side of the boundary from its hops: every hop known, none, or some."""
    if all(known_hops):
        return "all-known"
    return "mixed" if any(known_hops) else "all-unknown"


def _label_knowledge(world: World, metadata: dict[str, Any], facts: list[tuple[str, int]]) -> None:
    """Per hop (in `supporting_ids` order) whether its fact is known, and the question's type; only in a
    world with a knowledge boundary, so a world without one writes the same files as before."""
    if world.known_fraction is None:
        return
    known = [world.is_known(relation, gid) for relation, gid in facts]
    metadata["known_hops"] = known
    metadata["knowledge"] = knowledge_type(known)


def knowledge_statements(world: World) -> Iterator[dict[str, Any]]:
    """Closed-book statements of every known fact: the knowledge-injection SFT data.

    One record per known fact and question template of its relation (the phrasings the world's
    questions use), each with the fact's sentence, so a model can be taught the fact without its
    passage: {"id", "relation", "subject", "question", "answers", "statement"}."""
    for etype in ENTITY_TYPES:
        for gid in range(world.type_start[etype], world.type_start[etype] + world.type_count[etype]):
            for relation in _RELATIONS_BY_SUBJECT[etype]:
                if not world.is_known(relation.name, gid):
                    continue
                value = world.fact(relation.name, gid)
                answers = [str(value)] if relation.target == "year" else world.answers_for(value)
                statement = relation.sentences[0].format(s=world.names[gid], o=answers[0], dir="north")
                for k, template in enumerate(relation.questions):
                    yield {"id": f"fact-{relation.name}-{gid}-{k}", "relation": relation.name,
                           "subject": world.names[gid], "question": template.format(x=world.mention(gid)),
                           "answers": answers, "statement": statement}


def _make_questions(
    world: World, num_questions: int, rng: random.Random, progress: Callable[[int], None] | None
) -> list[QAExample]:
    lo, hi = world.hops
    questions: list[QAExample] = []
    seen: set[tuple] = set()
    max_attempts = 50 * num_questions + 1000
    attempts = 0
    width = max(6, len(str(num_questions)))
    while len(questions) < num_questions:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"could only make {len(questions)} distinct questions of {num_questions} requested from "
                f"{world.num_passages} passages with hops {lo}-{hi}; use more passages or fewer questions"
            )
        hops = rng.randint(lo, hi)
        # Comparisons exist at 2 and 4 hops; about a third of those questions are comparisons.
        if hops in (2, 4) and rng.random() < 0.35:
            made = _comparison_question(world, hops, rng)
        else:
            made = _chain_question(world, hops, rng)
        if made is None or made[0] in seen:
            continue
        key, example = made
        seen.add(key)
        example.id = f"synth-{len(questions):0{width}d}"
        questions.append(example)
        if progress is not None and len(questions) % 1000 == 0:
            progress(len(questions))
    return questions


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def split_sizes(n: int, splits: tuple[float, float, float]) -> tuple[int, int, int]:
    """Train/dev/test sizes; fractions must be >= 0 and sum to 1. Test takes the rounding remainder."""
    if len(splits) != 3 or any(s < 0 for s in splits) or abs(sum(splits) - 1.0) > 1e-6:
        raise ValueError(f"splits must be three non-negative fractions summing to 1, got {splits}")
    n_train = round(n * splits[0])
    n_dev = min(n - n_train, round(n * splits[1]))
    return n_train, n_dev, n - n_train - n_dev


def world_summary(world: World, splits: tuple[int, int, int] | None = None) -> dict[str, Any]:
    hop_counts = Counter(q.metadata["hops"] for q in world.questions)
    type_counts = Counter(q.metadata["type"] for q in world.questions)
    summary: dict[str, Any] = {
        "generator_version": GENERATOR_VERSION,
        "seed": world.seed,
        "num_passages": world.num_passages,
        "num_entities": world.num_entities,
        "entity_counts": dict(world.type_count),
        "num_questions": len(world.questions),
        "hops": list(world.hops),
        "hop_distribution": {str(h): hop_counts[h] for h in sorted(hop_counts)},
        "type_distribution": {t: type_counts[t] for t in sorted(type_counts)},
    }
    if world.known_fraction is not None:
        knowledge_counts = Counter(q.metadata["knowledge"] for q in world.questions)
        summary["known_fraction"] = world.known_fraction
        summary["knowledge_distribution"] = {t: knowledge_counts[t] for t in KNOWLEDGE_TYPES}
    if splits is not None:
        summary["splits"] = dict(zip(("train", "dev", "test"), splits, strict=True))
    return summary


def write_world(
    world: World,
    out_dir: str | Path,
    splits: tuple[float, float, float] = (0.8, 0.1, 0.1),
    progress: Callable[[int], None] | None = None,
    *,
    corpus_size: int | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Write corpus.jsonl, train/dev/test.jsonl (FlashRAG), world.json and, in a world with a knowledge
    boundary, knowledge.jsonl (`knowledge_statements`); return the summary.

    Questions are already in random order, so splits are consecutive slices. `progress(n)` is
    called with the number of passages written every 10k passages. `corpus_size` (>= the world's
    passages) appends distractor passages (`sleuth.data.distractors`) after the world's own until
    the corpus holds that many, made by `workers` processes; the bytes do not depend on `workers`.
    """
    from sleuth.data.distractors import corpus_line, distractor_pools, write_distractors
    from sleuth.data.formats import atomic_open_text, write_qa_jsonl
    from sleuth.utils import atomic_write_text

    sizes = split_sizes(len(world.questions), splits)
    n_distractors = 0 if corpus_size is None else corpus_size - world.num_passages
    if n_distractors < 0:
        raise ValueError(
            f"corpus_size {corpus_size} is smaller than the world's {world.num_passages} passages; "
            "raise it or lower the world's passages"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    written = 0
    with atomic_open_text(out / "corpus.jsonl") as f:
        for p in world.iter_passages():
            f.write(corpus_line(p))
            written += 1
            if progress is not None and written % 10_000 == 0:
                progress(written)
        if n_distractors:
            base = written
            written += write_distractors(
                f, distractor_pools(world), n_distractors, world.num_passages, workers=workers,
                progress=None if progress is None else (lambda n: progress(base + n)),
            )
    if progress is not None:
        progress(written)
    bounds = (0, sizes[0], sizes[0] + sizes[1], len(world.questions))
    for name, lo, hi in zip(("train", "dev", "test"), bounds[:-1], bounds[1:], strict=True):
        write_qa_jsonl(out / f"{name}.jsonl", world.questions[lo:hi])
    summary = world_summary(world, sizes)
    if world.known_fraction is not None:
        n_statements = 0
        with atomic_open_text(out / KNOWLEDGE_FILE) as f:
            for record in knowledge_statements(world):
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                n_statements += 1
        summary["known_statements"] = n_statements
    if n_distractors:
        # world.json describes the world; the corpus size and how it was grown are recorded beside it.
        summary["corpus"] = {"num_passages": written, "world_passages": world.num_passages,
                             "distractor_passages": n_distractors, "distractor_block": DISTRACTOR_BLOCK}
    # sort_keys keeps world.json byte-identical across runs and Python versions.
    atomic_write_text(out / "world.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
