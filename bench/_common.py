"""Helpers shared by bench/rollout.py and bench/train_step.py.

Kept free of heavy imports at module level: torch/transformers are imported inside the functions,
so `--help` is instant and a bench only pulls in what it uses (BM25 retrieval, never the dense/FAISS
path).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_TOKENIZER = REPO / ".models" / "qwen3-tokenizer"

# Real shapes of the Qwen2.5 searchers that Search-R1 / s3 train, for random-weight models (no download).
RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    # The papers' searchers (Search-R1, s3, R-Search: Qwen2.5-3B/7B; 7B does not tie its output embedding)
    "qwen2.5-3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    # Same vocabulary and layout, tiny body: exercises the random:* path (Qwen3 tokenizer, save/load) on a CPU.
    "qwen-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
}

# Peak HBM bandwidth (GB/s) by card-name fragment; first match wins, so the specific names come first.
CARD_BANDWIDTH_GBS: list[tuple[str, float]] = [
    ("H100 PCIE", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM
    ("H200", 4800.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),
]

# Dense bf16 peak (TFLOP/s) by card-name fragment, the denominator of verl's MFU (its get_device_flops: 989 for
# H100/H800/H200)
CARD_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
]

# Modules a GPU run must not need (not in the image, or slow to import); recorded in the JSON as a check.
WATCHED_MODULES = (
    "jax",
    "faiss",
    "fastapi",
    "uvicorn",
    "orjson",
    "mcp",
    "llama_cpp",
    "sentence_transformers",
    "trl",
    "datasets",
    "bm25s",
    "Stemmer",
    "pydantic",
    "gguf",
)


# ---------------------------------------------------------------------------------------------------
# Pure arithmetic (tested in tests/test_bench_smoke.py)


def default_bandwidth_gbs(card_name: str) -> float | None:
    """Peak memory bandwidth of a known card from its `torch.cuda.get_device_name()`, else None."""
    upper = card_name.upper()
    for fragment, gbs in CARD_BANDWIDTH_GBS:
        if fragment in upper:
            return gbs
    return None


def default_bf16_tflops(card_name: str) -> float | None:
    """Dense bf16 peak of a known card from its `torch.cuda.get_device_name()`, else None."""
    upper = card_name.upper()
    return next((tflops for fragment, tflops in CARD_BF16_TFLOPS if fragment.upper() in upper), None)


def verl_flops(arch: dict[str, Any], seqlens: list[int]) -> float:
    """A training pass's FLOPs by verl's counter for Qwen2/Llama (flops_counter.py): 6 x dense parameters x tokens
    (the embedding and output layer counted twice, as verl does, tied or not) plus 12 x sum(seqlen^2) x head_dim x
    heads x layers for attention. It counts a full fine-tuning pass whatever is trained (LoRA included), as verl's
    `perf/mfu/actor` does."""
    hidden, layers, heads = arch["hidden_size"], arch["num_hidden_layers"], arch["num_attention_heads"]
    head_dim = hidden // heads
    kv = arch["num_key_value_heads"] * head_dim
    mlp = hidden * arch["intermediate_size"] * 3
    attn_linear = hidden * (heads * head_dim + 2 * kv + heads * head_dim)
    dense = (mlp + attn_linear) * layers + arch["vocab_size"] * hidden * 2
    return 6.0 * dense * sum(seqlens) + 12.0 * sum(n * n for n in seqlens) * head_dim * heads * layers


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of K and V that one cached token occupies across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def decode_call_bytes(weight_bytes: int, kv_per_token: int, width: int, row_tokens: list[int]) -> float:
    """Bytes one batched `generate` call must read from memory, at least.

    Every step reads the weights once (steps = the longest row); row r, still active at its step t,
    reads the KV of its `width + t` earlier tokens (width = padded prompt width). A lower bound: it
    ignores activations, padding rows kept by a static cache and the unused tail of a static buffer.
    """
    steps = max(row_tokens, default=0)
    kv_tokens = sum(n * width + n * (n - 1) / 2 for n in row_tokens)
    return steps * weight_bytes + kv_per_token * kv_tokens


def hbm_fraction(bytes_read: float, seconds: float, bandwidth_gbs: float | None) -> float | None:
    """Achieved share of peak bandwidth: (bytes / bandwidth) / measured time; None without a bandwidth."""
    if not bandwidth_gbs or seconds <= 0:
        return None
    return bytes_read / (bandwidth_gbs * 1e9) / seconds


# ---------------------------------------------------------------------------------------------------
# Environment


def require_positive(args: Any, *names: str) -> None:
    """Exit with a message naming the flag when any of these integer options is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def pick_device(requested: str | None) -> str:
    import torch

    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit(f"--device {requested}: CUDA is not available on this machine; use --device cpu")
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(requested: str | None, device: str) -> str:
    names = {
        "bf16": "bfloat16",
        "bfloat16": "bfloat16",
        "fp32": "float32",
        "float32": "float32",
        "fp16": "float16",
        "float16": "float16",
    }
    if requested is None:
        return "bfloat16" if device.startswith("cuda") else "float32"
    if requested not in names:
        raise SystemExit(f"--dtype {requested!r}: use one of {sorted(names)}")
    return names[requested]


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
    }
    if device.startswith("cuda"):
        env["card"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        env["card"] = platform.processor() or platform.machine()
    return env


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timer(device: str) -> float:
    """perf_counter after the device has finished queued work."""
    sync(device)
    return time.perf_counter()


def peak_memory_bytes(device: str) -> tuple[int, str]:
    """(peak bytes, what was measured): allocator peak on CUDA, process peak RSS on CPU."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS (ru_maxrss)"


def watched_modules_loaded() -> list[str]:
    return sorted(m for m in WATCHED_MODULES if m in sys.modules)


# ---------------------------------------------------------------------------------------------------
# Models


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def build_model(
    spec: str, tokenizer_dir: str | None, device: str, dtype: str
) -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode on `device`, tokenizer, description) for a model spec.

    `random:<arch>` builds random weights with a real architecture (RANDOM_ARCHS) and takes its
    tokenizer from `tokenizer_dir` (default .models/qwen3-tokenizer); anything else goes through
    `sleuth.llm.registry.resolve_model_path` (aliases like "tiny", "smollm2-135m-instruct", or a directory).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith("random:"):
        arch = spec.split(":", 1)[1]
        if arch not in RANDOM_ARCHS:
            raise SystemExit(
                f"--model {spec}: unknown architecture {arch!r}; choose random:{' | random:'.join(RANDOM_ARCHS)}"
            )
        tok_dir = Path(tokenizer_dir) if tokenizer_dir else DEFAULT_TOKENIZER
        if not (tok_dir / "tokenizer_config.json").exists():
            raise SystemExit(
                f"--tokenizer {tok_dir}: no tokenizer there (expected tokenizer_config.json); "
                "pass --tokenizer DIR with a saved Hugging Face tokenizer"
            )
        from transformers import Qwen2Config

        config = Qwen2Config(
            **({"tie_word_embeddings": True} | RANDOM_ARCHS[arch]),
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
        )
        torch.manual_seed(0)
        # Initialising directly on the device: a 1.5B model's random init takes seconds there, a minute on CPU.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        source = f"random weights, Qwen2 config of {arch}"
    else:
        from sleuth.llm.registry import resolve_model_path

        path = resolve_model_path(spec)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype)).to(device)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or path)
        source = str(path)
    model.eval()
    return model, tokenizer, describe_model(model, spec, source)


def describe_model(model: Any, spec: str, source: str) -> dict[str, Any]:
    cfg = model.config
    params = {id(p): p for p in model.parameters()}  # tied weights once
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    num_params = sum(p.numel() for p in params.values())
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if not tied:
        # An untied input embedding is only gathered (a few rows per step), not streamed.
        emb = model.get_input_embeddings().weight
        weight_bytes -= emb.numel() * emb.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    return {
        "spec": spec,
        "source": source,
        "params": num_params,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": cfg.vocab_size,
        "tied_embeddings": tied,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(cfg.num_hidden_layers, kv_heads, head_dim, element),
    }


# ---------------------------------------------------------------------------------------------------
# Synthetic world + BM25 index


def build_world(out_dir: Path, passages: int, questions: int, seed: int = 0) -> dict[str, Any]:
    """Write a synthetic world (corpus + FlashRAG splits) and a BM25 index under `out_dir`.

    Returns paths and the train questions. Only the BM25 modules are imported (no FAISS/encoders).
    """
    from sleuth.data.formats import load_qa
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval.index import build_index

    out_dir.mkdir(parents=True, exist_ok=True)
    # 80% of the questions land in train.jsonl.
    write_world(generate_world(passages, max(10, questions * 5 // 4 + 2), hops=(1, 2), seed=seed), out_dir)
    build_index(out_dir / "corpus.jsonl", "bm25", out_dir / "bm25", show_progress=False)
    train = load_qa(str(out_dir / "train.jsonl"))
    return {"dir": out_dir, "train": out_dir / "train.jsonl", "index": out_dir / "bm25", "examples": train}


# ---------------------------------------------------------------------------------------------------
# Local HTTP servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 120.0, log: Path | None = None) -> None:
    """Wait until `url`/health answers 200; fail early, with the server's log tail, if it exits."""
    import httpx

    def tail() -> str:
        return "\n" + log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}{tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server for {url} did not come up within {timeout:.0f} s{tail()}")


# ---------------------------------------------------------------------------------------------------
# Output


def out_path(requested: str | None, name: str) -> Path:
    """--out if given, else $OUT/<name> (the GPU machine's return folder), else bench/results/<name>."""
    if requested:
        return Path(requested)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    return RESULTS / name


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def print_table(
    title: str, columns: list[tuple[str, str]], rows: list[dict[str, Any]], notes: list[str]
) -> None:
    """A rich table; `columns` are (row key, header)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for _, header in columns:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*(fmt(row.get(key)) for key, _ in columns))
    console = Console(width=max(160, Console().width))
    console.print(table)
    for note in notes:
        console.print(f"  {note}")
