"""Tiny local models for tests and the `--fast` demo: no network, built in seconds.

`build_tiny_model(out_dir)` trains a byte-level BPE tokenizer with `tokenizers`,
creates a small Qwen2-architecture causal LM from a config, and saves both with
`save_pretrained`, so they load through the same `from_pretrained` path as a
real checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from sleuth.errors import ConfigError

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_DEFAULT_TEXT = [
    "<think> I need to search for the answer. </think> <search> capital of Varonia </search>",
    "<information> Doc 1(Title: Varonia) Varonia is a country. Its capital is Quellstad. </information>",
    '<answer> Quellstad </answer> <query>{"query": "who directed the film"}</query>',
    "<important_info>[1, 3]</important_info> <search_complete>True</search_complete>",
    "<original_evidence> the evidence </original_evidence> <reflect> ok </reflect>",
    "<plan> first find the director </plan> <reflection> found it </reflection>",
    "Answer the given question. You must conduct reasoning inside think tags.",
    "The quick brown fox jumps over the lazy dog. Where was the director of the film born?",
    "0 1 2 3 4 5 6 7 8 9 [ ] { } ( ) : , . ? ! \" ' - _ / True False yes no",
]


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    extra_text: list[str] | None = None,
    seed: int = 0,
) -> Path:
    """Build and save a tiny tokenizer + causal LM under `out_dir`; returns the directory.

    Reuses an existing build in `out_dir` if its config matches, so tests can share one.
    """
    out = Path(out_dir)
    spec = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "extra_text": extra_text or [],
        "seed": seed,
    }
    if _built(out, spec):
        return out
    if out.is_dir() and any(out.iterdir()) and not (out / STAMP).exists():
        raise ConfigError(
            f"{out}: not empty and not a tiny model built by sleuth; give a new or empty directory"
        )
    # built under a temporary name and renamed into place: processes sharing the cache (parallel test workers)
    # never read a half-written model, and the first finished build is the one kept
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        _build(tmp, spec)
        _move_into_place(tmp, out, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


STAMP = "sleuth_tiny.json"


def _built(out: Path, spec: dict) -> bool:
    stamp = out / STAMP
    try:
        return stamp.exists() and json.loads(stamp.read_text()) == spec
    except ValueError:
        return False


def _move_into_place(tmp: Path, out: Path, spec: dict) -> None:
    if _built(out, spec):
        return  # another process finished first
    if out.exists():  # empty, or another spec built here before: set it aside, then replace it
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        with contextlib.suppress(OSError):  # gone meanwhile, or replaced by another process
            os.replace(out, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:
        if not _built(out, spec):  # another process put its own build there first: keep theirs
            raise


def _build(out: Path, spec: dict) -> None:
    """The tokenizer and model of `spec` written into `out` (the stamp last)."""
    # deferred: torch, tokenizers and transformers are heavy; only building the model needs them
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab_size, hidden_size, num_layers, num_heads, extra_text, seed = (
        spec["vocab_size"],
        spec["hidden_size"],
        spec["num_layers"],
        spec["num_heads"],
        spec["extra_text"],
        spec["seed"],
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_DEFAULT_TEXT * 4 + list(extra_text or []), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(hf_tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    (out / STAMP).write_text(json.dumps(spec))
