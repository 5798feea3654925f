"""Fictional names for the synthetic world: syllables with onsets English does not use word-initially, so no
pretrained model knows an entity."""

from __future__ import annotations

import random
from collections.abc import Callable

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "h", "j", "th", "br", "dr")


# Word-initial clusters English does not have; every name word contains one of them.
RARE_ONSETS = ("zv", "kv", "vr", "zh", "xh", "dz", "tl", "vh", "ghr", "skr", "thv", "kh", "qv", "mv")


VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "y", "ao")


CODAS = ("", "", "", "n", "r", "s", "l", "k", "th", "x", "m", "sh", "rn")


SYLLABLES = tuple(o + v + c for o in ONSETS for v in VOWELS for c in CODAS)


RARE_SYLLABLES = tuple(o + v + c for o in RARE_ONSETS for v in VOWELS for c in CODAS)


CITY_ENDINGS = ("ton", "ven", "ar", "holm", "mere", "ford", "wick", "grad", "by", "stead", "port")


COUNTRY_ENDINGS = ("ia", "stan", "or", "and", "enia", "ovia", "esh", "aria")


COUNTRY_FORMS = ("Republic", "Kingdom", "Federation", "Commonwealth", "Principality", "Union")


ORG_SUFFIXES = (
    "Group",
    "Institute",
    "Works",
    "Foundation",
    "Holdings",
    "Laboratories",
    "Company",
    "Society",
    "Trust",
)


TITLE_NOUNS = (
    "Tides",
    "Lantern",
    "Harvest",
    "Mirror",
    "Winter",
    "Echoes",
    "Garden",
    "Signal",
    "Crown",
    "River",
    "Ashes",
    "Horizon",
    "Orchard",
    "Silence",
    "Engine",
    "Compass",
    "Letters",
    "Shadows",
)


BAND_NOUNS = ("Engines", "Sparrows", "Wolves", "Lanterns", "Machines", "Saints", "Rivers", "Giants", "Comets")


OCCUPATIONS = (
    "painter",
    "engineer",
    "novelist",
    "physician",
    "architect",
    "composer",
    "chemist",
    "diplomat",
    "photographer",
    "economist",
    "sculptor",
    "historian",
    "lawyer",
)


INDUSTRIES = (
    "shipping",
    "software",
    "textile",
    "publishing",
    "mining",
    "biotechnology",
    "insurance",
    "aviation",
    "agricultural",
    "energy",
)


GENRES = ("drama", "comedy", "thriller", "documentary", "science fiction", "romance", "mystery", "western")


BOOK_KINDS = ("novel", "memoir", "poetry collection", "short story collection", "history", "essay collection")


MUSIC = ("folk", "post-punk", "jazz", "synth-pop", "metal", "indie rock", "electronic", "blues")


DIRECTIONS = ("north", "south", "east", "west", "northeast", "southwest")


def syllable_word(rng: random.Random, n_syllables: int) -> str:
    """A made-up word of `n_syllables` syllables, one (at a random position) with a rare onset."""
    rare_at = rng.randrange(n_syllables)
    parts = [
        RARE_SYLLABLES[rng.randrange(len(RARE_SYLLABLES))]
        if i == rare_at
        else SYLLABLES[rng.randrange(len(SYLLABLES))]
        for i in range(n_syllables)
    ]
    return "".join(parts).capitalize()


class NameMaker:
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
