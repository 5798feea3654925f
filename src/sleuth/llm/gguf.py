"""Load GGUF checkpoints through transformers, converting once into a cached safetensors directory.

transformers de-quantises a GGUF file on every `from_pretrained(..., gguf_file=...)`, which is slow
(tens of seconds even for a 135M model). We do it once, save the result with `save_pretrained`
(model + tokenizer) under the sleuth cache, and load that directory afterwards.

The cache key is the file name, size and mtime and the conversion's version, so replacing the GGUF
file, or a sleuth whose conversion writes something else, invalidates the entry. The conversion makes
eos the chat template's turn end (`sleuth.llm.special_tokens`): some transformers versions read a
GGUF tokenizer with eos `<|im_start|>`.
The conversion writes into a temporary sibling directory and renames it into place, so a crash or
a concurrent conversion never leaves a half-written directory behind under the final name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from sleuth.errors import ConfigError
from sleuth.llm.special_tokens import (
    align_chat_special_tokens,
    align_model_special_ids,
    disable_bpe_cleanup,
    write_compatible_files,
)
from sleuth.utils import give_normal_permissions

CONVERTED_MARKER = "sleuth_gguf_source.txt"
# Raised when the converted directory's contents change (2: eos/pad aligned with the chat template,
# files readable by older transformers, normal permissions; 3: model_input_names for transformers 4.x, no
# _model_name_or_path), so stale cache entries are redone.
CONVERSION_VERSION = 3


def cache_root() -> Path:
    """Root of sleuth's on-disk cache: $SLEUTH_CACHE, else ~/.cache/sleuth."""
    env = os.environ.get("SLEUTH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sleuth"


def gguf_cache_key(gguf_path: str | Path) -> str:
    """A short stable key for one GGUF file version: hash of name, size and mtime."""
    path = Path(gguf_path)
    st = path.stat()
    raw = f"{path.name}:{st.st_size}:{st.st_mtime_ns}:v{CONVERSION_VERSION}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def converted_dir_for(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted checkpoint of `gguf_path` lives (whether or not it exists yet)."""
    path = Path(gguf_path)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return root / f"{stem}-{gguf_cache_key(path)}"


def is_converted(directory: str | Path) -> bool:
    d = Path(directory)
    return (d / CONVERTED_MARKER).exists() and (d / "config.json").exists()


def ensure_converted(
    gguf_path: str | Path,
    *,
    cache_dir: str | Path | None = None,
    dtype: str = "float32",
) -> Path:
    """Return a directory loadable with plain `from_pretrained`, converting `gguf_path` if needed.

    `dtype` is the precision the de-quantised weights are stored in ("float32", "bfloat16",
    "float16"); float32 keeps CPU numerics simple and is small for the embedded 135M model.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"GGUF file not found: {path} (pass an existing .gguf file)")
    target = converted_dir_for(path, cache_dir)
    if is_converted(target):
        return target

    import torch  # deferred: torch is heavy and this module's other paths run without it

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ConfigError(
            f"unsupported dtype {dtype!r} for GGUF conversion; use float32, bfloat16 or float16"
        )

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        try:
            tokenizer = _load_tokenizer(path)
            model = _load_dequantized(path, torch_dtype)
        except ImportError as err:
            raise ConfigError(f"loading {path} needs the `gguf` package: pip install gguf ({err})") from err
        changed = align_chat_special_tokens(tokenizer)
        disable_bpe_cleanup(tokenizer)
        align_model_special_ids(model, tokenizer, also_stop_at=changed.get("eos_token", (None,))[0])
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_compatible_files(tmp)
        (tmp / CONVERTED_MARKER).write_text(f"{path}\n")
        give_normal_permissions(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; keep theirs.
            if not is_converted(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_tokenizer(path: Path):  # noqa: ANN202 - transformers type imported lazily
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _load_dequantized(path: Path, torch_dtype):  # noqa: ANN001, ANN202 - torch types imported lazily
    """Load a GGUF file as a plain dense model that `save_pretrained` accepts.

    transformers attaches a GGUF quantizer to the loaded model which refuses serialisation even when
    every weight was unpacked, so we copy the dense weights into a fresh model built from the config.
    """
    # deferred: transformers takes seconds to import; needed only once a model loads
    from transformers import AutoModelForCausalLM

    kwargs = {}
    try:
        # deferred: transformers is heavy; needed only for a GGUF load
        from transformers.utils.quantization_config import GgufConfig

        # Unpack every weight: a packed (kernel-backed) layer cannot be saved as safetensors.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always de-quantised GGUF files
        pass
    loaded = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch_dtype, **kwargs
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = dense.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(dense, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(
            f"could not convert {path} to a dense checkpoint: missing weights {missing[:5]}, "
            f"unexpected weights {unexpected[:5]}"
        )
    dense.generation_config = loaded.generation_config
    return dense
