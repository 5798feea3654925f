"""Model backends behind one `Generator` protocol (see `sleuth.llm.base`).

`load_generator(spec)` builds one from an alias, a path, a hub name or a served-model spec. Backends are
imported lazily so that `import sleuth.llm` pulls in neither torch nor vllm.
"""

from __future__ import annotations

import importlib
from typing import Any

from sleuth.llm.base import Generation, Generator, Prompt, SamplingParams

_LAZY = {
    "HFGenerator": "sleuth.llm.hf",
    "OpenAIGenerator": "sleuth.llm.openai_http",
    "VLLMGenerator": "sleuth.llm.vllm_backend",
    "load_generator": "sleuth.llm.registry",
    "resolve_model_path": "sleuth.llm.registry",
    "EMBEDDED_MODEL": "sleuth.llm.registry",
}

__all__ = ["Generation", "Generator", "Prompt", "SamplingParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sleuth.llm' has no attribute {name!r}")
