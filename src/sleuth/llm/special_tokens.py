"""The special tokens a chat model's tokenizer, config and generation config must agree on.

A chat template ends every turn with one token (`<|im_end|>` in ChatML). That token is what a
serving engine stops at (vLLM and TGI stop at `generation_config.eos_token_id` and
`tokenizer.eos_token`; TRL appends `tokenizer.eos_token` to SFT targets), so it must be the
tokenizer's eos. Some transformers versions read a GGUF file's tokenizer with eos/pad set to
`<|im_start|>` (the turn *opener*): every checkpoint trained from it inherits that, and its exports
stop at the wrong token. `align_chat_special_tokens` repairs a tokenizer in place;
`align_model_special_ids` makes a model's config and generation config name the same ids;
`write_compatible_files` makes a saved directory load with older transformers too.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Turn-end tokens of the chat formats in use: ChatML (Qwen, SmolLM), Llama 3, Gemma, Phi-3.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
# transformers >= 5 writes this class name; 4.x does not know it and refuses to load the tokenizer.
_NEW_ONLY_TOKENIZER_CLASSES = frozenset({"TokenizersBackend"})
COMPATIBLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
CAUSAL_LM_INPUTS = ("input_ids", "attention_mask")  # what a decoder-only model's forward takes
_LOAD_TIME_TOKENIZER_KEYS = ("local_files_only", "is_local")  # how it was loaded here, not what it is


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _token_id(tokenizer: Any, token: str) -> int | None:
    ids = tokenizer.convert_tokens_to_ids([token])
    token_id = ids[0] if ids else None
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id


def chat_turn_end_token(tokenizer: Any) -> str | None:
    """The token the tokenizer's chat template ends each turn with, if it is one of the known
    turn-end tokens and a single token of the vocabulary; None otherwise (no template, plain LM)."""
    template = _template_text(tokenizer)
    for token in TURN_END_TOKENS:
        if token in template and _token_id(tokenizer, token) is not None:
            return token
    return None


def align_chat_special_tokens(tokenizer: Any) -> dict[str, tuple[str | None, str]]:
    """Make eos the chat template's turn end, and pad too where pad was unset or was the wrong eos.

    bos is left as it is (SmolLM2's is `<|im_start|>`, as its Hugging Face release sets it).
    Returns what changed, {"eos_token": (old, new), ...}; {} when the tokenizer was already right or
    has no chat template with a known turn end."""
    turn_end = chat_turn_end_token(tokenizer)
    if turn_end is None or tokenizer.eos_token == turn_end:
        return {}
    old_eos, old_pad = tokenizer.eos_token, tokenizer.pad_token
    changes: dict[str, tuple[str | None, str]] = {"eos_token": (old_eos, turn_end)}
    tokenizer.eos_token = turn_end
    if old_pad is None or old_pad == old_eos:
        tokenizer.pad_token = turn_end
        changes["pad_token"] = (old_pad, turn_end)
    return changes


def disable_bpe_cleanup(tokenizer: Any) -> bool:
    """Turn off `clean_up_tokenization_spaces` on a BPE tokenizer; True if it was on.

    The clean-up targets WordPiece and deletes real spaces before punctuation in BPE output; transformers
    5 ignores it for BPE with a warning on the first decode, 4.x applies it. Off, both decode alike."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    is_bpe = backend is not None and type(backend.model).__name__ == "BPE"
    if not (is_bpe and getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return False
    tokenizer.clean_up_tokenization_spaces = False
    if isinstance(getattr(tokenizer, "init_kwargs", None), dict):
        tokenizer.init_kwargs["clean_up_tokenization_spaces"] = False  # what save_pretrained writes
    return True


@contextmanager
def peft_deprecation_silenced() -> Iterator[None]:
    """Around peft's model wrapping: peft reads `model.is_gradient_checkpointing`, which transformers 5
    deprecates with a FutureWarning on every load; only that warning, only there, is filtered."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def align_model_special_ids(model: Any, tokenizer: Any, also_stop_at: str | None = None) -> None:
    """Set the model config's and generation config's bos/eos/pad ids to the tokenizer's.

    `also_stop_at`: a token a model trained with the wrong eos may end its turns with (the old eos
    `align_chat_special_tokens` replaced); the generation config lists it after the eos, so engines
    that stop at `generation_config.eos_token_id` stop there too (a turn opener never belongs inside
    an answer)."""
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is None:
            continue
        for key, value in ids.items():
            if value is not None:
                setattr(config, key, value)
    extra = _token_id(tokenizer, also_stop_at) if also_stop_at else None
    gen = getattr(model, "generation_config", None)
    if gen is not None and extra is not None and extra != tokenizer.eos_token_id:
        gen.eos_token_id = [tokenizer.eos_token_id, extra]


def write_compatible_files(directory: str | Path) -> None:
    """Rewrite a saved model directory so that transformers 4.x loads it as 5.x does.

    - tokenizer_config.json: a tokenizer class 4.x knows (`PreTrainedTokenizerFast` reads the same
      tokenizer.json) instead of 5.x's `TokenizersBackend`;
    - tokenizer_config.json: `model_input_names` [input_ids, attention_mask]: without it 4.x's
      `PreTrainedTokenizerFast` also returns `token_type_ids`, which `model.generate(**inputs)` refuses for a
      causal LM; the load-time settings 5.x saves with it (`local_files_only`, `is_local`) are dropped;
    - config.json: `rope_theta` (and `rope_scaling` for a non-default rope) at the top level, where
      4.x reads them; 5.x nests them in `rope_parameters` and 4.x would fall back to rope_theta 10000;
      `_model_name_or_path` (the GGUF file's own title, "Smollm2 135M 8k Lc100K Mix1 Ep2") is dropped.
    """
    directory = Path(directory)
    tok_path = directory / "tokenizer_config.json"
    if tok_path.is_file():
        tok_config = json.loads(tok_path.read_text())
        if tok_config.get("tokenizer_class") in _NEW_ONLY_TOKENIZER_CLASSES:
            tok_config["tokenizer_class"] = COMPATIBLE_TOKENIZER_CLASS
        tok_config.setdefault("model_input_names", list(CAUSAL_LM_INPUTS))
        for key in _LOAD_TIME_TOKENIZER_KEYS:
            tok_config.pop(key, None)
        tok_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    config_path = directory / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        config.pop("_model_name_or_path", None)
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
            config["rope_theta"] = rope["rope_theta"]
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling.get("rope_type", "default") != "default" and "rope_scaling" not in config:
                config["rope_scaling"] = scaling
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
