"""Load a trained searcher (policy + its loop) from a training run or checkpoint.

A checkpoint written by `sleuth train` carries `searcher.json` (loop name, loop
options, base model spec, whether the policy is a LoRA adapter), so serving and
evaluation need nothing but its path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError

SEARCHER_FILE = "searcher.json"


@dataclass
class Searcher:
    generator: Any  # sleuth.llm.hf.HFGenerator
    loop: Any  # sleuth.agent.base.AgentLoop
    info: dict[str, Any]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir (its newest checkpoint)."""
    path = Path(path)
    if (path / SEARCHER_FILE).exists():
        return path
    from sleuth.rl.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(path) if path.is_dir() else None
    if ckpt is None or not (ckpt / SEARCHER_FILE).exists():
        raise ConfigError(
            f"{path}: not a sleuth checkpoint (no {SEARCHER_FILE}) nor a run directory with checkpoints; "
            "pass runs/<name>/checkpoints/step_N or runs/<name>"
        )
    return ckpt


def load_searcher(path: str | Path, device: str | None = None, merge_lora: bool = True) -> Searcher:
    """Load the policy (merging LoRA adapters into the base for fast inference) and its loop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.agent import get_loop
    from sleuth.llm.hf import HFGenerator
    from sleuth.llm.registry import resolve_model_path

    ckpt = resolve_checkpoint(path)
    info = json.loads((ckpt / SEARCHER_FILE).read_text())
    policy_dir = ckpt / "policy"
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    if info.get("lora"):
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(info["base_model"]))
        model = PeftModel.from_pretrained(base, policy_dir)
        if merge_lora:
            model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(policy_dir)
    import torch

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(dev).eval()
    generator = HFGenerator(model, tokenizer=tokenizer)
    loop = get_loop(info["loop"], **info.get("loop_options", {}))
    return Searcher(generator=generator, loop=loop, info=info)
