"""Load a trained searcher (policy + its loop) from a training run, checkpoint or export.

A checkpoint written by `sleuth train` carries `searcher.json` (loop name, loop
options, base model spec, whether the policy is a LoRA adapter), so serving and
evaluation need nothing but its path. `export_searcher` folds a checkpoint into a
plain Hugging Face model directory (what vLLM, SGLang or TGI load) that keeps its
`searcher.json`, so the export is also served and evaluated like the checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sleuth.agent import get_loop
from sleuth.agent.base import RolloutState, StepOutcome
from sleuth.agent.registry import load_checkpoint_plugins
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.registry import resolve_model_path
from sleuth.llm.special_tokens import (
    align_chat_special_tokens,
    align_model_special_ids,
    disable_bpe_cleanup,
    peft_deprecation_silenced,
    write_compatible_files,
)
from sleuth.run_layout import SEARCHER_FILE, SearcherInfo, resolve_checkpoint
from sleuth.utils import give_normal_permissions

__all__ = [
    "SEARCHER_FILE",
    "EXPORT_DTYPES",
    "Searcher",
    "export_searcher",
    "load_searcher",
    "resolve_checkpoint",
]
EXPORT_DTYPES = ("keep", "float32", "bfloat16", "float16")


@dataclass
class Searcher:
    generator: Any  # sleuth.llm.hf.HFGenerator
    loop: Any  # sleuth.agent.base.AgentLoop
    info: SearcherInfo


def load_searcher(path: str | Path, device: str | None = None, merge_lora: bool = True) -> Searcher:
    """Load the policy (merging LoRA adapters into the base for fast inference) and its loop."""
    # deferred: transformers takes seconds to import; needed only once a model loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # deferred: HFGenerator imports torch, which this module's other paths do without
    from sleuth.llm.hf import HFGenerator, auto_cpu_dtype

    ckpt = resolve_checkpoint(path)
    info = SearcherInfo.read(ckpt)
    load_checkpoint_plugins(info.plugins, info.loop, str(ckpt))  # before the weights: fail fast
    # a training checkpoint keeps the policy in policy/; an export is itself the model directory
    policy_dir = ckpt / info.policy_dir
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    if info.lora:
        from peft import PeftModel  # deferred: heavy, and only LoRA models need it

        base_path = resolve_model_path(info.base_model)
        base = AutoModelForCausalLM.from_pretrained(base_path)
        with peft_deprecation_silenced():
            model = PeftModel.from_pretrained(base, policy_dir)
        model.peft_config["default"].base_model_name_or_path = str(
            base_path
        )  # not the training machine's path
        if merge_lora:
            model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(policy_dir)
    import torch  # deferred: torch is heavy and this module's other paths run without it

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(dev).eval()
    if dev.type == "cpu" and (dtype := auto_cpu_dtype()) is not None:  # inside `sleuth.llm.hf.cpu_dtype`
        model = model.to(dtype)
    generator = HFGenerator(model, tokenizer=tokenizer, source=checkpoint_identity(ckpt, policy_dir))
    loop = get_loop(info.loop, **info.loop_options)
    return Searcher(generator=generator, loop=loop, info=info)


def loop_protocol(loop: Any) -> dict[str, Any]:
    """What a client driving the exported model through an OpenAI-compatible server needs besides the prompt
    templates: the stop strings to send with each request (`transformers serve` and vLLM stop only at eos
    otherwise, running past `</answer>`), and the text a search's documents are inserted between. A part
    that depends on the rollout (a loop whose stops change with the turn) is left out."""
    probe = QAExample("probe", "probe", ["probe"])
    state = RolloutState(
        example=probe,
        traj=Trajectory("probe", "probe", ["probe"], loop.name),
        group=0,
        sample=0,
        prompt_ids=[],
    )
    protocol: dict[str, Any] = {}
    try:
        protocol["stop_strings"] = list(loop.stop_strings(state))
        observation = loop.observe(state, StepOutcome(queries=["probe"]), [[]])
        protocol["observation"] = {"prefix": observation.prefix, "suffix": observation.suffix}
    except Exception:  # noqa: BLE001 - a loop whose protocol needs a real rollout: recorded as far as known
        pass
    return protocol


def checkpoint_identity(ckpt: Path, policy_dir: Path) -> str:
    """The checkpoint's path and its weight files' sizes and modification times: another checkpoint, or
    this one trained again, reads differently (hashing gigabytes of full fine-tunes would take minutes)."""
    files = sorted(
        f for f in policy_dir.iterdir() if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file()
    )
    stamps = ", ".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"checkpoint {ckpt.resolve()} [{stamps}]"


def export_searcher(
    checkpoint: str | Path, out: str | Path, *, dtype: str = "keep", overwrite: bool = False
) -> Path:
    """Write `checkpoint` (a checkpoint or run directory) as a Hugging Face model directory `out`.

    LoRA adapters are merged into the base; the directory holds safetensors weights, config,
    generation config, tokenizer with its chat template, and `searcher.json` (loop, loop options
    with the resolved prompt templates, token budgets), so `AutoModelForCausalLM.from_pretrained(out)`
    and `sleuth serve-searcher --checkpoint out` both load it. `dtype` casts the weights ("keep":
    the precision the checkpoint serves in). Written under a temporary name and renamed into place.
    """
    import torch  # deferred: torch is heavy and this module's other paths run without it

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(
            f"--out {out} exists and is not empty; pass --overwrite or choose another directory"
        )
    ckpt = resolve_checkpoint(checkpoint)
    searcher = load_searcher(ckpt, device="cpu", merge_lora=True)
    model, tokenizer = searcher.generator.model, searcher.generator.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{ckpt}: the tokenizer has no chat template, so a serving engine could not build the searcher's "
            "prompts; train from a chat model (its tokenizer_config.json carries chat_template)"
        )
    if dtype != "keep":
        model = model.to(getattr(torch, dtype))
    # a checkpoint trained from a tokenizer with the wrong eos (<|im_start|>) exports the chat turn end
    changed = align_chat_special_tokens(tokenizer)
    disable_bpe_cleanup(tokenizer)
    align_model_special_ids(model, tokenizer, also_stop_at=changed.get("eos_token", (None,))[0])
    info = replace(
        searcher.info,
        lora=False,
        policy_dir=".",
        extra={
            **searcher.info.extra,
            "exported_from": str(ckpt.resolve()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            # the loop's full settings, prompt templates included, for users who drive the model elsewhere
            "loop_config": searcher.loop.config(),
            # and the protocol such a driver follows: where to stop, how documents come back
            "protocol": loop_protocol(searcher.loop),
        },
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_compatible_files(tmp)
        info.write(tmp)
        give_normal_permissions(tmp)
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
