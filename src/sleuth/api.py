"""The Python API: what the `sleuth` commands do, as functions for notebooks and scripts.

    import sleuth.api as sl

    recipe = sl.load_recipe("recipes/cpu/search_r1.yaml", {"trainer.total_steps": 2})
    run = sl.train(recipe)
    summary = sl.evaluate(["naive-rag", "search-r1"], "runs/world/test.jsonl", retriever="runs/world/bm25",
                          model=run["checkpoint"])
    print(sl.compare(summary))
    with sl.open_searcher(run["checkpoint"], retriever="runs/world/bm25") as searcher:
        print(searcher.search("Where was the director of Blue Harbor born?")["context"])

Every function takes what its command takes (paths, model specs, retriever specs) or objects
already built (a loaded `Generator`, any `search(queries, k)` retriever), and returns plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sleuth.agent.searcher import export_searcher
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.eval.harness import EvalOutput, eval_config, load_eval_data, resolve_retriever
from sleuth.eval.harness import evaluate as run_eval
from sleuth.rl.config import Recipe, apply_overrides, recipe_from_dict
from sleuth.rl.config import load_recipe as _load_recipe_file
from sleuth.rl.trainer import train as run_training
from sleuth.serve.loading import ServiceSpec, build_service
from sleuth.serve.service import ServiceFailure

Overrides = Mapping[str, Any] | Sequence[str] | None

__all__ = [
    "Recipe",
    "Searcher",
    "compare",
    "evaluate",
    "export",
    "load_recipe",
    "open_searcher",
    "override",
    "train",
]


def _override_items(overrides: Overrides) -> list[str]:
    """{"algorithm.n": 4} or ["algorithm.n=4"] -> the CLI's "key.path=value" strings."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        import yaml

        # values go through YAML like the CLI's, so {"agent.options": {"top_k": 5}} keeps its structure
        return [
            f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, value in overrides.items()
        ]
    if isinstance(overrides, str):
        raise ConfigError(f"overrides {overrides!r}: pass a dict or a list of 'key.path=value' strings")
    return list(overrides)


def load_recipe(path: str | Path, overrides: Overrides = None) -> Recipe:
    """A recipe YAML, validated, with `overrides` ({"trainer.total_steps": 2} or ["trainer.total_steps=2"])."""
    return _load_recipe_file(path, _override_items(overrides))


def override(recipe: Recipe, overrides: Overrides) -> Recipe:
    """A copy of `recipe` with fields replaced, validated like a loaded recipe."""
    data = apply_overrides(recipe.model_dump(), _override_items(overrides))
    return recipe_from_dict(data, source=f"recipe {recipe.name!r} with overrides")


def train(recipe: Recipe | str | Path, *, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Train as `sleuth train` does; returns {"out_dir", "checkpoint"} (the newest checkpoint, or None)."""
    from rich.console import Console

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    return run_training(recipe, resume=resume, console=Console(quiet=quiet))


def _examples(data: Any, limit: int | None) -> list[QAExample]:
    if isinstance(data, (str, Path)):
        data = [data]
    items = list(data)
    if items and all(isinstance(x, QAExample) for x in items):
        return items[:limit] if limit else items

    return load_eval_data([Path(x) for x in items], limit)


def evaluate(
    methods: str | Sequence[str],
    data: str | Path | Sequence[str | Path] | Sequence[QAExample],
    *,
    retriever: Any = None,
    model: Any = "smollm2-135m-instruct",
    generator: Any = None,
    judge: Any = None,
    out_dir: str | Path = "eval-results",
    **options: Any,
) -> dict[str, Any]:
    """Evaluate `methods` as `sleuth eval` does; returns the summary (also written to out_dir/summary.json).

    `data` is QA file path(s) or `QAExample`s; `options` are `limit` (the first N questions of each data
    source, as `--limit`) and `EvalConfig` fields (top_k, max_turns, ...).
    """
    limit = options.pop("limit", None)

    return run_eval(
        methods,
        _examples(data, limit),
        retriever=retriever,
        model=model,
        generator=generator,
        judge=judge,
        out_dir=EvalOutput(out_dir, run_info={"limit": limit}),
        config=eval_config(**options),
    )


def compare(
    summary: Mapping[str, Any],
    metrics: Sequence[str] = ("em", "f1", "retrieval_count", "output_tokens"),
    dataset: str = "overall",
) -> list[dict[str, Any]]:
    """One row per method of an `evaluate` summary, best `metrics[0]` first: {"method", "n", metric: value}."""
    rows = []
    for method, per_dataset in summary["methods"].items():
        if dataset not in per_dataset:
            raise ConfigError(
                f"compare: method {method!r} has no dataset {dataset!r}; it has {sorted(per_dataset)}"
            )
        stats = per_dataset[dataset]
        unknown = [m for m in metrics if m not in stats]
        if unknown:
            raise ConfigError(
                f"compare: unknown metric(s) {', '.join(unknown)}; known: {', '.join(sorted(stats))}"
            )
        rows.append({"method": method, "n": stats["n"], **{m: stats[m] for m in metrics}})
    first = metrics[0] if metrics else None
    if first is not None:
        rows.sort(key=lambda r: -float("-inf" if r[first] is None else r[first]))
    return rows


class Searcher:
    """A searcher ready to call: `search(question)` runs its loop against its retriever and returns the
    served context (the same body as `POST /search`); `answer(question)` adds a generator's answer."""

    def __init__(self, service: Any):
        self.service = service

    def _run(
        self, questions: Sequence[str], want_answer: bool, max_turns: int | None, top_k: int | None
    ) -> list[dict[str, Any]]:
        queries = [self.service.validate(q, max_turns, top_k, want_answer=want_answer) for q in questions]
        outcomes = self.service.run_batch(queries)
        failed = [o for o in outcomes if isinstance(o, ServiceFailure)]
        if failed:
            raise failed[0]
        return [o.body for o in outcomes]

    def search(
        self, question: str, *, max_turns: int | None = None, top_k: int | None = None
    ) -> dict[str, Any]:
        """{"context": [{"id", "title", "text"}...], "context_text", "trajectory": {"queries", ...}, ...}."""
        return self._run([question], False, max_turns, top_k)[0]

    def search_many(self, questions: Sequence[str], **limits: int | None) -> list[dict[str, Any]]:
        """Several questions in one batched rollout."""
        return self._run(list(questions), False, limits.get("max_turns"), limits.get("top_k"))

    def answer(
        self, question: str, *, max_turns: int | None = None, top_k: int | None = None
    ) -> dict[str, Any]:
        """`search` plus "answer": the generator's answer from the served context (needs `generator=`)."""
        if self.service.answer_generator is None:
            raise ConfigError("answer() needs open_searcher(..., generator=MODEL_SPEC)")
        return self._run([question], True, max_turns, top_k)[0]

    @property
    def loop(self) -> Any:
        return self.service.loop

    def close(self) -> None:
        self.service.close()

    def __enter__(self) -> Searcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_searcher(
    checkpoint: str | Path | None = None,
    *,
    retriever: Any,
    model: str | None = None,
    loop: str | None = None,
    generator: str | None = None,
    device: str | None = None,
    **loop_options: Any,
) -> Searcher:
    """A trained searcher (a checkpoint, run directory or `sleuth export` directory) or an untrained
    `model` with a `loop`, over `retriever` (any retriever location: sleuth.retrieval.backends; or an object)."""
    spec = ServiceSpec(
        checkpoint=checkpoint,
        model=model,
        loop=loop,
        loop_options=loop_options or None,
        generator=generator,
        device=device,
    )
    service = build_service(spec, retriever=resolve_retriever(retriever), warm_up=False)
    return Searcher(service)


def export(checkpoint: str | Path, out: str | Path, *, dtype: str = "keep", overwrite: bool = False) -> Path:
    """`sleuth export`: a Hugging Face model directory (LoRA merged) that keeps the searcher's loop."""
    return export_searcher(checkpoint, out, dtype=dtype, overwrite=overwrite)
