"""Every method `sleuth eval` runs, and one batch of one method.

The baselines are a table (`BASELINES`: direct, direct-generator, cot, naive-rag, ircot, search-o1 before
the trained agents, oracle after); the trained-agent methods come from the method registry
(sleuth.agent.registry), plugins included. `run_method_batch` runs one batch: a baseline's function, or
greedy rollouts of a method's loop whose documents (a method `evaluated_by_reader`) or evidence go to the
frozen generator, read with the method's own reader prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.agent.registry import Method, get_method
from sleuth.agent.registry import methods as registered_methods
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.eval.baselines import (
    BaselineSettings,
    CountingGenerator,
    MethodOutput,
    parse_answer,
    read_documents,
    run_cot,
    run_direct,
    run_ircot,
    run_naive_rag,
    run_oracle,
)
from sleuth.eval.config import EvalConfig
from sleuth.eval.search_o1 import SearchO1Loop
from sleuth.llm.base import Generator, SamplingParams
from sleuth.retrieval.base import Retriever
from sleuth.rewards.answerer import (
    DEFAULT_READER,
    answer_from_evidence,
)


@dataclass(frozen=True)
class Baseline:
    """An untrained method of this harness (the trained-agent methods come from sleuth.agent.registry)."""

    name: str
    run: Callable[[Sequence[QAExample], EvalContext], list[MethodOutput]]
    needs_retriever: bool = True
    reads: bool = (
        False  # answered by the frozen generator (--generator), so it compares fairly with searchers
    )
    model_free: bool = False  # only the frozen generator answers: --model plays no part
    # the reader prompt its documents are read with: "config" = EvalConfig.answer_template
    template: str | None = None
    needs_gold: bool = False  # reads each question's gold passages (metadata.supporting_ids)
    aliases: tuple[str, ...] = ()


def _run_direct_generator(examples: Sequence[QAExample], ctx: EvalContext) -> list[MethodOutput]:
    outs = run_direct(ctx.generator, examples, ctx.settings(), "direct-generator")
    for out in outs:
        out.answer_source = "generator"
    return outs


ORACLE_TEMPLATE = DEFAULT_READER


# before and after the trained-agent methods, in the order summaries list them
_BASELINES_FIRST = (
    Baseline("direct", lambda exs, ctx: run_direct(ctx.model, exs, ctx.settings()), needs_retriever=False),
    Baseline(
        "direct-generator",
        _run_direct_generator,
        needs_retriever=False,
        reads=True,
        model_free=True,
        aliases=("direct@generator", "direct_generator"),
    ),
    Baseline(
        "cot",
        lambda exs, ctx: run_cot(ctx.model, exs, ctx.settings()),
        needs_retriever=False,
        aliases=("chain-of-thought",),
    ),
    Baseline(
        "naive-rag",
        lambda exs, ctx: run_naive_rag(ctx.generator, ctx.need_retriever(), exs, ctx.settings()),
        reads=True,
        model_free=True,
        template="config",
        aliases=("naive_rag", "rag", "naiverag"),
    ),
    Baseline(
        "ircot",
        lambda exs, ctx: run_ircot(
            ctx.model, ctx.need_retriever(), exs, ctx.settings(), reader=ctx.generator
        ),
        reads=True,
        template="config",
    ),
    Baseline(
        "search-o1",
        lambda exs, ctx: run_agent(SearchO1Loop(**ctx.loop_options()), None, exs, ctx),
        aliases=("search_o1", "searcho1"),
    ),
)


_BASELINES_LAST = (
    Baseline(
        "oracle",
        lambda exs, ctx: run_oracle(
            ctx.generator, ctx.need_retriever(), exs, ctx.settings(), ORACLE_TEMPLATE
        ),
        reads=True,
        model_free=True,
        template=ORACLE_TEMPLATE,
        needs_gold=True,
    ),
)


BASELINES = {b.name: b for b in _BASELINES_FIRST + _BASELINES_LAST}


def all_methods() -> tuple[str, ...]:
    """Every method `evaluate` runs: baselines, then each registered agent method (plugins included)."""
    agents = tuple(m.display_name for m in registered_methods())
    return tuple(b.name for b in _BASELINES_FIRST) + agents + tuple(b.name for b in _BASELINES_LAST)


METHODS: tuple[str, ...] = all_methods()  # the built-in ones; plugins add theirs to all_methods()


def canonical_method(name: str) -> str:
    key = name.strip().lower()
    for baseline in BASELINES.values():
        if key in (baseline.name, *baseline.aliases) or key.replace("_", "-") == baseline.name:
            return baseline.name
    try:
        return get_method(key).display_name
    except ConfigError:
        raise ConfigError(
            f"unknown method {name!r}; choose from: {', '.join(all_methods())} (a method from a "
            "plugin module: pass --plugin MODULE)"
        ) from None


def parse_methods(methods: str | Iterable[str]) -> list[str]:
    """Canonical method names from "a,b" strings or lists of them, in order, without repeats."""
    items = [methods] if isinstance(methods, str) else list(methods)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            if part.strip():
                name = canonical_method(part)
                if name not in out:
                    out.append(name)
    if not out:
        raise ConfigError(f"no method given; choose from: {', '.join(all_methods())}")
    return out


def trajectory_tokens(traj: Trajectory) -> tuple[int, int]:
    """(input, output) tokens of a rollout: each policy turn reads the prompt plus the response so far."""
    policy = [t for t in traj.turns if t.role == "policy"]
    n_in = sum(len(traj.prompt_ids) + t.start for t in policy)
    return n_in, traj.num_policy_tokens


@dataclass
class EvalContext:
    model: Generator
    generator: Generator
    retriever: Retriever | None
    cfg: EvalConfig

    def settings(self) -> BaselineSettings:
        cfg = self.cfg
        return BaselineSettings(
            top_k=cfg.top_k or 3,
            max_turns=cfg.max_turns or 4,
            max_new_tokens=cfg.max_new_tokens,
            answer_max_new_tokens=cfg.answer_max_new_tokens,
            answer_template=cfg.answer_template,
            seed=cfg.seed,
        )

    def loop_options(self, method: str | None = None) -> dict[str, Any]:
        """The loop's options: a checkpoint's own switches when its method is the one evaluated, then top-k."""
        own = dict(self.cfg.loop_options) if method is not None and method == self.cfg.loop_method else {}
        return own | ({} if self.cfg.top_k is None else {"top_k": self.cfg.top_k})

    def need_retriever(self) -> Retriever:
        if self.retriever is None:
            raise ConfigError("this method needs a retriever: pass --retriever INDEX_DIR or URL")
        return self.retriever


def run_agent(loop: AgentLoop, method: Method | None, examples: Sequence[QAExample],
               ctx: EvalContext) -> list[MethodOutput]:  # fmt: skip
    """Greedy rollouts of `loop`; a searcher `method` then hands its documents (or evidence) to the reader."""
    cfg = ctx.cfg
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed)
    trajs = rollout(
        loop,
        ctx.model,
        ctx.need_retriever(),
        examples,
        params,
        n=1,
        budget=RolloutBudget(cfg.max_obs_tokens, cfg.max_response_tokens, cfg.max_turns),
    )
    outs = []
    for traj in trajs:
        n_in, n_out = trajectory_tokens(traj)
        outs.append(MethodOutput(traj.answer, traj.retrieval_count, n_in, n_out, traj))
    if method is not None and (method.evaluated_by_reader or cfg.hand_over_template is not None):
        preds, texts, counts = read_documents(
            ctx.generator,
            examples,
            [method.hand_over(t) for t in trajs],
            ctx.settings(),
            cfg.hand_over_template or method.reader,
        )
        _hand_over(outs, preds, texts, counts)
    elif method is not None and method.reads_evidence and cfg.r_search_evidence:
        counter = CountingGenerator(ctx.generator)
        params = SamplingParams(max_new_tokens=cfg.answer_max_new_tokens, temperature=0.0, seed=cfg.seed)
        texts = answer_from_evidence(
            counter, [ex.question for ex in examples], [t.evidence or "" for t in trajs], params
        )
        _hand_over(outs, [parse_answer(t) for t in texts], texts, list(counter.last))
    return outs


def _hand_over(outs: list[MethodOutput], preds, texts, counts) -> None:
    for out, pred, text, (n_in, n_out) in zip(outs, preds, texts, counts, strict=True):
        out.extra["agent_answer"] = out.prediction
        out.extra["generator_output"] = text
        out.prediction = pred
        out.answer_source = "generator"
        out.input_tokens += n_in
        out.output_tokens += n_out


def run_method_batch(method: str, examples: Sequence[QAExample], ctx: EvalContext) -> list[MethodOutput]:
    """One batch of one method: every question goes through the generator together."""
    if method_traits(method, ctx.cfg).needs_retriever and ctx.retriever is None:
        raise ConfigError(f"method {method!r} needs a retriever: pass --retriever INDEX_DIR or URL")
    baseline = BASELINES.get(method)
    if baseline is not None:
        return baseline.run(examples, ctx)
    spec = get_method(method)
    return run_agent(spec.build_loop(**ctx.loop_options(spec.name)), spec, examples, ctx)


@dataclass(frozen=True)
class MethodTraits:
    """What a method's stored predictions depend on besides the run's settings."""

    needs_retriever: bool
    uses_generator: bool
    model_free: bool
    template: str | None
    evidence: bool  # the r_search_evidence switch applies


def method_traits(method: str, cfg: EvalConfig) -> MethodTraits:
    baseline = BASELINES.get(method)
    if baseline is not None:
        template = cfg.answer_template if baseline.template == "config" else baseline.template
        return MethodTraits(baseline.needs_retriever, baseline.reads, baseline.model_free, template, False)
    spec = get_method(method)
    uses_generator = spec.evaluated_by_reader or (spec.reads_evidence and cfg.r_search_evidence)
    return MethodTraits(True, uses_generator, False, None, spec.reads_evidence)
