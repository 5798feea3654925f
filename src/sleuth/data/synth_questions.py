"""Multi-hop questions over a synthetic world: chains and comparisons, each with its gold passages, and the
knowledge labels of a world with a boundary."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from sleuth.data.formats import QAExample
from sleuth.data.world import World
from sleuth.data.world_schema import (
    COMPARE_DIRECT,
    COMPARE_VIA,
    ENTITY_TYPES,
    FORBIDDEN_PAIRS,
    RELATIONS,
    RELATIONS_BY_SUBJECT,
    YEAR_OF,
    Relation,
)


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
            r
            for r in RELATIONS_BY_SUBJECT[etype]
            if (last or r.target != "year")
            and not (relations and (relations[-1].name, r.name) in FORBIDDEN_PAIRS)
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
        etype = rng.choice(tuple(COMPARE_DIRECT))
        via: str | None = None
        templates = COMPARE_DIRECT[etype]
    else:
        via = rng.choice(tuple(COMPARE_VIA))
        etype = RELATIONS[via].subject
        templates = COMPARE_VIA[via]
    a, b = _random_entity(world, etype, rng), _random_entity(world, etype, rng)
    if a == b:
        return None

    def value_and_support(gid: int) -> tuple[int, list[str], list[int]]:
        if via is None:
            year_rel = YEAR_OF[etype]
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
    question = rng.choice(templates).format(
        cmp="earlier" if earlier else "later", a=world.names[a], b=world.names[b]
    )
    metadata = {
        "hops": hops,
        "type": "comparison",
        "supporting_ids": support_a + support_b,
        "chain": [world.names[g] for g in chain_a + chain_b],
        "relations": ([via] if via else []) + [YEAR_OF["person" if via else etype]],
        "compare": "earlier" if earlier else "later",
        "values": [year_a, year_b],
    }
    if via is None:
        facts = [(YEAR_OF[etype], a), (YEAR_OF[etype], b)]
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
            for relation in RELATIONS_BY_SUBJECT[etype]:
                if not world.is_known(relation.name, gid):
                    continue
                value = world.fact(relation.name, gid)
                answers = [str(value)] if relation.target == "year" else world.answers_for(value)
                statement = relation.sentences[0].format(s=world.names[gid], o=answers[0], dir="north")
                for k, template in enumerate(relation.questions):
                    yield {
                        "id": f"fact-{relation.name}-{gid}-{k}",
                        "relation": relation.name,
                        "subject": world.names[gid],
                        "question": template.format(x=world.mention(gid)),
                        "answers": answers,
                        "statement": statement,
                    }


def make_questions(
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
