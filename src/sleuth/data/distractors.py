"""Distractor passages that grow a synthetic world's corpus to Wikipedia size (21M passages).

A world's questions are answered by its own passages (the gold passages); distractors fill the
corpus up to `corpus_size` passages without changing any answer:

- each distractor is about a *new* entity whose name reuses the world's name parts (a world
  person's given name with another world family name, a world stem with an organisation suffix,
  ...), never a world entity's exact name, so no distractor states a fact about a world entity;
- its sentences use the world's relation templates with world entities as *objects* ("X was born
  in <world city>", "X works for <world organisation>"), so the entity names and relation words
  of a question appear in many passages besides the gold one: gold passages are found only by a
  search that matches the whole question (both name parts and the relation);
- the rest (to ~100 words) is filler drawn from a Zipf distribution (exponent 1) over a
  50,000-word made-up lexicon mixed with English function words (~40% of tokens), a
  Wikipedia-like spread of frequent and rare words.

Passages are made in blocks of `BLOCK` from a generator seeded by (seed, block number), so the
output does not depend on how many processes make it; the streaming writer keeps at most
2 x workers blocks in flight, so its memory does not grow with `corpus_size`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from sleuth.data.formats import Passage
from sleuth.data.world_schema import RELATIONS

BLOCK = 4096
LEXICON_SIZE = 50_000
TARGET_WORDS = 100
# English function words, most frequent first (their Zipf rank among themselves).
_FUNCTION_WORDS = (
    "the",
    "of",
    "and",
    "in",
    "to",
    "a",
    "was",
    "is",
    "for",
    "on",
    "as",
    "with",
    "by",
    "he",
    "at",
    "from",
    "his",
    "an",
    "it",
    "that",
    "which",
    "were",
    "are",
    "this",
    "be",
    "also",
    "or",
    "had",
    "first",
    "after",
    "has",
    "its",
    "their",
    "but",
    "who",
    "her",
    "one",
    "two",
    "new",
    "they",
    "been",
    "she",
    "other",
    "when",
)
_FUNCTION_SHARE = 0.4
_COMMON_SYLLABLES = tuple(
    o + v + c
    for o in ("b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "pr", "tr")
    for v in ("a", "e", "i", "o", "u", "ea", "io", "ou")
    for c in ("", "n", "r", "s", "t", "l", "nd", "ng")
)
_SUFFIX_BY_TYPE = {
    "organization": ("Group", "Institute", "Works", "Foundation", "Holdings", "Company", "Society"),
    "city": ("ton", "ven", "ar", "holm", "mere", "ford", "wick"),
    "film": ("Tides", "Lantern", "Harvest", "Mirror", "Winter", "Echoes", "Garden"),
    "book": ("Letters", "Shadows", "Compass", "Orchard", "Silence", "Engine", "Horizon"),
    "band": ("Engines", "Sparrows", "Wolves", "Lanterns", "Machines", "Saints", "Comets"),
}
_INTRO = {
    "person": "{s} is a {w} {w2}.",
    "organization": "{s} is a {w} organization.",
    "city": "{s} is a town on the {w} river.",
    "film": "{s} is a {w} film.",
    "book": "{s} is a {w} novel.",
    "band": "{s} is a {w} band.",
}


@dataclass(frozen=True)
class DistractorPools:
    """What distractors borrow from a world: name parts, entity names by type, and the names taken."""

    seed: int
    given: tuple[str, ...]
    family: tuple[str, ...]
    names_by_type: dict[str, tuple[str, ...]]
    taken: frozenset[str]


def distractor_pools(world) -> DistractorPools:
    """Name parts and entity names of a `sleuth.data.synth.World` (a few MB for a 100k-passage world)."""
    by_type: dict[str, tuple[str, ...]] = {}
    for etype, start in world.type_start.items():
        by_type[etype] = tuple(world.names[start : start + world.type_count[etype]])
    people = by_type["person"]
    given = tuple(sorted({n.split(" ", 1)[0] for n in people}))
    family = tuple(sorted({n.rsplit(" ", 1)[-1] for n in people}))
    return DistractorPools(world.seed, given, family, by_type, frozenset(world.names))


class _Maker:
    """Makes distractor blocks; built once per process from the pools (the lexicon is derived, not shipped)."""

    def __init__(self, pools: DistractorPools):
        self.pools = pools
        rng = random.Random(f"{pools.seed}/lexicon")
        words: set[str] = set()
        lexicon: list[str] = []
        while len(lexicon) < LEXICON_SIZE:
            w = "".join(rng.choice(_COMMON_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3))))
            if len(w) >= 3 and w not in words and w not in _FUNCTION_WORDS:
                words.add(w)
                lexicon.append(w)
        self.lexicon = np.asarray(lexicon, dtype=object)
        self.function_words = np.asarray(_FUNCTION_WORDS, dtype=object)
        ranks = np.arange(1, LEXICON_SIZE + 1, dtype=np.float64)
        self.lexicon_cdf = np.cumsum(1.0 / ranks) / np.sum(1.0 / ranks)
        franks = np.arange(1, len(_FUNCTION_WORDS) + 1, dtype=np.float64)
        self.function_cdf = np.cumsum(1.0 / franks) / np.sum(1.0 / franks)
        # Relations with an entity target whose subject type a distractor can have.
        self.relations = {etype: [r for r in RELATIONS.values() if r.subject == etype] for etype in _INTRO}

    def _pick(self, rng: np.random.Generator, names: tuple[str, ...]) -> str:
        # Quadratic skew: a few world entities are mentioned very often (long posting lists).
        return names[int(len(names) * rng.random() ** 2)]

    def _name(self, rng: np.random.Generator, etype: str) -> str:
        pools = self.pools
        for _ in range(8):
            fam = pools.family[int(rng.integers(len(pools.family)))]
            if etype == "person":
                name = f"{pools.given[int(rng.integers(len(pools.given)))]} {fam}"
            else:
                suffix = _SUFFIX_BY_TYPE[etype][int(rng.integers(len(_SUFFIX_BY_TYPE[etype])))]
                name = {
                    "organization": f"{fam} {suffix}",
                    "city": fam + suffix.lower(),
                    "film": f"The {suffix} of {fam}",
                    "book": f"{suffix} for {fam}",
                    "band": f"The {fam} {suffix}",
                }[etype]
            if name not in pools.taken:
                return name
        # Every try hit a world name: a lexicon word makes it new (world names have rare onsets).
        return f"{name} {self.lexicon[int(rng.integers(LEXICON_SIZE))].capitalize()}"

    def _filler(self, rng: np.random.Generator, n_words: int) -> list[str]:
        lex = self.lexicon[np.searchsorted(self.lexicon_cdf, rng.random(n_words))]
        fun = self.function_words[np.searchsorted(self.function_cdf, rng.random(n_words))]
        words = np.where(rng.random(n_words) < _FUNCTION_SHARE, fun, lex).tolist()
        sentences: list[str] = []
        pos = 0
        while pos < n_words:
            length = int(rng.integers(8, 17))
            part = words[pos : pos + length]
            sentences.append(part[0].capitalize() + (" " + " ".join(part[1:]) if len(part) > 1 else "") + ".")
            pos += length
        return sentences

    def passage(self, rng: np.random.Generator, number: int, first_id: int) -> Passage:
        etype = tuple(_INTRO)[int(rng.integers(len(_INTRO)))]
        name = self._name(rng, etype)
        lex = self.lexicon
        sentences = [
            _INTRO[etype].format(s=name, w=lex[int(rng.integers(2000))], w2=lex[int(rng.integers(2000))])
        ]
        by_type = self.pools.names_by_type
        relations = self.relations[etype]
        # Distinct relations: each is functional, so one passage states it once.
        for pick in rng.permutation(len(relations))[: int(rng.integers(2, 5))].tolist():
            r = relations[pick]
            obj = (
                str(int(rng.integers(1850, 2025)))
                if r.target == "year"
                else self._pick(rng, by_type[r.target])
            )
            template = r.sentences[int(rng.integers(len(r.sentences)))]
            sentences.append(template.format(s=name, o=obj, dir="north"))
        mentioned = tuple(by_type)[int(rng.integers(len(by_type)))]
        sentences.append(f"{name} is often compared with {self._pick(rng, by_type[mentioned])}.")
        used = sum(s.count(" ") + 1 for s in sentences)
        target = max(TARGET_WORDS // 2, int(rng.normal(TARGET_WORDS, 15)))
        if target > used:
            sentences.extend(self._filler(rng, target - used))
        return Passage(id=str(first_id + number), title=name, text=" ".join(sentences))

    def block(self, block: int, count: int, first_id: int) -> list[Passage]:
        rng = np.random.default_rng([self.pools.seed, 24, block])
        return [self.passage(rng, block * BLOCK + j, first_id) for j in range(count)]


def _blocks(num: int) -> list[tuple[int, int]]:
    return [(b, min(BLOCK, num - b * BLOCK)) for b in range(-(-num // BLOCK))]


def iter_distractors(pools: DistractorPools, num: int, first_id: int) -> Iterator[Passage]:
    """`num` distractor passages with ids `first_id`, `first_id + 1`, ... in one process, in order."""
    maker = _Maker(pools)
    for block, count in _blocks(num):
        yield from maker.block(block, count, first_id)


def corpus_line(p: Passage) -> str:
    """One corpus jsonl line, exactly as `sleuth.data.formats.write_corpus` writes it."""
    return json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n"


_WORKER_MAKER: _Maker | None = None


def _init_worker(pools: DistractorPools) -> None:
    global _WORKER_MAKER
    _WORKER_MAKER = _Maker(pools)


def _block_text(args: tuple[int, int, int]) -> str:
    assert _WORKER_MAKER is not None
    return "".join(corpus_line(p) for p in _WORKER_MAKER.block(*args))


def write_distractors(
    out: TextIO, pools: DistractorPools, num: int, first_id: int, *, workers: int = 1, progress=None
) -> int:
    """Append `num` distractor lines to `out` (same bytes as `iter_distractors` through `corpus_line`).

    With `workers` > 1 the blocks are made by a process pool, at most 2 x workers blocks in flight."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    jobs = [(b, c, first_id) for b, c in _blocks(num)]
    done = 0
    if workers == 1:
        maker = _Maker(pools)
        texts: Iterable[str] = ("".join(corpus_line(p) for p in maker.block(*job)) for job in jobs)
        for text in texts:
            out.write(text)
            done += text.count("\n")
            if progress is not None:
                progress(done)
        return done
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(pools,)) as pool:
        window = 2 * workers
        pending = [pool.submit(_block_text, job) for job in jobs[:window]]
        next_job = len(pending)
        while pending:
            text = pending.pop(0).result()
            if next_job < len(jobs):
                pending.append(pool.submit(_block_text, jobs[next_job]))
                next_job += 1
            out.write(text)
            done += text.count("\n")
            if progress is not None:
                progress(done)
    return done
