"""The synthetic world's schema: entity types and the relations between them (each with its passage
sentences, question wordings and noun phrases), and which relations chain or compare."""

from __future__ import annotations

from dataclasses import dataclass

ENTITY_TYPES = ("country", "city", "person", "organization", "film", "book", "band")


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
            "born_in",
            "person",
            "city",
            ("the birthplace of {x}", "the city where {x} was born"),
            ("Where was {x} born?", "In which city was {x} born?", "What is the birthplace of {x}?"),
            ("{s} was born in {o}.", "{s} is a native of {o}.", "{s} was born and raised in {o}."),
        ),
        Relation(
            "birth_year",
            "person",
            "year",
            (),
            ("In which year was {x} born?", "What year was {x} born in?"),
            ("{s} was born in {o}.", "{s}'s year of birth is {o}."),
        ),
        Relation(
            "works_for",
            "person",
            "organization",
            ("the employer of {x}", "the organization {x} works for"),
            ("Which organization does {x} work for?", "Who is the employer of {x}?"),
            (
                "{s} works for {o}.",
                "{s} is employed by {o}.",
                "For most of their career, {s} has worked at {o}.",
            ),
        ),
        Relation(
            "located_in",
            "city",
            "country",
            ("the country where {x} is located", "the country that {x} is in"),
            ("In which country is {x}?", "Which country is {x} located in?"),
            ("{s} is a city in {o}.", "{s} is located in {o}.", "{s} lies in the {dir} of {o}."),
        ),
        Relation(
            "mayor",
            "city",
            "person",
            ("the mayor of {x}",),
            ("Who is the mayor of {x}?", "Who serves as mayor of {x}?"),
            ("The mayor of {s} is {o}.", "{o} serves as the mayor of {s}."),
        ),
        Relation(
            "capital",
            "country",
            "city",
            ("the capital of {x}", "the capital city of {x}"),
            ("What is the capital of {x}?", "Which city is the capital of {x}?"),
            ("The capital of {s} is {o}.", "{o} is the capital and largest city of {s}."),
        ),
        Relation(
            "founded_by",
            "organization",
            "person",
            ("the founder of {x}", "the person who founded {x}"),
            ("Who founded {x}?", "Who is the founder of {x}?"),
            ("{s} was founded by {o}.", "{o} founded {s}."),
        ),
        Relation(
            "headquartered_in",
            "organization",
            "city",
            ("the city where {x} is headquartered", "the headquarters city of {x}"),
            ("Where is {x} headquartered?", "In which city is {x} headquartered?"),
            ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}."),
        ),
        Relation(
            "founded_year",
            "organization",
            "year",
            (),
            ("In which year was {x} founded?", "When was {x} founded?"),
            ("{s} was founded in {o}.", "{s} was established in {o}."),
        ),
        Relation(
            "directed_by",
            "film",
            "person",
            ("the director of {x}", "the person who directed {x}"),
            ("Who directed {x}?", "Who is the director of {x}?"),
            ("{s} is a film directed by {o}.", "{s} was directed by {o}."),
        ),
        Relation(
            "release_year",
            "film",
            "year",
            (),
            ("In which year was {x} released?", "When was {x} released?"),
            ("{s} was released in {o}.", "{s} premiered in {o}."),
        ),
        Relation(
            "written_by",
            "book",
            "person",
            ("the author of {x}", "the writer of {x}"),
            ("Who wrote {x}?", "Who is the author of {x}?"),
            ("{s} is a book by {o}.", "{s} was written by {o}."),
        ),
        Relation(
            "publication_year",
            "book",
            "year",
            (),
            ("In which year was {x} published?", "When was {x} first published?"),
            ("{s} was first published in {o}.", "{s} appeared in print in {o}."),
        ),
        Relation(
            "formed_in",
            "band",
            "city",
            ("the city where {x} was formed", "the hometown of {x}"),
            ("In which city was {x} formed?", "Where was {x} formed?"),
            ("{s} is a band from {o}.", "{s} was formed in {o}."),
        ),
        Relation(
            "lead_singer",
            "band",
            "person",
            ("the lead singer of {x}", "the vocalist of {x}"),
            ("Who is the lead singer of {x}?", "Who sings lead vocals for {x}?"),
            ("The lead singer of {s} is {o}.", "{o} is the lead vocalist of {s}."),
        ),
        Relation(
            "formed_year",
            "band",
            "year",
            (),
            ("In which year was {x} formed?", "When was {x} formed?"),
            ("{s} formed in {o}.", "{s} was founded as a band in {o}."),
        ),
    )
}


RELATIONS_BY_SUBJECT: dict[str, list[Relation]] = {t: [] for t in ENTITY_TYPES}


# A chain may not use these consecutively: capital then located_in returns the start country.
FORBIDDEN_PAIRS = {("capital", "located_in")}


# The year attribute of each type that has one (used by comparison questions).
YEAR_OF = {
    "person": "birth_year",
    "organization": "founded_year",
    "film": "release_year",
    "book": "publication_year",
    "band": "formed_year",
}


COMPARE_DIRECT = {
    "person": ("Who was born {cmp}, {a} or {b}?", "Which person was born {cmp}: {a} or {b}?"),
    "organization": (
        "Which organization was founded {cmp}, {a} or {b}?",
        "Which was founded {cmp}, {a} or {b}?",
    ),
    "film": (
        "Which film was released {cmp}, {a} or {b}?",
        "Which came out {cmp}, the film {a} or the film {b}?",
    ),
    "book": (
        "Which book was published {cmp}, {a} or {b}?",
        "Which was published {cmp}, the book {a} or the book {b}?",
    ),
    "band": (
        "Which band was formed {cmp}, {a} or {b}?",
        "Which was formed {cmp}, the band {a} or the band {b}?",
    ),
}


# Comparisons through a person: "Whose director was born earlier, film A or film B?"
COMPARE_VIA = {
    "directed_by": ("Whose director was born {cmp}, the film {a} or the film {b}?",),
    "written_by": ("Whose author was born {cmp}, the book {a} or the book {b}?",),
    "founded_by": ("Whose founder was born {cmp}, {a} or {b}?",),
    "lead_singer": ("Whose lead singer was born {cmp}, the band {a} or the band {b}?",),
}


# Facts moved to an entity's second passage, and that passage's title suffix.
EXTRA_PASSAGE = {
    "person": ("early life", ("born_in", "birth_year")),
    "organization": ("history", ("founded_by", "founded_year")),
    "film": ("release", ("release_year",)),
    "book": ("publication", ("publication_year",)),
    "band": ("history", ("formed_in", "formed_year")),
}
