"""The oracle policy for cold-start trajectories on the synthetic world.

The oracle is a `Generator`: the real rollout engine drives it, the real retriever answers its
queries and the real environment inserts the documents, so its trajectories carry exactly the token
ids and loss masks an RL rollout builds. Before the rollout it plans every question with the
method's own planner (`Method.oracle_planner`, an `OraclePlanner` of sleuth.agent.oracle_plan
written in the method's module, or the planner of the method its `oracle_format` names); at generation
time it replays the plan one stop string at a time, as a model that stops at `</search>` would.

`oracle_check` says whether a finished trajectory is worth training on: the needed passages were
retrieved (a searcher that does not answer: selected) and the answer is correct.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import encode_prompt
from sleuth.agent.oracle_plan import Plan, known_from_memory, question_facts
from sleuth.agent.registry import get_method, methods
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import Generation, SamplingParams
from sleuth.retrieval.base import Retriever
from sleuth.text import exact_match

__all__ = ["OracleGenerator", "oracle_check", "question_facts"]


class OracleGenerator:
    """Replays per-question plans through the rollout engine (token-in/token-out, like a model)."""

    def __init__(
        self, loop: AgentLoop, retriever: Retriever, tokenizer, examples: Sequence[QAExample], seed: int = 0
    ):
        planner = get_method(loop.name).oracle()
        if planner is None:
            with_oracle = [m.name for m in methods() if m.oracle() is not None]
            raise ConfigError(
                f"no oracle for loop {loop.name!r}; oracles exist for: {', '.join(sorted(with_oracle))} "
                "(a loop with one of their protocols names it: Method.oracle_format)"
            )
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
        raise ConfigError(
            "oracle: a prompt the oracle did not plan for (examples and loop must match the rollout)"
        )

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
            if (
                reason == "eos"
                and self.tokenizer.eos_token_id is not None
                and text != self.tokenizer.eos_token
            ):
                ids.append(self.tokenizer.eos_token_id)
            out.append(
                Generation(
                    text=text, token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=reason, stop=hit
                )
            )
        return out


def oracle_check(traj: Trajectory, example: QAExample) -> bool:
    """The needed passages were gathered (a searcher that does not answer: selected) and the final answer, if the loop answers, is right."""
    needed = {f.doc_id for f in question_facts(example)}
    if not get_method(traj.method).answers:  # a searcher only (s3): judged by the documents it selected
        return needed <= {str(h["doc_id"]) for h in traj.selected}
    retrieved = {str(h["doc_id"]) for hits in traj.retrieved for h in hits}
    if known_from_memory(
        example
    ):  # the oracle answered from what the model was taught: nothing had to be found
        needed = set()
    return (
        needed <= retrieved
        and traj.answer is not None
        and exact_match(traj.answer, example.golden_answers) > 0
    )
