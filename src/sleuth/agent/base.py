"""What an agent loop declares, and the per-trajectory state the rollout engine keeps.

A loop (one per method) says: its stop strings, its initial chat messages, how an
action is parsed from one generated turn (`act`), what the environment answers
(`observe`), and how the finished trajectory is summarised (`finalize`). The
engine (`sleuth.agent.engine.rollout`) owns everything shared: batching, token
bookkeeping, loss masks, budgets and retrieval calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from sleuth import tags
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit, format_docs


@dataclass
class StepOutcome:
    """What one generated turn asks of the environment."""

    queries: list[str] = field(default_factory=list)  # searches to run now (batched by the engine)
    k: int | None = None  # docs per query; None = the loop's top_k
    feedback: str | None = None  # text inserted instead of documents (invalid action, rethink...)
    done: bool = False
    finish_reason: str = ""  # set when done
    # keep generating in the same turn without inserting anything (s3: "<search_complete>False" then a query)
    continue_generation: bool = False
    invalid: bool = False  # the turn held no recognised action


@dataclass
class Observation:
    """Inserted text: `prefix` and `suffix` are kept whole, `body` is what gets truncated to the token limit."""

    prefix: str = ""
    body: str = ""
    suffix: str = ""
    # False: the body is outside text (documents) whose tag-like text the engine neutralises;
    # True: the loop's own words (feedback messages), inserted as written
    trusted: bool = False
    # several queries' documents (a multi-query turn): (header, documents) per query in query order, used
    # instead of `body`; the engine keeps each header whole and shares the token limit fairly among the
    # documents (`fair_shares`)
    parts: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class RolloutState:
    """One trajectory in flight."""

    example: QAExample
    traj: Trajectory
    group: int
    sample: int
    prompt_ids: list[int]
    turns_taken: int = 0  # completed action rounds (continuations do not count)
    final: bool = False  # the next generation is the forced last one: its searches are not run
    done: bool = False
    policy_text: str = ""  # all generated text, in order: actions are parsed from this, never from documents
    windows: list[list[Hit]] = field(default_factory=list)  # documents of each inserted observation
    data: dict[str, Any] = field(default_factory=dict)  # loop-specific scratch


def innermost_blocks(text: str, tag: str) -> list[str]:
    """Contents of every `<tag>...</tag>` block, innermost when tags are nested (`<a><a>x</a>` gives `x`)."""
    return tags.innermost_blocks(text, tag)


def first_block(text: str, tag: str) -> str | None:
    found = next(tags.iter_innermost_blocks(text, tag), None)
    return None if found is None else found.content


def last_block(text: str, tag: str) -> str | None:
    found = innermost_blocks(text, tag)
    return found[-1] if found else None


def first_action(text: str, names: tuple[str, ...]) -> tuple[str, str] | None:
    """The earliest complete block among `names` as (tag, content), e.g. the first `<search>` or `<answer>`."""
    found = tags.first_innermost(text, names)
    return None if found is None else (found.tag, found.content)


def count_tag(text: str, tag: str) -> int:
    return sum(1 for _ in tags.iter_innermost_blocks(text, tag))


def tag_sequence(text: str, names: tuple[str, ...]) -> list[str]:
    """Names of the complete blocks among `names`, in order of appearance (for structure checks)."""
    return tags.tag_sequence(text, names)


QUERY_SEPARATOR = "##"  # ParallelSearch (2508.09303): <search> sub-question 1 ## sub-question 2 </search>


def split_queries(content: str, max_queries: int) -> list[str]:
    """The queries of one `<search>` block: the whole stripped content when `max_queries` is 1 (today's rule),
    else its `##`-separated parts, stripped, empty ones dropped."""
    if max_queries <= 1:
        return [content.strip()]
    return [q.strip() for q in content.split(QUERY_SEPARATOR) if q.strip()]


def fair_shares(lengths: list[int], room: int) -> list[int]:
    """How many tokens each of several parts keeps when together they may use `room`: a part shorter than an
    equal share keeps all of it and what it leaves is shared by the others (water-filling), so no query's
    documents are dropped because an earlier query's were long."""
    shares = [0] * len(lengths)
    left = max(room, 0)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for j, i in enumerate(order):
        shares[i] = min(lengths[i], left // (len(order) - j))
        left -= shares[i]
    return shares


def dedup_hits(hits: list[dict]) -> list[dict]:
    """Drop repeated documents (same id, or same title and text), keeping first occurrences in order."""
    seen: set = set()
    out: list[dict] = []
    for h in hits:
        keys = {("id", h.get("doc_id")), ("content", h.get("title"), h.get("text"))}
        if keys & seen:
            continue
        seen |= keys
        out.append(h)
    return out


def all_retrieved(traj: Trajectory) -> list[dict]:
    return dedup_hits([h for hits in traj.retrieved for h in hits])


@dataclass
class AgentLoop:
    """Base class of the method loops. Subclasses are dataclasses; their fields are the config values."""

    name: ClassVar[str] = ""
    top_k: int = 3
    max_turns: int = 4
    # after max_turns action rounds, one more generation with search disabled (Search-R1's final rollout)
    forced_final_answer: bool = True
    system_template: str | None = None
    user_template: str = "{question}"
    invalid_action_message: str = ""
    # how many times one turn may be resumed without inserting anything (see StepOutcome.continue_generation)
    max_continuations: int = 0
    # ParallelSearch: one `<search>` may hold up to this many `##`-separated queries, searched together and
    # answered in one observation with a header per query; 1 = one query a turn (the whole block)
    max_queries_per_turn: int = 1
    # whether `act` honours max_queries_per_turn (the search-or-answer loops: `search_r1.search_or_answer`)
    multi_query_turns: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(f"{self.name}: top_k must be >= 1, got {self.top_k}")
        if self.max_turns < 1:
            raise ConfigError(f"{self.name}: max_turns must be >= 1, got {self.max_turns}")
        if "{question}" not in self.user_template:
            raise ConfigError(f"{self.name}: user_template must contain '{{question}}'")
        if self.max_queries_per_turn < 1:
            raise ConfigError(
                f"{self.name}: max_queries_per_turn must be >= 1, got {self.max_queries_per_turn}"
            )
        if self.max_queries_per_turn > 1 and not self.multi_query_turns:
            raise ConfigError(
                f"{self.name}: max_queries_per_turn > 1 needs a loop whose action reads several "
                "queries a turn (the search-or-answer loops); this one does not"
            )

    # -- what the loop declares -------------------------------------------------------------
    def stop_strings(self, state: RolloutState) -> list[str]:
        raise NotImplementedError

    def initial_queries(self, example: QAExample) -> list[str]:
        """Searches run before the first generation (s3's begin-with-search); none by default."""
        return []

    def build_messages(self, example: QAExample, initial_hits: list[list[Hit]]) -> list[dict]:
        user = self.user_template.format(question=example.question.strip())
        messages = []
        if self.system_template:
            messages.append({"role": "system", "content": self.system_template})
        messages.append({"role": "user", "content": user})
        return messages

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        """Parse the turn just generated (`text`, already appended to `state.policy_text`)."""
        raise NotImplementedError

    def format_documents(self, hits: list[Hit]) -> str:
        return format_docs(hits)

    def observe(self, state: RolloutState, outcome: StepOutcome, hits: list[list[Hit]]) -> Observation:
        """The environment's answer to a search: one `<information>` block with every query's documents."""
        return self.documents_observation(outcome, hits, "\n\n<information>", "</information>\n\n")

    def documents_observation(self, outcome: StepOutcome, hits: list[list[Hit]], prefix: str,
                              suffix: str) -> Observation:  # fmt: skip
        """`prefix`, the documents, `suffix`. A multi-query turn (max_queries_per_turn > 1, several queries) gets
        a "Query i: q" header before each query's documents, in query order; otherwise all documents in one body."""
        if self.max_queries_per_turn > 1 and len(hits) > 1:
            pairs = enumerate(zip(outcome.queries, hits, strict=True))
            parts = [
                (("\n\n" if i else "") + f"Query {i + 1}: {q}\n", self.format_documents(per_query).strip())
                for i, (q, per_query) in pairs
            ]
            return Observation(prefix, "", suffix, parts=parts)
        flat = [h for per_query in hits for h in per_query]
        return Observation(prefix, self.format_documents(flat).strip(), suffix)

    def feedback(self, state: RolloutState, message: str) -> Observation:
        return Observation("", message, "", trusted=True)

    def finalize(self, state: RolloutState) -> None:
        """Fill the semantic view (answer, served context, format flags) once the trajectory is done."""
        traj = state.traj
        answer = last_block(state.policy_text, "answer")
        traj.answer = answer.strip() if answer is not None else None
        traj.served_context = all_retrieved(traj)
        traj.extra["answer_count"] = count_tag(state.policy_text, "answer")

    # -- config ------------------------------------------------------------------------------
    @classmethod
    def config_fields(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
