"""Build a `SearcherService` from a `ServiceSpec` (the serve commands' options: a checkpoint or a model + loop)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sleuth.agent import get_loop
from sleuth.agent.base import AgentLoop
from sleuth.agent.registry import loop_names
from sleuth.agent.searcher import load_searcher
from sleuth.errors import ConfigError
from sleuth.llm.registry import load_generator, open_generator
from sleuth.retrieval.sources import open_retriever
from sleuth.serve.service import SearcherService, SearcherSettings, ServeLimits

# The trainer's defaults (sleuth.rl.config), used when serving an untrained model.
DEFAULT_MAX_NEW_TOKENS_PER_TURN = 256
DEFAULT_MAX_OBS_TOKENS = 512
DEFAULT_MAX_RESPONSE_TOKENS = 2048


def parse_loop_options(items: list[str] | None) -> dict[str, Any]:
    """`["top_k=5", "use_selection=false"]` -> {"top_k": 5, "use_selection": False} (values parsed as YAML)."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--loop-option {item!r}: use KEY=VALUE, e.g. --loop-option top_k=5")
        options[key.strip()] = yaml.safe_load(raw)
    return options


def load_retriever_from(
    index: str | Path | None, retriever_url: str | None, location: str | None = None
) -> tuple[Any, str]:
    """The retriever of exactly one of --index, --retriever-url or --retriever (any location), and its name."""
    if sum(x is not None for x in (index, retriever_url, location)) != 1:
        raise ConfigError(
            "pass exactly one of --index DIR (a local index), --retriever-url URL (a /retrieve server) "
            "or --retriever LOCATION (any retriever backend, e.g. hybrid:DIR1,DIR2)"
        )
    if index is not None:
        missing = f"--index {index} does not exist or is not a directory; build one with `sleuth index`"
        return open_retriever(index=index, missing_index=missing), f"index:{index}"
    if retriever_url is not None:
        return open_retriever(url=retriever_url), f"url:{retriever_url}"
    assert location is not None
    return open_retriever(location=location), location


@dataclass(frozen=True)
class ServiceSpec:
    """What a searcher service loads (the options `serve-searcher` and `serve-mcp` share, and
    `sleuth.api.searcher`'s arguments): the searcher (`checkpoint`, or `model` + `loop`), its retriever
    (`index` or `retriever_url`), the frozen `generator` for /answer, and how it runs. A token budget left
    None is the checkpoint's (the trainer's default for an untrained model)."""

    checkpoint: str | Path | None = None
    model: str | None = None
    loop: str | None = None
    loop_options: dict[str, Any] | None = None
    index: str | Path | None = None
    retriever_url: str | None = None
    retriever: str | None = None  # any retriever location (sleuth.retrieval.backends)
    generator: str | None = None
    limits: ServeLimits | None = None
    device: str | None = None
    max_new_tokens_per_turn: int | None = None
    max_obs_tokens: int | None = None
    max_response_tokens: int | None = None


def _searcher(spec: ServiceSpec) -> tuple[Any, AgentLoop, Any, str]:
    """(policy, loop, the checkpoint's SearcherInfo or None, the model's name) of a checkpoint or a model + loop."""
    if spec.checkpoint is not None:
        if spec.loop is not None:
            raise ConfigError("--loop goes with --model; a checkpoint carries its own loop (searcher.json)")
        searcher = load_searcher(spec.checkpoint, device=spec.device)
        info = searcher.info
        agent_loop = searcher.loop
        if spec.loop_options:
            agent_loop = get_loop(info.loop, **{**info.loop_options, **spec.loop_options})
        return (
            searcher.generator,
            agent_loop,
            info,
            f"checkpoint:{spec.checkpoint} (base {info.base_model}, step {info.step})",
        )
    model = spec.model
    assert model is not None
    if spec.loop is None:
        raise ConfigError(f"--model needs --loop NAME (one of: {', '.join(loop_names())})")
    if model.startswith(("openai:", "vllm:")):
        raise ConfigError(
            f"--model {model!r}: the searcher runs token-in/token-out and needs a local model "
            "(an alias such as smollm2-135m-instruct, a checkpoint directory or a .gguf file)"
        )
    agent_loop = get_loop(spec.loop, **(spec.loop_options or {}))
    policy = load_generator(model, device=spec.device) if spec.device else load_generator(model)
    return policy, agent_loop, None, model


def build_service(spec: ServiceSpec, retriever: Any = None, warm_up: bool = True) -> SearcherService:
    """Load the searcher of `spec` (a `sleuth train` checkpoint or export, or a model + loop), its retriever
    (`spec.index`, `spec.retriever_url`, `spec.retriever`, or `retriever`: any object with `search(queries, k)`) and generator."""
    if (spec.checkpoint is None) == (spec.model is None):
        raise ConfigError(
            "pass exactly one of --checkpoint DIR (a trained searcher) or --model SPEC with --loop NAME"
        )

    # The retriever first: a wrong --index fails in a second, before any model is loaded.
    if retriever is None:
        retriever, retriever_name = load_retriever_from(spec.index, spec.retriever_url, spec.retriever)
    elif spec.index is not None or spec.retriever_url is not None or spec.retriever is not None:
        raise ConfigError("pass a retriever object or index/retriever_url, not both")
    else:
        retriever_name = repr(retriever)
    policy, agent_loop, info, model_name = _searcher(spec)
    answer_gen = open_generator(spec.generator)
    if warm_up:
        # The first BM25 search compiles kernels (seconds); pay it before the first client does.
        try:
            retriever.search(["warm up"], 1)
        except Exception as err:
            raise ConfigError(
                f"retriever {retriever_name} loaded but a test search failed: {type(err).__name__}: {err}"
            ) from err

    def pick(given: int | None, key: str, default: int) -> int:
        trained = getattr(info, key, None) if info is not None else None
        return given if given is not None else int(trained if trained is not None else default)

    settings = SearcherSettings(
        limits=spec.limits or ServeLimits(),
        max_new_tokens_per_turn=pick(
            spec.max_new_tokens_per_turn, "max_new_tokens_per_turn", DEFAULT_MAX_NEW_TOKENS_PER_TURN
        ),
        max_obs_tokens=pick(spec.max_obs_tokens, "max_obs_tokens", DEFAULT_MAX_OBS_TOKENS),
        max_response_tokens=pick(
            spec.max_response_tokens, "max_response_tokens", DEFAULT_MAX_RESPONSE_TOKENS
        ),
        model_name=model_name,
        retriever_name=retriever_name,
        generator_name=spec.generator,
    )
    return SearcherService(policy, agent_loop, retriever, answer_gen, settings)
