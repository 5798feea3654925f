"""Loading what an evaluation runs with: model, frozen generator, judge and retriever specs, a checkpoint's
budgets and plugins, and the stable description of each (`describe`) that resume checks compare."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from sleuth.agent.registry import load_checkpoint_plugins
from sleuth.agent.searcher import load_searcher
from sleuth.llm.base import Generator
from sleuth.llm.registry import open_generator
from sleuth.retrieval.base import Retriever
from sleuth.retrieval.cache import CachingRetriever
from sleuth.retrieval.sources import open_retriever
from sleuth.run_layout import SearcherInfo, is_searcher_checkpoint, resolve_checkpoint


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
_IDENTITY_ATTRS = (
    "source",
    "urls",
    "model_name",
    "model",
    "index_dir",
    "directory",
    "uri",
    "collection",
    "mode",
    "faiss_type",
    "rerank",
    "weights",
    "rrf_k",
    "specs",
    "config",
    "encoder",
    "docstore",
    "retrievers",
)


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


def local_checkpoint(spec: Any) -> str | Path | None:
    """The sleuth checkpoint or export behind a model spec: the spec itself, or the model name of an
    `openai:URL#DIR` spec when DIR is one (a server started on the export, `transformers serve DIR`)."""
    if isinstance(spec, str) and spec.startswith("openai:"):
        spec = spec.rpartition("#")[2]
    return spec if isinstance(spec, (str, Path)) and spec and is_sleuth_checkpoint(spec) else None


def checkpoint_budgets(spec: str | Path) -> dict[str, Any]:
    """The token budgets, top-k and loop switches a checkpoint was trained with (EvalConfig field names), so
    evaluating it (loaded here or served from its export) uses the rollout it learned; {} for anything else."""
    ckpt = local_checkpoint(spec)
    if ckpt is None:
        return {}
    info = SearcherInfo.read(resolve_checkpoint(ckpt))
    found = {
        "max_new_tokens": info.max_new_tokens_per_turn,
        "max_obs_tokens": info.max_obs_tokens,
        "max_response_tokens": info.max_response_tokens,
        "top_k": info.loop_options.get("top_k"),
        "max_turns": info.loop_options.get("max_turns"),
    }
    budgets: dict[str, Any] = {k: int(v) for k, v in found.items() if isinstance(v, int)}
    switches = {k: v for k, v in info.loop_options.items() if k not in ("top_k", "max_turns")}
    if switches:  # the loop it learned, not the method's default one
        budgets |= {"loop_method": info.loop, "loop_options": switches}
    return budgets


def load_model_plugins(spec: Any) -> None:
    """Import the plugin modules a checkpoint `spec` (or the export an openai: spec serves) recorded for its
    method (nothing for other specs)."""
    found = local_checkpoint(spec)
    if found is not None:
        ckpt = resolve_checkpoint(found)
        info = SearcherInfo.read(ckpt)
        load_checkpoint_plugins(info.plugins, info.loop, str(ckpt))


def is_sleuth_checkpoint(spec: str | Path) -> bool:
    """A `sleuth train` checkpoint directory or run directory (holding one)."""
    return is_searcher_checkpoint(spec)


def resolve_retriever(
    spec: Retriever | str | Path | None, cache: str | Path | None = None
) -> Retriever | None:
    """A retriever location (an index directory, an http(s) URL, `mcp:URL`, a tool YAML, `NAME:...` of any
    registered backend: `sleuth.retrieval.backends`) -> its retriever; objects pass through.
    `cache`: a directory recording every search and replaying it next time (`sleuth.retrieval.cache`)."""
    if spec is None:
        return None
    if hasattr(spec, "search") and not isinstance(spec, (str, Path)):
        if cache is None:
            return spec  # type: ignore[return-value]
        return CachingRetriever(spec, cache, f"object:{type(spec).__qualname__}:{spec!r}")  # type: ignore[arg-type]
    return open_retriever(location=str(spec), cache=cache)


@dataclass
class LoadedModels:
    """The loaded model objects of one evaluation and how each spec is described in the summary."""

    model: Generator
    generator: Generator
    judge: Generator | None
    descs: dict[str, Any]


def load_models(
    model: Any, generator: Any, judge: Any, retriever: Any, needs_retrieval: bool
) -> LoadedModels:
    """Resolve model specs, sharing the model object where generator or judge name the same model."""
    model_obj = resolve_generator(model)
    assert model_obj is not None
    same_as_model = (
        generator is None or generator is model or (isinstance(generator, str) and generator == model)
    )
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
    return LoadedModels(model_obj, generator_obj, judge_obj, descs)
