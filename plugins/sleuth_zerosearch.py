"""ZeroSearch (Sun et al. 2025, arXiv 2505.04588) as a sleuth plugin: a search agent trained against a
simulated search engine, an LLM that writes the documents, with a curriculum that makes them noisier.

One module, outside sleuth (the method plugin mechanism, docs/architecture.md "How to add a method"):
- the retriever: `SimulatedSearchEngine`, any sleuth generator (a served LLM: `openai:<url>`, a local HF
  model, a scripted one in tests). It declares `wants_context = True`, so the rollout engine hands it the
  question, its gold answers, the turn and (in training) the step with every query
  (`sleuth.retrieval.base.RetrievalContext`).
- the loop: Search-R1's (think / search / answer), showing the simulated documents as ZeroSearch does
  (`Doc i: text`).
- the reward: F1 of the answer against the gold answers (ZeroSearch trains on F1, not EM, which it found
  rewarded over-long answers less).
- the recipe: `recipe(train, total_steps)`; a recipe names the simulator as its retriever location
  `zerosearch:MODEL?total_steps=N` (a registered backend). A generated run (bench/learning.py, `run_sections`)
  uses the policy's frozen base model as the simulator, with no served LLM: a 135M model writes poor documents
  (the paper's simulators are 3B-14B models), so that run measures the machinery, not the paper's claim.
- the cold start: Search-R1's oracle on the real index (`oracle_format`).

Behaviour matched to the public code (Alibaba-NLP/ZeroSearch, llm_agent/generation.py):
- one draw per query: the five documents are all useful when `random() > p`, else all noisy;
- the noise probability p at training step i of m: p = p_s + (b^(i/m) - 1) / (b - 1) * (p_e - p_s), base
  b = 4, p = p_e from step m on (README: p_s = 0, p_e = 0.5);
- the prompt (the "simulate_prompt" mode, for an instruction model; "simulate_sft" for a fine-tuned
  simulator) names the question and its first gold answer, and the text is cut before `Doc {k+1}`.
Not GPU-measured yet (docs/results.md has no ZeroSearch run).
"""

from __future__ import annotations

import math
import random
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import parse_qsl

from sleuth.agent.registry import Method, RunShape, register_method
from sleuth.agent.search_r1 import SearchR1Loop
from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.llm.registry import load_generator
from sleuth.retrieval.backends import OpenContext, RetrieverBackend, register_backend
from sleuth.retrieval.base import Hit, RetrievalContext
from sleuth.rewards.base import Reward, RewardResult, RewardServices, register_reward
from sleuth.rewards.metrics import f1_score

USEFUL, NOISY = "useful", "noisy"

# The "simulate_sft" prompt: for a simulator fine-tuned on real search results.
SFT_PROMPT = (
    "You are the Google search engine.\n"
    "Given a query, you need to generate five {kind} documents for the query.\n\n"
    'The user is trying to answer the question: "{question}" whose answer is {answer}.\n'
    "Each document should contain about 30 words, and these documents should contain {kind} information.\n\n"
    "Query: {query}\n"
    "{label} Output:\n"
)
# The "simulate_prompt" mode: an instruction model told what a useful or a noisy document is.
PROMPT = {
    USEFUL: (
        "You are the Google search engine.\n"
        "Given a query, you need to generate five useful documents for the query.\n\n"
        'The user is trying to answer the question: "{question}" whose answer is {answer}.\n'
        "You should generate documents that can help the user find the answer.\n"
        "Each document should contain about 30 words. Write them as Doc 1: ... Doc 5: ..., one a line.\n"
        "You must directly output the English documents and not output any other texts.\n\n"
        "Query: {query}\n"
        "Useful Output:\n"
    ),
    NOISY: (
        "You are the Google search engine.\n"
        "Given a query, you need to generate five related but noisy documents for the query.\n\n"
        'The user is trying to answer the question: "{question}" whose answer is {answer}.\n'
        "Each document should contain about 30 words, and these documents should contain related but noisy "
        "information: they must not give the answer. Write them as Doc 1: ... Doc 5: ..., one a line.\n"
        "You must directly output the English documents and not output any other texts.\n\n"
        "Query: {query}\n"
        "Noisy Output:\n"
    ),
}
_DOC_START = re.compile(r"^\s*Doc\s*(\d+)\s*[:.)]?\s*", re.IGNORECASE | re.MULTILINE)


def noise_probability(
    step: int | None, total_steps: int, start: float = 0.0, end: float = 0.5, base: float = 4.0
) -> float:
    """ZeroSearch's curriculum: the probability that a query's documents are noisy at training `step` of
    `total_steps`, rising from `start` to `end` along (base^(step/total) - 1) / (base - 1). Outside training
    (`step` None) and from `total_steps` on: `end`."""
    if step is None or step >= total_steps:
        return end
    progress = max(step, 0) / total_steps
    return start + (math.pow(base, progress) - 1) / (base - 1) * (end - start)


def parse_documents(text: str, k: int) -> list[str]:
    """The simulator's `Doc i: ...` documents, at most `k`; text without that layout is one document."""
    text = text.replace("\n\n", "\n")
    cut = re.search(rf"Doc\s*{k + 1}\b", text)  # ZeroSearch cuts the text before Doc k+1
    if cut is not None:
        text = text[: cut.start()]
    starts = list(_DOC_START.finditer(text))
    if not starts:
        return [text.strip()] if text.strip() else []
    docs = [
        text[m.end() : nxt.start() if nxt is not None else len(text)].strip()
        for m, nxt in zip(starts, [*starts[1:], None], strict=True)
    ]
    return [d for d in docs if d][:k]


class SimulatedSearchEngine:
    """A retriever whose documents a generator writes for (query, question, answer), useful or noisy by the
    curriculum at the step in the query's context (sleuth.retrieval.base.RetrievalContext).

    Hits: doc_id `zerosearch:<useful|noisy>:<question id>:<n>`, title the query, score 1/rank. The useful/noisy
    draws are kept in `draws` (one (question id, step, kind) per query) for tests and analysis."""

    wants_context: ClassVar[bool] = True

    def __init__(
        self,
        generator: Generator,
        *,
        total_steps: int,
        start_threshold: float = 0.0,
        end_threshold: float = 0.5,
        exp_base: float = 4.0,
        mode: str = "prompt",
        temperature: float = 0.8,
        max_new_tokens: int = 600,
        seed: int = 0,
    ):
        if mode not in ("prompt", "sft"):
            raise ConfigError(f"SimulatedSearchEngine mode must be 'prompt' or 'sft', got {mode!r}")
        if total_steps < 1 or not 0 <= start_threshold <= 1 or not 0 <= end_threshold <= 1 or exp_base <= 1:
            raise ConfigError(
                "SimulatedSearchEngine needs total_steps >= 1, thresholds in [0, 1] and exp_base > 1; "
                f"got {total_steps}, {start_threshold}, {end_threshold}, {exp_base}"
            )
        self.generator = generator
        self.total_steps, self.start, self.end, self.base = (
            total_steps,
            start_threshold,
            end_threshold,
            exp_base,
        )
        self.mode = mode
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        self.rng = random.Random(seed)
        self.draws: list[tuple[str, int | None, str]] = []
        self._lock = threading.Lock()
        self._served = 0

    def prompt(self, query: str, context: RetrievalContext, kind: str) -> str:
        answer = context.golden_answers[0] if context.golden_answers else ""  # ZeroSearch names the first
        if self.mode == "sft":
            return SFT_PROMPT.format(
                kind=kind, question=context.question, answer=answer, query=query, label=kind.capitalize()
            )
        return PROMPT[kind].format(question=context.question, answer=answer, query=query)

    def search(
        self, queries: list[str], k: int, contexts: Sequence[RetrievalContext] | None = None
    ) -> list[list[Hit]]:
        if contexts is None or len(contexts) != len(queries):
            raise ConfigError(
                "SimulatedSearchEngine writes documents for a question: it needs one RetrievalContext "
                "per query (the rollout engine gives them; a plain search(queries, k) cannot)"
            )
        kinds = []
        with self._lock:  # the draws stay in query order when several rollouts share the engine
            for ctx in contexts:
                p = noise_probability(ctx.step, self.total_steps, self.start, self.end, self.base)
                kinds.append(USEFUL if self.rng.random() > p else NOISY)  # as ZeroSearch: useful iff draw > p
                self.draws.append((ctx.question_id, ctx.step, kinds[-1]))
        messages = [
            [{"role": "user", "content": self.prompt(q, c, kind)}]
            for q, c, kind in zip(queries, contexts, kinds, strict=True)
        ]
        # the text is cut before `Doc k+1` anyway: stopping there spares a local simulator the rest of its tokens
        gens = self.generator.generate(messages, [f"Doc {k + 1}"], self.params) if messages else []
        out = []
        for q, ctx, kind, gen in zip(queries, contexts, kinds, gens, strict=True):
            docs = parse_documents(gen.text, k)
            out.append(
                [
                    Hit(f"zerosearch:{kind}:{ctx.question_id}:{i}", q, d, 1.0 / i)
                    for i, d in enumerate(docs, start=1)
                ]
            )
        return out


@dataclass
class ZeroSearchLoop(SearchR1Loop):
    """Search-R1's protocol; ZeroSearch shows the simulated documents as `Doc i: text` (5 by default)."""

    name: ClassVar[str] = "zerosearch"
    top_k: int = 5
    max_turns: int = 5

    def format_documents(self, hits: list[Hit]) -> str:
        return "\n".join(f"Doc {i}: {h.text}" for i, h in enumerate(hits, start=1))


@register_reward("zerosearch_f1")
@dataclass
class ZeroSearchReward(Reward):
    """F1 of the final answer against the gold answers (0 without an answer)."""

    components: ClassVar[tuple[str, ...]] = ("f1",)

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        out = []
        for t in trajs:
            f1 = f1_score(t.answer, t.golden_answers) if t.answer is not None else 0.0
            out.append(RewardResult(f1, {"f1": f1}))
        return out


_ENGINE_OPTIONS = {
    "total_steps": int,
    "start_threshold": float,
    "end_threshold": float,
    "exp_base": float,
    "mode": str,
    "temperature": float,
    "max_new_tokens": int,
    "seed": int,
}


def open_simulator(rest: str, context: OpenContext) -> SimulatedSearchEngine:
    """`zerosearch:MODEL?total_steps=N&...`: a `SimulatedSearchEngine` whose documents the generator MODEL writes
    (any `load_generator` spec: a served `openai:<url>` LLM, a local model or GGUF path); the query options are
    its keyword arguments (total_steps, start_threshold, end_threshold, exp_base, mode, temperature,
    max_new_tokens, seed)."""
    model, _, query = rest.partition("?")
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in _ENGINE_OPTIONS:
            raise ConfigError(
                f"{context.where} zerosearch:{rest}: unknown option {key!r}; "
                f"known: {', '.join(_ENGINE_OPTIONS)}"
            )
        try:
            options[key] = _ENGINE_OPTIONS[key](value)
        except ValueError:
            raise ConfigError(
                f"{context.where} zerosearch:{rest}: {key}={value!r} is not a {_ENGINE_OPTIONS[key].__name__}"
            ) from None
    if not model or "total_steps" not in options:
        raise ConfigError(
            f"{context.where} zerosearch:{rest}: write zerosearch:MODEL?total_steps=N (the generator "
            "that writes the documents and the curriculum's length in RL steps)"
        )
    return SimulatedSearchEngine(load_generator(model), **options)


register_backend(RetrieverBackend("zerosearch", open_simulator, "zerosearch:MODEL?total_steps=N"))

# A generated run's simulator: the policy's own frozen base model (the same weights as the policy with its adapters
# off, loaded once more as a generator), writing up to `top_k` documents of ~30 words each
SIMULATOR_NEW_TOKENS = 192


def run_sections(shape: RunShape) -> dict[str, Any]:
    """A generated run's ZeroSearch sections (`Method.recipe_sections`, bench/learning.py): RL against documents the
    frozen base model writes, the paper's curriculum (p from 0 to 0.5, base 4) over the run's RL steps. A 135M
    simulator writes poor documents (the paper's is a 3B-14B model fine-tuned to simulate search), so such a run
    measures the machinery, not the paper's claim. The cold start and the held-out evaluation use the real index."""
    return {
        "retriever": {
            "index": None,
            "location": f"zerosearch:{shape.model}?total_steps={shape.total_steps}"
            f"&max_new_tokens={SIMULATOR_NEW_TOKENS}",
        }
    }


register_method(
    Method(
        loop=ZeroSearchLoop,
        title="a Search-R1 agent trained against a simulated search engine "
        "(ZeroSearch: LLM-written documents, noise curriculum), F1 reward",
        eval_name="zerosearch",
        default_reward={"name": "zerosearch_f1"},
        new_tokens_factor=2,
        oracle_format="search_r1",
        recipe_sections=run_sections,
    )
)


def recipe(train: str, total_steps: int = 203, **overrides: Any) -> dict[str, Any]:
    """The paper's set-up as a sleuth recipe (GRPO, 5 samples, 5 turns, top 5); the simulator is given to the
    run as its retriever (`SimulatedSearchEngine(generator, total_steps=...)`)."""
    base: dict[str, Any] = {
        "name": "zerosearch",
        "plugins": ["sleuth_zerosearch"],
        "data": {"train": train},
        "agent": {"loop": "zerosearch", "max_turns": 5, "top_k": 5},
        "reward": {"name": "zerosearch_f1"},
        "algorithm": {"name": "grpo", "n": 5},
        "trainer": {"total_steps": total_steps},
    }
    return {**base, **overrides}
