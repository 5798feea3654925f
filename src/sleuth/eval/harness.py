"""The evaluation harness: run methods over QA examples, score them, write predictions and a summary.

Output layout (the report reads exactly this):
- `OUT/<method>/predictions.jsonl`: one record per question, appended batch by batch
  {id, question, golden_answers, dataset, method, prediction, metrics: {em, cover_em, f1,
  span_check, genacc, judge}, retrieval_count, input_tokens, output_tokens, latency_s,
  answer_source, trajectory};
- `OUT/<method>/config.json`: what the predictions depend on (settings, and the model, reader and
  retriever as `describe` names them: a constructed one by its checkpoint, index or URLs); a resumed run
  must match it, and a stored prediction is reused only for the same question and gold answers;
- `OUT/summary.json`: {"methods": {method: {dataset | "overall": {metric: mean, "<accuracy>_ci":
  [lo, hi], "n": count}}}, "config": {...}, "method_configs": {method: {...}}, and, when naive-rag
  has predictions in OUT, "paired": each method minus naive-rag on this call's questions
  (sleuth.eval.compare)}; intervals are 95% percentile bootstraps (sleuth.eval.stats);
- `OUT/summary.md`: the same as markdown tables.

Methods: direct, direct-generator, cot, naive-rag, ircot, oracle (sleuth.eval.baselines),
search-o1 (a prompted loop, sleuth.eval.search_o1), and the trained-agent loops search-r1,
s3, r-search, staged, qagent (sleuth.agent), all decoded greedily. s3 and qagent are
evaluated as searchers: the documents they gathered (`served_context`) go to a frozen
generator that answers; with `r_search_evidence` R-Search's evidence block goes to the
frozen generator too (RSTool). So that one call compares them fairly, the frozen generator
is also the reader of every other method that answers from documents (naive-rag, IRCoT's
reader, oracle) and answers direct-generator; direct, cot, IRCoT's reasoning, search-o1 and
the other loops are the `model`.

Latency is a batch's wall time (method and frozen generator, not the judge) divided
by its size: the cost per question of batched evaluation, not a single-request latency.
Agent token counts re-count the growing context at every policy turn.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.agent.registry import Method, get_method, load_checkpoint_plugins, reader_names
from sleuth.agent.registry import methods as registered_methods
from sleuth.agent.searcher import load_searcher
from sleuth.agent.trajectory import Trajectory
from sleuth.appendlog import read_appended
from sleuth.data.formats import QAExample, load_qa
from sleuth.errors import ConfigError, DataFormatError
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
from sleuth.eval.boundary import boundary_markdown, retrieval_boundary
from sleuth.eval.compare import compare_with_baseline, paired_markdown
from sleuth.eval.search_o1 import SearchO1Loop
from sleuth.eval.stats import DEFAULT_RESAMPLES, bootstrap_ci, bootstrap_cis
from sleuth.llm.base import Generator, SamplingParams
from sleuth.llm.registry import open_generator
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.cache import CachingRetriever, cache_stats
from sleuth.retrieval.docstore import passages_by_id
from sleuth.retrieval.sources import open_retriever
from sleuth.retrieval.tools import is_tool_spec
from sleuth.rewards.answerer import (
    DEFAULT_READER,
    JUDGE_RULES,
    answer_from_evidence,
    gen_acc,
    judge_contains,
)
from sleuth.rewards.metrics import aggregate, cover_exact_match, exact_match, f1_score, span_check
from sleuth.run_layout import SearcherInfo, is_searcher_checkpoint, resolve_checkpoint
from sleuth.utils import atomic_write_json, atomic_write_text, seed_everything


@dataclass(frozen=True)
class Baseline:
    """An untrained method of this harness (the trained-agent methods come from sleuth.agent.registry)."""

    name: str
    run: Callable[[Sequence[QAExample], _Context], list[MethodOutput]]
    needs_retriever: bool = True
    reads: bool = False  # answered by the frozen generator (--generator), so it compares fairly with searchers
    model_free: bool = False  # only the frozen generator answers: --model plays no part
    # the reader prompt its documents are read with: "config" = EvalConfig.answer_template
    template: str | None = None
    needs_gold: bool = False  # reads each question's gold passages (metadata.supporting_ids)
    aliases: tuple[str, ...] = ()


def _run_direct_generator(examples: Sequence[QAExample], ctx: _Context) -> list[MethodOutput]:
    outs = run_direct(ctx.generator, examples, ctx.settings(), "direct-generator")
    for out in outs:
        out.answer_source = "generator"
    return outs


ORACLE_TEMPLATE = DEFAULT_READER
# before and after the trained-agent methods, in the order summaries list them
_BASELINES_FIRST = (
    Baseline("direct", lambda exs, ctx: run_direct(ctx.model, exs, ctx.settings()), needs_retriever=False),
    Baseline("direct-generator", _run_direct_generator, needs_retriever=False, reads=True, model_free=True,
             aliases=("direct@generator", "direct_generator")),
    Baseline("cot", lambda exs, ctx: run_cot(ctx.model, exs, ctx.settings()), needs_retriever=False,
             aliases=("chain-of-thought",)),
    Baseline("naive-rag", lambda exs, ctx: run_naive_rag(ctx.generator, ctx.need_retriever(), exs, ctx.settings()),
             reads=True, model_free=True, template="config", aliases=("naive_rag", "rag", "naiverag")),
    Baseline("ircot", lambda exs, ctx: run_ircot(ctx.model, ctx.need_retriever(), exs, ctx.settings(),
                                                 reader=ctx.generator), reads=True, template="config"),
    Baseline("search-o1", lambda exs, ctx: _run_agent(SearchO1Loop(**ctx.loop_options()), None, exs, ctx),
             aliases=("search_o1", "searcho1")),
)
_BASELINES_LAST = (
    Baseline("oracle", lambda exs, ctx: run_oracle(ctx.generator, ctx.need_retriever(), exs, ctx.settings(),
                                                   ORACLE_TEMPLATE),
             reads=True, model_free=True, template=ORACLE_TEMPLATE, needs_gold=True),
)
BASELINES = {b.name: b for b in _BASELINES_FIRST + _BASELINES_LAST}


def all_methods() -> tuple[str, ...]:
    """Every method `evaluate` runs: baselines, then each registered agent method (plugins included)."""
    agents = tuple(m.display_name for m in registered_methods())
    return tuple(b.name for b in _BASELINES_FIRST) + agents + tuple(b.name for b in _BASELINES_LAST)


METHODS: tuple[str, ...] = all_methods()  # the built-in ones; plugins add theirs to all_methods()
ANSWER_METRICS = ("em", "cover_em", "f1", "span_check", "genacc", "judge")
COST_METRICS = ("retrieval_count", "input_tokens", "output_tokens", "latency_s")
METRIC_KEYS = ANSWER_METRICS + COST_METRICS
DEFAULT_MODEL = "smollm2-135m-instruct"


# -- configuration -----------------------------------------------------------------------------------


@dataclass
class EvalConfig:
    batch_size: int = 16
    seed: int = 0
    top_k: int | None = None  # None: each method's own default (loops: the papers'; baselines: 3)
    max_turns: int | None = None  # None: each method's default (IRCoT 4 steps, Search-o1 5)
    max_new_tokens: int = 512  # per agent turn, and for CoT
    answer_max_new_tokens: int = 64  # direct answers and frozen-generator readers
    max_obs_tokens: int = 512
    max_response_tokens: int = 4096
    answer_template: str = DEFAULT_READER  # frozen-generator prompt for naive-rag and IRCoT's reader
    r_search_evidence: bool = False  # R-Search answered by the frozen generator from its evidence (RSTool)
    keep_token_ids: bool = False  # store token ids / masks / logprobs in trajectories (large)
    fresh: bool = False  # discard existing predictions instead of resuming
    default_dataset: str = "data"  # dataset name for examples without metadata["dataset"]
    judge_rule: str = "strict"  # how a judge reply is read: "strict" or s3's "upstream" ("yes" anywhere)
    retriever_cache: str | None = None  # record every search here, replay it next time (sleuth.retrieval.cache)

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens", "answer_max_new_tokens", "max_obs_tokens", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("top_k", "max_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.answer_template not in reader_names():
            choices = " or ".join(repr(x) for x in reader_names())
            raise ConfigError(f"answer_template must be {choices}, got {self.answer_template!r}")
        if self.judge_rule not in JUDGE_RULES:
            raise ConfigError(f"judge_rule must be one of {list(JUDGE_RULES)}, got {self.judge_rule!r}")
        if self.default_dataset == "overall":
            raise ConfigError("default_dataset 'overall' collides with the overall summary row")


def eval_config(**options: Any) -> EvalConfig:
    """An EvalConfig from keyword options, naming any unknown one."""
    known = {f.name for f in fields(EvalConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown evaluate option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return EvalConfig(**options)


def canonical_method(name: str) -> str:
    key = name.strip().lower()
    for baseline in BASELINES.values():
        if key in (baseline.name, *baseline.aliases) or key.replace("_", "-") == baseline.name:
            return baseline.name
    try:
        return get_method(key).display_name
    except ConfigError:
        raise ConfigError(f"unknown method {name!r}; choose from: {', '.join(all_methods())} (a method from a "
                          "plugin module: pass --plugin MODULE)") from None


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


def describe(component: Any) -> str | None:
    """A stable text for a spec or a constructed component (for configs and resume checks)."""
    if component is None:
        return None
    if isinstance(component, (str, Path)):
        text = str(component)
        path = Path(text).expanduser()
        return str(path.resolve()) if path.exists() else text
    if isinstance(component, Mapping):
        return json.dumps(dict(component), sort_keys=True)
    identity = _identity(component, depth=0)
    return f"{type(component).__name__}({identity})" if identity else type(component).__name__


# What a constructed component's outputs depend on, as attributes: where its index, documents or weights
# live, and the settings that change its results. Two retrievers of one class over different indexes (or
# two generators of one class from different checkpoints) must not share stored predictions.
_IDENTITY_ATTRS = ("source", "urls", "model_name", "model", "index_dir", "directory", "uri", "collection",
                   "mode", "faiss_type", "rerank", "weights", "rrf_k", "specs", "config", "encoder", "docstore",
                   "retrievers")
_SECRET_WORDS = ("key", "token", "secret", "auth", "header", "password")


def _identity(component: Any, depth: int) -> str:
    found = {}
    for attr in _IDENTITY_ATTRS:
        value = getattr(component, attr, None)
        if value is None or (attr == "model" and not isinstance(value, str)):  # a loaded module: see `source`
            continue
        found[attr] = value
    if len(found) == 1 and next(iter(found)) in ("source", "model_name", "model", "urls"):
        return str(next(iter(found.values())))  # a model's name or a server's addresses say it all
    return ", ".join(f"{attr}={_identity_text(value, depth)}" for attr, value in found.items())


def _identity_text(value: Any, depth: int) -> str:
    if isinstance(value, (str, int, float, bool)):
        return repr(value)
    if isinstance(value, Path):
        return str(value.expanduser().resolve())
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_identity_text(v, depth + 1) for v in value) + "]"
    if hasattr(value, "model_dump"):  # pydantic settings: without credentials
        value = value.model_dump(mode="json")
    elif is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, Mapping):
        public = {k: v for k, v in value.items() if not any(w in str(k).lower() for w in _SECRET_WORDS)}
        return json.dumps(public, sort_keys=True, default=str)
    inner = _identity(value, depth + 1) if depth < 3 else ""
    return f"{type(value).__name__}({inner})"


def resolve_generator(spec: Generator | str | Mapping | None) -> Generator | None:
    """A model spec, or a trained policy (a sleuth checkpoint, LoRA merged into its base)."""
    return open_generator(spec, checkpoint=lambda path: load_searcher(path).generator)


def checkpoint_budgets(spec: str | Path) -> dict[str, int]:
    """The token budgets and top-k a checkpoint was trained with (EvalConfig field names), so evaluating it
    uses the rollout it learned; {} for anything that is not a sleuth checkpoint."""
    if not isinstance(spec, (str, Path)) or not is_sleuth_checkpoint(spec):
        return {}
    info = SearcherInfo.read(resolve_checkpoint(spec))
    found = {
        "max_new_tokens": info.max_new_tokens_per_turn,
        "max_obs_tokens": info.max_obs_tokens,
        "max_response_tokens": info.max_response_tokens,
        "top_k": info.loop_options.get("top_k"),
        "max_turns": info.loop_options.get("max_turns"),
    }
    return {k: int(v) for k, v in found.items() if isinstance(v, int)}


def load_model_plugins(spec: Any) -> None:
    """Import the plugin modules a checkpoint `spec` recorded for its method (nothing for other specs)."""
    if isinstance(spec, (str, Path)) and is_sleuth_checkpoint(spec):
        ckpt = resolve_checkpoint(spec)
        info = SearcherInfo.read(ckpt)
        load_checkpoint_plugins(info.plugins, info.loop, str(ckpt))


def is_sleuth_checkpoint(spec: str | Path) -> bool:
    """A `sleuth train` checkpoint directory or run directory (holding one)."""
    return is_searcher_checkpoint(spec)


def resolve_retriever(spec: Retriever | str | Path | None, cache: str | Path | None = None) -> Retriever | None:
    """An index directory -> `load_retriever`; an http(s) URL -> `RemoteRetriever`; objects pass through.
    `cache`: a directory recording every search and replaying it next time (`sleuth.retrieval.cache`)."""
    if spec is None:
        return None
    if hasattr(spec, "search") and not isinstance(spec, (str, Path)):
        if cache is None:
            return spec  # type: ignore[return-value]
        return CachingRetriever(spec, cache, f"object:{type(spec).__qualname__}:{spec!r}")  # type: ignore[arg-type]
    text = str(spec)
    if is_tool_spec(text):  # an MCP server's search tool or an HTTP search API
        return open_retriever(tool=text, cache=cache)
    if text.startswith(("http://", "https://")):
        return open_retriever(url=text, cache=cache)
    return open_retriever(
        index=Path(text).expanduser(),
        missing_index=f"retriever {text!r} is neither an index directory nor an http(s) URL; "
        "build an index with `sleuth index CORPUS --out DIR` or start one with `sleuth serve-retriever`",
        cache=cache,
    )


# -- examples ----------------------------------------------------------------------------------------


def dataset_of(ex: QAExample, default: str) -> str:
    name = ex.metadata.get("dataset") if isinstance(ex.metadata, Mapping) else None
    return str(name) if name not in (None, "") else default


def load_eval_data(paths: Sequence[str | Path], limit: int | None = None) -> list[QAExample]:
    """Examples of each file; a file's examples without a dataset name get its stem. `limit`: the first
    `limit` questions of each data source (dataset) of each file, so a merged file (Search-R1's
    nq + triviaqa + ... test parquet) keeps every data source, not only its first."""
    if not paths:
        raise ConfigError("no data file given; pass --data FILE (.jsonl, .json or .parquet)")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    out: list[QAExample] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"data file {str(path)!r} does not exist; pass a .jsonl/.json/.parquet QA file")
        examples = load_qa(path)
        if not examples:
            raise DataFormatError(str(path), None, "holds no questions")
        taken: dict[str, int] = {}
        for ex in examples:
            meta = dict(ex.metadata or {})
            meta.setdefault("source_file", str(path))  # named in errors about a question
            meta.setdefault("dataset", path.stem)
            if meta["dataset"] in (None, ""):
                meta["dataset"] = path.stem
            source = str(meta["dataset"])
            if limit and taken.get(source, 0) >= limit:
                continue
            taken[source] = taken.get(source, 0) + 1
            out.append(replace(ex, metadata=meta))
    return out


def count_by_dataset(examples: Sequence[QAExample]) -> dict[str, int]:
    """Questions per data source, in first-seen order (what `--limit` kept of each)."""
    counts: dict[str, int] = {}
    for ex in examples:
        name = str((ex.metadata or {}).get("dataset", ""))
        counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class _Item:
    key: tuple[str, str]
    dataset: str
    example: QAExample


def _items(examples: Sequence[QAExample], default_dataset: str) -> list[_Item]:
    items: list[_Item] = []
    seen: set[tuple[str, str]] = set()
    for ex in examples:
        dataset = dataset_of(ex, default_dataset)
        if dataset == "overall":
            raise ConfigError(f"question {ex.id!r}: dataset name 'overall' collides with the overall row; rename it")
        key = (dataset, str(ex.id))
        if key in seen:
            raise ConfigError(f"question id {ex.id!r} appears twice in dataset {dataset!r}; ids must be unique")
        seen.add(key)
        items.append(_Item(key, dataset, ex))
    return items


# -- predictions file --------------------------------------------------------------------------------


def load_predictions(path: str | Path) -> dict[tuple[str, str], dict]:
    """Finished records by (dataset, id). A torn last line (a crash mid-write) is dropped with a warning
    naming the byte offset and cut from the file (`sleuth.appendlog`), so the next append starts on a
    clean line; a bad line elsewhere is an error."""
    path = Path(path)
    records: dict[tuple[str, str], dict] = {}
    for lineno, rec in enumerate(read_appended(path, repair=True).records, start=1):
        try:
            records[(str(rec["dataset"]), str(rec["id"]))] = rec
        except KeyError as err:
            raise DataFormatError(
                str(path), None, f"record {lineno} is not a prediction record (no {err}); delete it or rerun with --fresh"
            ) from err
    return records


def append_records(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Append whole lines and fsync, so a finished batch survives a crash."""
    if not records:
        return
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


# -- scoring -----------------------------------------------------------------------------------------


def score_predictions(
    questions: Sequence[str],
    golden_answers: Sequence[Sequence[str]],
    predictions: Sequence[str | None],
    judge: Generator | None = None,
    judge_rule: str = "strict",
) -> list[dict[str, float | None]]:
    """EM, cover-EM, F1, span_check, judge (None without a judge; 0 for a missing prediction) and
    GenAcc = span_check OR judge (s3). The judge is asked about every prediction in one call; its
    replies are read with `judge_rule` (`sleuth.rewards.answerer.JUDGE_RULES`)."""
    verdicts: list[float | None] = [None] * len(predictions)
    if judge is not None:
        ask = [i for i, p in enumerate(predictions) if p is not None and p.strip()]
        for i in range(len(predictions)):
            verdicts[i] = 0.0
        if ask:
            said = judge_contains(judge, [questions[i] for i in ask], [golden_answers[i] for i in ask],
                                  [predictions[i] or "" for i in ask], rule=judge_rule)
            for i, ok in zip(ask, said, strict=True):
                verdicts[i] = float(ok)
    out = []
    for pred, golds, verdict in zip(predictions, golden_answers, verdicts, strict=True):
        out.append({
            "em": exact_match(pred, golds),
            "cover_em": cover_exact_match(pred, golds),
            "f1": f1_score(pred, golds),
            "span_check": span_check(pred, golds),
            "genacc": gen_acc(pred, golds, None if verdict is None else bool(verdict)),
            "judge": verdict,
        })
    return out


def trajectory_tokens(traj: Trajectory) -> tuple[int, int]:
    """(input, output) tokens of a rollout: each policy turn reads the prompt plus the response so far."""
    policy = [t for t in traj.turns if t.role == "policy"]
    n_in = sum(len(traj.prompt_ids) + t.start for t in policy)
    return n_in, traj.num_policy_tokens


def _stored_trajectory(traj: Trajectory | None, keep_token_ids: bool) -> dict | None:
    if traj is None:
        return None
    d = traj.to_dict()
    if not keep_token_ids:
        for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
            d[name] = []
    return d


# -- running methods -----------------------------------------------------------------------------------


@dataclass
class _Context:
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

    def loop_options(self) -> dict[str, Any]:
        return {} if self.cfg.top_k is None else {"top_k": self.cfg.top_k}

    def need_retriever(self) -> Retriever:
        if self.retriever is None:
            raise ConfigError("this method needs a retriever: pass --retriever INDEX_DIR or URL")
        return self.retriever


def _run_agent(loop: AgentLoop, method: Method | None, examples: Sequence[QAExample],
               ctx: _Context) -> list[MethodOutput]:  # fmt: skip
    """Greedy rollouts of `loop`; a searcher `method` then hands its documents (or evidence) to the reader."""
    cfg = ctx.cfg
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed)
    trajs = rollout(
        loop, ctx.model, ctx.need_retriever(), examples, params, n=1,
        budget=RolloutBudget(cfg.max_obs_tokens, cfg.max_response_tokens, cfg.max_turns),
    )
    outs = []
    for traj in trajs:
        n_in, n_out = trajectory_tokens(traj)
        outs.append(MethodOutput(traj.answer, traj.retrieval_count, n_in, n_out, traj))
    if method is not None and method.evaluated_by_reader:
        preds, texts, counts = read_documents(
            ctx.generator, examples, [t.served_context for t in trajs], ctx.settings(), method.reader
        )
        _hand_over(outs, preds, texts, counts)
    elif method is not None and method.reads_evidence and cfg.r_search_evidence:
        counter = CountingGenerator(ctx.generator)
        params = SamplingParams(max_new_tokens=cfg.answer_max_new_tokens, temperature=0.0, seed=cfg.seed)
        texts = answer_from_evidence(counter, [ex.question for ex in examples],
                                     [t.evidence or "" for t in trajs], params)
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


def run_method_batch(method: str, examples: Sequence[QAExample], ctx: _Context) -> list[MethodOutput]:
    """One batch of one method: every question goes through the generator together."""
    if _traits(method, ctx.cfg).needs_retriever and ctx.retriever is None:
        raise ConfigError(f"method {method!r} needs a retriever: pass --retriever INDEX_DIR or URL")
    baseline = BASELINES.get(method)
    if baseline is not None:
        return baseline.run(examples, ctx)
    spec = get_method(method)
    return _run_agent(spec.build_loop(**ctx.loop_options()), spec, examples, ctx)


@dataclass(frozen=True)
class _MethodTraits:
    """What a method's stored predictions depend on besides the run's settings."""

    needs_retriever: bool
    uses_generator: bool
    model_free: bool
    template: str | None
    evidence: bool  # the r_search_evidence switch applies


def _traits(method: str, cfg: EvalConfig) -> _MethodTraits:
    baseline = BASELINES.get(method)
    if baseline is not None:
        template = cfg.answer_template if baseline.template == "config" else baseline.template
        return _MethodTraits(baseline.needs_retriever, baseline.reads, baseline.model_free, template, False)
    spec = get_method(method)
    uses_generator = spec.evaluated_by_reader or (spec.reads_evidence and cfg.r_search_evidence)
    return _MethodTraits(True, uses_generator, False, None, spec.reads_evidence)


def check_oracle_examples(items: Sequence[_Item]) -> None:
    """The oracle needs every question's gold passages; say which file lacks them before anything runs."""
    for it in items:
        ids = it.example.metadata.get("supporting_ids") if isinstance(it.example.metadata, Mapping) else None
        if not isinstance(ids, list) or not ids:
            source = it.example.metadata.get("source_file") if isinstance(it.example.metadata, Mapping) else None
            where = f"data file {source}" if source else f"dataset {it.dataset!r}"
            raise ConfigError(
                f"method oracle needs each question's gold passages (metadata.supporting_ids, as a synthetic "
                f"world from `sleuth synth` writes them), but question {it.example.id!r} of {where} has none; "
                "drop oracle from --method for this data"
            )


def method_config(method: str, ctx: _Context, retriever_desc: str | None, model_desc: str | None,
                  generator_desc: str | None, judge_desc: str | None) -> dict[str, Any]:
    """Everything a method's stored predictions depend on (compared when resuming)."""
    cfg = ctx.cfg
    traits = _traits(method, cfg)
    return {
        "method": method,
        "model": None if traits.model_free else model_desc,
        "generator": generator_desc if traits.uses_generator else None,
        "judge": judge_desc,
        "retriever": retriever_desc if traits.needs_retriever else None,
        "top_k": cfg.top_k,
        "max_turns": cfg.max_turns,
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "answer_max_new_tokens": cfg.answer_max_new_tokens,
        "max_obs_tokens": cfg.max_obs_tokens,
        "max_response_tokens": cfg.max_response_tokens,
        "answer_template": traits.template,
        "r_search_evidence": cfg.r_search_evidence if traits.evidence else None,
    }


def _check_resume(path: Path, current: dict[str, Any]) -> None:
    if not path.exists():
        atomic_write_json(path, current)
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise DataFormatError(str(path), None, f"unreadable run config ({err}); rerun with --fresh") from err
    changed = [f"{k}: {previous.get(k)!r} -> {v!r}" for k, v in current.items() if previous.get(k) != v]
    if changed:
        raise ConfigError(
            f"{path.parent} holds predictions made with a different configuration ({'; '.join(changed)}); "
            "use another --out directory, or --fresh to discard them"
        )


def _check_stored_questions(path: Path, done: Mapping[Any, dict], items: Sequence[_Item]) -> None:
    """A stored prediction is reused only for the very question it answered: data regenerated or edited
    under the same ids (another synthetic world, a fixed answer key) must not inherit old predictions."""
    for it in items:
        rec = done.get(it.key)
        if rec is None:
            continue
        same = rec.get("question") == it.example.question and list(rec.get("golden_answers") or []) == list(
            it.example.golden_answers
        )
        if not same:
            raise ConfigError(
                f"{path} holds a prediction for question id {it.example.id!r} of dataset {it.dataset!r} whose "
                f"question or gold answers differ from the data given now (stored: {rec.get('question')!r}); "
                "use another --out directory, or --fresh to discard the stored predictions"
            )


def _chunks(seq: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def run_method(
    method: str,
    items: Sequence[_Item],
    ctx: _Context,
    judge: Generator | None,
    out_dir: Path,
    method_cfg: dict[str, Any],
    on_progress: Callable[[int], None] | None = None,
) -> list[dict]:
    """Run (or resume) one method over `items`; returns their records in `items` order."""
    cfg = ctx.cfg
    mdir = out_dir / method
    mdir.mkdir(parents=True, exist_ok=True)
    pred_path = mdir / "predictions.jsonl"
    if cfg.fresh:
        for stale in (pred_path, mdir / "config.json"):
            if stale.exists():
                stale.unlink()
    _check_resume(mdir / "config.json", method_cfg)
    done = load_predictions(pred_path)
    _check_stored_questions(pred_path, done, items)
    todo = [it for it in items if it.key not in done]
    if on_progress:
        on_progress(len(items) - len(todo))
    seed_everything(cfg.seed)
    for batch in _chunks(todo, cfg.batch_size):
        examples = [it.example for it in batch]
        start = time.perf_counter()
        outputs = run_method_batch(method, examples, ctx)
        latency = (time.perf_counter() - start) / len(batch)
        if len(outputs) != len(batch):
            raise RuntimeError(f"method {method} returned {len(outputs)} outputs for {len(batch)} questions")
        metrics = score_predictions(
            [ex.question for ex in examples], [ex.golden_answers for ex in examples],
            [o.prediction for o in outputs], judge, cfg.judge_rule,
        )
        records = []
        for it, out, m in zip(batch, outputs, metrics, strict=True):
            rec = {
                "id": str(it.example.id),
                "question": it.example.question,
                "golden_answers": list(it.example.golden_answers),
                "dataset": it.dataset,
                "method": method,
                "prediction": out.prediction,
                "metrics": m,
                "retrieval_count": out.retrieval_count,
                "input_tokens": out.input_tokens,
                "output_tokens": out.output_tokens,
                "latency_s": latency,
                "answer_source": out.answer_source,
                "trajectory": _stored_trajectory(out.trajectory, cfg.keep_token_ids),
            }
            if out.extra:
                rec["extra"] = out.extra
            if "knowledge" in it.example.metadata:  # a knowledge-boundary world: over/under-retrieval is scored
                rec["knowledge"] = it.example.metadata["knowledge"]
            records.append(rec)
            done[it.key] = rec
        append_records(pred_path, records)
        if on_progress:
            on_progress(len(batch))
    return [done[it.key] for it in items]


# -- summary -------------------------------------------------------------------------------------------


def summarise_records(records: Sequence[Mapping[str, Any]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per dataset and "overall": the mean of every metric (None when never computed), "n", and next to
    each accuracy `<metric>_ci`: its 95% percentile bootstrap interval [lo, hi] (None when not computed)."""
    rows = [
        {"dataset": r["dataset"], **{k: r["metrics"].get(k) for k in ANSWER_METRICS},
         **{k: r.get(k) for k in COST_METRICS}}
        for r in records
    ]
    means = aggregate(rows, METRIC_KEYS, by="dataset")
    out: dict[str, dict[str, Any]] = {}
    for group, stats in means.items():
        members = rows if group == "overall" else [r for r in rows if str(r["dataset"]) == group]
        intervals = _intervals(members, seed)
        with_ci: dict[str, Any] = {}
        for key, value in stats.items():
            with_ci[key] = value
            if key in ANSWER_METRICS:
                with_ci[f"{key}_ci"] = intervals.get(key)
        out[group] = with_ci
    return out


def _intervals(rows: Sequence[Mapping[str, Any]], seed: int) -> dict[str, list[float]]:
    """The bootstrap interval of each accuracy the rows score: the ones every row scores share
    resamples; one scored on some rows only (a judge that skipped some) is resampled on those."""
    complete = {k: [float(r[k]) for r in rows] for k in ANSWER_METRICS if all(r[k] is not None for r in rows)}
    out = {k: list(ci) for k, ci in bootstrap_cis(complete, seed=seed).items()} if rows else {}
    for key in ANSWER_METRICS:
        values = [float(r[key]) for r in rows if r[key] is not None]
        if key not in out and values:
            out[key] = list(bootstrap_ci(values, seed=seed))
    return out


HEADLINE_METRIC = "genacc"  # the console shows this accuracy's interval; summary.md shows every one
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("em", "EM", "pct"), ("cover_em", "CEM", "pct"), ("f1", "F1", "pct"), ("span_check", "Span", "pct"),
    ("genacc", "GenAcc", "pct"), ("judge", "Judge", "pct"), ("retrieval_count", "RC", "{:.2f}"),
    ("input_tokens", "In tok", "{:.0f}"), ("output_tokens", "Out tok", "{:.0f}"), ("latency_s", "s/q", "{:.2f}"),
)


def _fmt(value: Any, how: str) -> str:
    if value is None:
        return "-"
    if how == "pct":
        return f"{100 * float(value):.1f}"
    return how.format(float(value))


def _cell(stats: Mapping[str, Any], key: str, how: str, with_interval: bool) -> str:
    """A value; with `with_interval` and a stored interval, '45.0 [40.1, 49.9]'."""
    text = _fmt(stats.get(key), how)
    interval = stats.get(f"{key}_ci")
    if with_interval and isinstance(interval, (list, tuple)) and len(interval) == 2:
        text += f" [{_fmt(interval[0], how)}, {_fmt(interval[1], how)}]"
    return text


def summary_rows(summary: Mapping[str, Any], intervals: str = "headline") -> tuple[list[str], list[list[str]]]:
    """Header and rows (method x dataset; "overall" only when there are several datasets).

    `intervals`: "headline" puts the 95% interval beside the headline accuracy only (GenAcc; the
    console table stays narrow), "all" beside every accuracy (summary.md), "none" nowhere."""
    if intervals not in ("headline", "all", "none"):
        raise ValueError(f"intervals must be 'headline', 'all' or 'none', got {intervals!r}")
    shown = {
        key: how == "pct" and (intervals == "all" or (intervals == "headline" and key == HEADLINE_METRIC))
        for key, _, how in COLUMNS
    }
    header = ["method", "dataset", "n"] + [
        c[1] + (" %" if c[2] == "pct" else "") + (" [95% CI]" if shown[c[0]] else "") for c in COLUMNS
    ]
    rows = []
    for method, per_dataset in summary["methods"].items():
        names = sorted(d for d in per_dataset if d != "overall")
        if len(names) != 1:
            names.append("overall")
        for name in names:
            stats = per_dataset[name]
            rows.append([method, name, str(stats["n"])]
                        + [_cell(stats, key, how, shown[key]) for key, _, how in COLUMNS])
    return header, rows


def summary_markdown(summary: Mapping[str, Any]) -> str:
    header, rows = summary_rows(summary, intervals="all")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    cfg = summary.get("config", {})
    notes = (
        f"\nAccuracy columns are percentages with a 95% percentile bootstrap interval over questions ({DEFAULT_RESAMPLES} "
        f"resamples). RC = retrievals per question; tokens per question; "
        f"s/q = batch wall time / batch size. Model: {cfg.get('model')}; generator: {cfg.get('generator')}; "
        f"judge: {cfg.get('judge')}. naive-rag, ircot's reader, oracle and direct-generator answer with the "
        f"generator; direct with the model.\n"
    )
    paired = summary.get("paired")
    boundary = summary.get("retrieval_boundary")
    return ("\n".join(lines) + "\n" + notes + ("\n" + paired_markdown(paired) if paired else "")
            + (boundary_markdown(boundary) if boundary else ""))


def write_summary(out_dir: Path, summary: Mapping[str, Any]) -> None:
    atomic_write_json(out_dir / "summary.json", summary)
    atomic_write_text(out_dir / "summary.md", summary_markdown(summary))


def _previous_summary(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# -- the entry point -------------------------------------------------------------------------------------


@dataclass
class EvalOutput:
    """Where an evaluation writes (`dir`) and how it reports: `run_info` is added to the summary's
    config, `progress` shows a progress bar on `console` (None: rich's default)."""

    dir: str | Path = "eval-results"
    run_info: Mapping[str, Any] | None = None
    progress: bool = False
    console: Any = None


@dataclass
class _Models:
    """The loaded model objects of one evaluation and how each spec is described in the summary."""

    model: Generator
    generator: Generator
    judge: Generator | None
    descs: dict[str, Any]


def _load_models(model: Any, generator: Any, judge: Any, retriever: Any, needs_retrieval: bool) -> _Models:
    """Resolve model specs, sharing the model object where generator or judge name the same model."""
    model_obj = resolve_generator(model)
    assert model_obj is not None
    same_as_model = generator is None or generator is model or (isinstance(generator, str) and generator == model)
    generator_obj = model_obj if same_as_model else resolve_generator(generator)
    judge_same = judge is not None and (judge is model or (isinstance(judge, str) and judge == model))
    judge_obj = model_obj if judge_same else resolve_generator(judge)
    assert generator_obj is not None
    descs = {
        "model": describe(model),
        "generator": describe(model if same_as_model else generator),
        "judge": describe(judge),
        "retriever": describe(retriever) if needs_retrieval else None,
    }
    return _Models(model_obj, generator_obj, judge_obj, descs)


def evaluate(
    methods: str | Sequence[str],
    examples: Sequence[QAExample],
    retriever: Retriever | str | Path | None = None,
    model: Generator | str | Mapping | None = DEFAULT_MODEL,
    generator: Generator | str | Mapping | None = None,
    judge: Generator | str | Mapping | None = None,
    out_dir: str | Path | EvalOutput = "eval-results",
    config: EvalConfig | None = None,
) -> dict[str, Any]:
    """Evaluate `methods` on `examples`; writes OUT/<method>/predictions.jsonl and OUT/summary.{json,md}.

    `retriever`, `model`, `generator` (the frozen answerer of s3/qagent; default: `model`) and `judge`
    are specs (index dir or URL; model alias, dir, "openai:<url>#<model>") or constructed objects,
    so callers can share one loaded model. `out_dir` is a directory or an `EvalOutput` (adding run info
    and a progress bar). Re-running with the same directory resumes: questions already in
    predictions.jsonl are skipped. Returns the summary dict written to summary.json.
    """
    cfg = config or EvalConfig()
    output = out_dir if isinstance(out_dir, EvalOutput) else EvalOutput(out_dir)
    load_model_plugins(model)  # a checkpoint's method may come from a plugin it recorded
    method_list = parse_methods(methods)
    items = _items(list(examples), cfg.default_dataset)
    if not items:
        raise ConfigError("no questions to evaluate")
    if any(BASELINES[m].needs_gold for m in method_list if m in BASELINES):
        check_oracle_examples(items)
    if model is None:
        raise ConfigError("evaluate needs a model (a Generator or a model spec)")
    needs_retrieval = [m for m in method_list if _traits(m, cfg).needs_retriever]
    if needs_retrieval and retriever is None:
        raise ConfigError(
            f"method(s) {', '.join(needs_retrieval)} need a retriever: pass --retriever INDEX_DIR or http URL"
        )

    models = _load_models(model, generator, judge, retriever, bool(needs_retrieval))
    retriever_obj = resolve_retriever(retriever, cfg.retriever_cache) if needs_retrieval else None
    if any(BASELINES[m].needs_gold for m in method_list if m in BASELINES):
        passages_by_id(retriever_obj, [])  # a retriever that cannot look ids up fails before any method runs
    ctx = _Context(models.model, models.generator, retriever_obj, cfg)
    out = Path(output.dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = _previous_summary(out)
    method_summaries: dict[str, Any] = dict(previous.get("methods", {}))
    method_configs: dict[str, Any] = dict(previous.get("method_configs", {}))
    run_records = _run_methods(method_list, items, ctx, models, out, output, method_summaries, method_configs)

    known = all_methods()
    ordered = sorted(method_summaries, key=lambda m: (known.index(m) if m in known else len(known), m))
    summary = {
        "methods": {m: method_summaries[m] for m in ordered},
        "config": _run_config(models.descs, cfg, method_list, items, output.run_info),
        "method_configs": {m: method_configs[m] for m in ordered if m in method_configs},
    }
    if cache_stats(retriever_obj):  # this call's replayed / searched queries
        summary["retriever_cache"] = {"dir": cfg.retriever_cache, **cache_stats(retriever_obj)}
    paired = _compare_with_naive_rag(out, ordered, run_records, items, cfg.seed)
    if paired is not None:
        summary["paired"] = paired
    boundary = {m: b for m in ordered if m in run_records
                and (b := retrieval_boundary(run_records[m], cfg.seed)) is not None}
    if boundary:
        summary["retrieval_boundary"] = boundary
    write_summary(out, summary)
    return summary


def _run_methods(method_list: Sequence[str], items: Sequence[_Item], ctx: _Context, models: _Models, out: Path,
                 output: EvalOutput, summaries: dict[str, Any], configs: dict[str, Any]) -> dict[str, list[dict]]:  # fmt: skip
    """Run every method over `items`, filling `summaries` and `configs`; returns each method's records."""
    descs = models.descs
    run_records: dict[str, list[dict]] = {}
    bar = _progress_bar(output.console) if output.progress else None
    try:
        for method in method_list:
            mcfg = method_config(method, ctx, descs["retriever"], descs["model"], descs["generator"], descs["judge"])
            on_progress = None
            if bar is not None:
                task = bar.add_task(method, total=len(items))

                def on_progress(n: int, task=task) -> None:
                    bar.advance(task, n)

            records = run_method(method, items, ctx, models.judge, out, mcfg, on_progress)
            run_records[method] = records
            summaries[method] = summarise_records(records, seed=ctx.cfg.seed)
            configs[method] = mcfg
    finally:
        if bar is not None:
            bar.stop()
    return run_records


def _run_config(descs: Mapping[str, Any], cfg: EvalConfig, method_list: Sequence[str], items: Sequence[_Item],
                run_info: Mapping[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """The summary's "config": what this call evaluated, with what."""
    datasets: dict[str, int] = {}
    for it in items:
        datasets[it.dataset] = datasets.get(it.dataset, 0) + 1
    return {
        **descs,
        **{k: v for k, v in asdict(cfg).items() if k not in ("fresh",)},
        "methods": list(method_list),
        "datasets": datasets,
        "num_questions": len(items),
        **dict(run_info or {}),
    }


def _compare_with_naive_rag(out_dir: Path, methods: Sequence[str], run_records: Mapping[str, list[dict]],
                            items: Sequence[_Item], seed: int) -> dict[str, Any] | None:  # fmt: skip
    """Each method minus naive-rag on this call's questions, when naive-rag ran now or earlier in `out_dir`."""
    baseline = "naive-rag"
    if baseline not in run_records and not (out_dir / baseline / "predictions.jsonl").exists():
        return None
    predictions = {
        m: run_records[m] if m in run_records else list(load_predictions(out_dir / m / "predictions.jsonl").values())
        for m in methods
    }
    return compare_with_baseline(predictions, [it.key for it in items], seed=seed, baseline=baseline)


def _progress_bar(console: Any):
    bar = Progress(
        TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=console,
    )
    bar.start()
    return bar
