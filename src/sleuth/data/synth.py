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

This module generates and writes a world; its parts are modules of their own: the schema (entity types,
relations: sleuth.data.world_schema), the names (sleuth.data.names), the `World` and its passages
(sleuth.data.world) and the questions (sleuth.data.synth_questions).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sleuth.data.distractors import BLOCK as DISTRACTOR_BLOCK
from sleuth.data.distractors import corpus_line, distractor_pools, write_distractors
from sleuth.data.formats import atomic_open_text, write_qa_jsonl
from sleuth.data.names import (
    BAND_NOUNS,
    CITY_ENDINGS,
    COUNTRY_ENDINGS,
    COUNTRY_FORMS,
    ORG_SUFFIXES,
    TITLE_NOUNS,
    NameMaker,
    syllable_word,
)
from sleuth.data.synth_questions import KNOWLEDGE_TYPES, knowledge_statements, make_questions
from sleuth.data.world import World
from sleuth.data.world_schema import ENTITY_TYPES, EXTRA_PASSAGE, RELATIONS, RELATIONS_BY_SUBJECT
from sleuth.utils import atomic_write_text

GENERATOR_VERSION = "sleuth-synth/1"


MAX_HOPS = 5


MIN_PASSAGES = 40


KNOWLEDGE_FILE = "knowledge.jsonl"  # closed-book statements of the known facts (a world with a boundary)


LATEST_YEAR = 2024


# Shares of the non-country entities; countries grow like sqrt(n) so each holds many cities.
_TYPE_SHARES = {"city": 0.12, "person": 0.38, "organization": 0.12, "film": 0.14, "book": 0.14, "band": 0.10}


# Fraction of passages that are a second passage about an already-described entity.
_EXTRA_PASSAGE_RATE = 0.12


for _r in RELATIONS.values():
    RELATIONS_BY_SUBJECT[_r.subject].append(_r)


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


def _build_names(
    world_counts: dict[str, int], rng: random.Random
) -> tuple[list[str], list[str], dict[int, int]]:
    """Names for every entity, countries' official names, and the confusable pairs."""
    maker = NameMaker(rng)
    names: list[str] = []
    official: list[str] = []
    similar: dict[int, int] = {}

    def pair(a: int, b: int) -> None:
        similar.setdefault(a, b)
        similar.setdefault(b, a)

    for _ in range(world_counts["country"]):
        name = maker.unique(lambda: syllable_word(rng, 2) + rng.choice(COUNTRY_ENDINGS))
        official.append(f"{rng.choice(COUNTRY_FORMS)} of {name}")
        names.append(name)

    def stem_family(
        count: int, make_stem: Callable[[], str], variants: tuple[str, ...], join: Callable[[str, str], str]
    ) -> None:
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

    stem_family(world_counts["city"], lambda: syllable_word(rng, 2), CITY_ENDINGS, lambda s, v: s + v)

    # People: given name + family name; families are shared (about three members each), which
    # makes "X Vrakon" vs "Y Vrakon" the natural confusable pair.
    n_people = world_counts["person"]
    given = [syllable_word(rng, 2) for _ in range(max(50, n_people // 8))]
    families = [syllable_word(rng, rng.choice((2, 2, 3))) for _ in range(max(3, n_people // 3))]
    first_of_family: dict[int, int] = {}
    for _ in range(n_people):
        gid = len(names)
        family = rng.randrange(len(families))
        names.append(maker.unique(lambda f=family: f"{given[rng.randrange(len(given))]} {families[f]}"))
        if family in first_of_family:
            pair(gid, first_of_family[family])
        else:
            first_of_family[family] = gid

    stem_family(
        world_counts["organization"], lambda: syllable_word(rng, 2), ORG_SUFFIXES, lambda s, v: f"{s} {v}"
    )
    stem_family(
        world_counts["film"],
        lambda: syllable_word(rng, 2),
        TITLE_NOUNS,
        lambda s, v: f"{s} {v}" if len(s) % 2 else f"The {v} of {s}",
    )
    stem_family(
        world_counts["book"],
        lambda: syllable_word(rng, 2),
        TITLE_NOUNS,
        lambda s, v: f"The {s} {v}" if len(s) % 2 else f"{v} for {s}",
    )
    stem_family(world_counts["band"], lambda: syllable_word(rng, 2), BAND_NOUNS, lambda s, v: f"The {s} {v}")
    return names, official, similar


def _build_facts(
    counts: dict[str, int], start: dict[str, int], rng: random.Random
) -> tuple[dict[str, list[int]], dict[int, list[tuple[str, int]]], dict[int, list[int]]]:
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
    eligible_types = [t for t in ENTITY_TYPES if t in EXTRA_PASSAGE]
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
        seed=seed,
        hops=hops,
        num_passages=num_passages,
        names=names,
        type_start=start,
        type_count=counts,
        facts=facts,
        official_names=official,
        similar=similar,
        works=works,
        country_cities=country_cities,
        extra_passage=extra_passage,
        known_fraction=known_fraction,
    )
    world.questions = make_questions(world, num_questions, random.Random(f"{seed}/questions"), progress)
    return world


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
                f,
                distractor_pools(world),
                n_distractors,
                world.num_passages,
                workers=workers,
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
        summary["corpus"] = {
            "num_passages": written,
            "world_passages": world.num_passages,
            "distractor_passages": n_distractors,
            "distractor_block": DISTRACTOR_BLOCK,
        }
    # sort_keys keeps world.json byte-identical across runs and Python versions.
    atomic_write_text(out / "world.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
