"""The generation protocol shared by the searcher policy, frozen generators and judges.

`generate(batch, stop, params)`: a batch item is one of
- a text prompt (`str`), sent as is;
- chat messages (`list[dict]` with "role"/"content"), to which the backend applies
  the model's chat template (HTTP backends use the chat endpoint);
- token ids (`list[int]`): token-in/token-out, used by the RL rollout engine so
  that loss masks are built from the ids actually generated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

Prompt = str | list[int] | list[dict]


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Generation:
    """One completion. `token_ids` are exactly the sampled ids (never re-tokenised text)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # "stop" (a stop string matched), "eos", or "length" (max_new_tokens reached)
    finish_reason: str = "length"
    stop: str | None = None  # the stop string that ended the generation, if any


@runtime_checkable
class Generator(Protocol):
    def generate(
        self,
        batch: list[Prompt],
        stop: list[str] | list[list[str]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Generation]:
        """Generate one completion per prompt.

        `stop` is either one list of stop strings for the whole batch or one list
        per prompt. A sequence stops at its own stop string (the stop string is
        kept in `text` and `token_ids`) while the others continue.
        """
        ...


@contextmanager
def shared_prefixes(generator: object) -> Iterator[bool]:
    """While forked trajectories are generated: a generator on the decode engine (`HFGenerator(cache="engine")`)
    holds every row's keys/values so a branch continues from its parent's (`sleuth.llm.decode_engine.DecodeEngine.holding`); yields True
    then. Any other generator (HF dynamic/static cache, vLLM, HTTP) yields False: a branch's prompt is prefilled
    whole again, which gives the same tokens, only slower."""
    if getattr(generator, "cache_kind", None) != "engine":
        yield False
        return
    with generator.engine.holding():  # type: ignore[attr-defined]
        yield True
