"""The evaluation harness: `evaluate` runs methods over QA examples, scores them, writes predictions and a
summary. Each step is a module of its own: `config` (EvalConfig), `questions` (data files, datasets),
`loading` (models, retriever, checkpoints), `methods` (the baseline table, registered agents, one batch),
`predictions` (one method's predictions file, resume checks), `summary` (means, intervals, tables),
`compare` (paired differences). The names callers use are importable from here too.

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

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.eval.boundary import retrieval_boundary
from sleuth.eval.compare import compare_with_baseline
from sleuth.eval.config import ANSWER_METRICS as ANSWER_METRICS
from sleuth.eval.config import DEFAULT_MODEL, EvalConfig
from sleuth.eval.config import eval_config as eval_config
from sleuth.eval.loading import LoadedModels, load_model_plugins, load_models, resolve_retriever
from sleuth.eval.loading import checkpoint_budgets as checkpoint_budgets
from sleuth.eval.loading import describe as describe
from sleuth.eval.loading import resolve_generator as resolve_generator
from sleuth.eval.methods import BASELINES, EvalContext, all_methods, method_traits, parse_methods
from sleuth.eval.methods import METHODS as METHODS
from sleuth.eval.predictions import method_config, run_method
from sleuth.eval.predictions import score_predictions as score_predictions
from sleuth.eval.questions import EvalItem, check_oracle_examples, eval_items
from sleuth.eval.questions import count_by_dataset as count_by_dataset
from sleuth.eval.questions import load_eval_data as load_eval_data
from sleuth.eval.records import load_predictions as load_predictions
from sleuth.eval.summary import previous_summary, summarise_records, write_summary
from sleuth.eval.summary import summary_markdown as summary_markdown
from sleuth.eval.summary import summary_rows as summary_rows
from sleuth.llm.base import Generator
from sleuth.progress import progress_bar
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.cache import cache_stats
from sleuth.retrieval.docstore import passages_by_id


@dataclass
class EvalOutput:
    """Where an evaluation writes (`dir`) and how it reports: `run_info` is added to the summary's
    config, `progress` shows a progress bar on `console` (None: rich's default)."""

    dir: str | Path = "eval-results"
    run_info: Mapping[str, Any] | None = None
    progress: bool = False
    console: Any = None


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
    items = eval_items(list(examples), cfg.default_dataset)
    if not items:
        raise ConfigError("no questions to evaluate")
    if any(BASELINES[m].needs_gold for m in method_list if m in BASELINES):
        check_oracle_examples(items)
    if model is None:
        raise ConfigError("evaluate needs a model (a Generator or a model spec)")
    needs_retrieval = [m for m in method_list if method_traits(m, cfg).needs_retriever]
    if needs_retrieval and retriever is None:
        raise ConfigError(
            f"method(s) {', '.join(needs_retrieval)} need a retriever: pass --retriever INDEX_DIR or http URL"
        )

    models = load_models(model, generator, judge, retriever, bool(needs_retrieval))
    agents = [m for m in method_list if m not in BASELINES]
    if (
        agents and getattr(models.model, "tokenizer", True) is None
    ):  # before any method runs, not after the first
        raise ConfigError(
            f"method(s) {', '.join(agents)} build the agent's prompts with the model's tokenizer, and "
            f"{models.descs['model']} brings none: pass --tokenizer DIR (the served model's directory), or serve "
            "the model under its local directory's name (openai:URL#DIR)"
        )
    retriever_obj = resolve_retriever(retriever, cfg.retriever_cache) if needs_retrieval else None
    if any(BASELINES[m].needs_gold for m in method_list if m in BASELINES):
        passages_by_id(retriever_obj, [])  # a retriever that cannot look ids up fails before any method runs
    ctx = EvalContext(models.model, models.generator, retriever_obj, cfg)
    out = Path(output.dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = previous_summary(out)
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
    boundary = {
        m: b
        for m in ordered
        if m in run_records and (b := retrieval_boundary(run_records[m], cfg.seed)) is not None
    }
    if boundary:
        summary["retrieval_boundary"] = boundary
    write_summary(out, summary)
    return summary


def _run_methods(method_list: Sequence[str], items: Sequence[EvalItem], ctx: EvalContext, models: LoadedModels, out: Path,
                 output: EvalOutput, summaries: dict[str, Any], configs: dict[str, Any]) -> dict[str, list[dict]]:  # fmt: skip
    """Run every method over `items`, filling `summaries` and `configs`; returns each method's records."""
    descs = models.descs
    run_records: dict[str, list[dict]] = {}
    bar = _progress_bar(output.console) if output.progress else None
    try:
        for method in method_list:
            mcfg = method_config(
                method, ctx, descs["retriever"], descs["model"], descs["generator"], descs["judge"]
            )
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


def _run_config(descs: Mapping[str, Any], cfg: EvalConfig, method_list: Sequence[str], items: Sequence[EvalItem],
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
                            items: Sequence[EvalItem], seed: int) -> dict[str, Any] | None:  # fmt: skip
    """Each method minus naive-rag on this call's questions, when naive-rag ran now or earlier in `out_dir`."""
    baseline = "naive-rag"
    if baseline not in run_records and not (out_dir / baseline / "predictions.jsonl").exists():
        return None
    predictions = {
        m: run_records[m]
        if m in run_records
        else list(load_predictions(out_dir / m / "predictions.jsonl").values())
        for m in methods
    }
    return compare_with_baseline(predictions, [it.key for it in items], seed=seed, baseline=baseline)


def _progress_bar(console: Any):
    bar = progress_bar(console)  # a plain line with the ETA every 30 s when not a terminal (nohup, SLURM)
    bar.start()
    return bar
