"""Decode throughput of HFGenerator: dynamic vs static KV cache vs static + torch.compile.

    # CPU, the embedded SmolLM2-135M-Instruct (converted once into the sleuth cache):
    OMP_NUM_THREADS=2 python bench/llm_generate.py --model smollm2 --batch-sizes 1 8 --modes dynamic
    # GPU, a randomly initialised model of SmolLM2-135M's (or a larger) architecture, no files needed:
    python bench/llm_generate.py --model random:smollm2-135m --batch-sizes 1 8 64 --modes dynamic static static+compile

Greedy decoding of `--new-tokens` tokens per prompt with EOS disabled, so every row decodes the full
length. tokens/s counts generated tokens of the whole batch over the generate() wall time (prefill
included), after one untimed warm-up call per configuration (which also pays for compilation).
`match` compares each mode's token ids with the dynamic-cache ids of the same batch (float32 runs
should match exactly; bf16 runs may diverge after near-ties). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

ARCHS = {
    # SmolLM2-135M's shape (Llama): what the embedded default model costs per token.
    "smollm2-135m": dict(
        arch="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
    # Qwen2.5-3B's shape: the searcher size used by Search-R1 and s3.
    "qwen2.5-3b": dict(
        arch="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
}


def build_generator(model: str, device: str, dtype: str, mode: str, max_batch: int) -> Any:
    import torch

    from sleuth.llm.hf import HFGenerator

    cache = "dynamic" if mode == "dynamic" else "static"
    compile_step = mode == "static+compile"
    if model.startswith("random:"):
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

        from sleuth.llm.tiny import build_tiny_model

        spec = dict(ARCHS[model.split(":", 1)[1]])
        config_cls = LlamaConfig if spec.pop("arch") == "llama" else Qwen2Config
        config = config_cls(**spec, max_position_embeddings=8192, tie_word_embeddings=True)
        torch.manual_seed(0)
        net = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device)
        # Any tokenizer will do: prompts are token ids drawn below the model's vocabulary.
        tok_dir = build_tiny_model(Path("/tmp/sleuth-bench-tiny"))
        from transformers import AutoTokenizer

        gen = HFGenerator(
            net,
            tokenizer=AutoTokenizer.from_pretrained(tok_dir),
            cache=cache,
            compile=compile_step,
            max_batch_size=max_batch,
        )
    else:
        from sleuth.llm.registry import resolve_model_path

        gen = HFGenerator(
            resolve_model_path(model),
            device=device,
            dtype=dtype,
            cache=cache,
            compile=compile_step,
            max_batch_size=max_batch,
        )
    gen.eos_token_ids = frozenset()  # decode the full length on every row
    return gen


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # Mixed lengths (half to full) exercise left padding like real agent batches.
    return [
        [rng.randrange(100, min(vocab, 30000)) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
        for _ in range(batch)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--modes", nargs="+", default=["dynamic"], choices=["dynamic", "static", "static+compile"]
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from sleuth.llm.base import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    rows: list[dict[str, Any]] = []
    reference: dict[int, list[list[int]]] = {}
    for mode in args.modes:
        gen = build_generator(args.model, device, dtype, mode, max(args.batch_sizes))
        vocab = gen.model.config.vocab_size
        for batch in args.batch_sizes:
            prompts = prompts_for(batch, args.prompt_len, vocab, seed=batch)
            gen.generate(prompts, params=params)  # warm-up (and compilation)
            times, outs = [], None
            for _ in range(args.repeats):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outs = gen.generate(prompts, params=params)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            ids = [o.token_ids for o in outs]
            reference.setdefault(batch, ids)
            match = sum(a == b for a, b in zip(ids, reference[batch], strict=True)) / batch
            best = min(times)
            generated = sum(len(i) for i in ids)
            rows.append(
                {
                    "mode": mode,
                    "batch": batch,
                    "seconds": round(best, 4),
                    "tokens_per_s": round(generated / best, 1),
                    "steps_per_s": round(args.new_tokens / best, 1),
                    "match_dynamic": match,
                }
            )
            print(
                f"{mode:15s} batch {batch:4d}: {generated / best:9.1f} tok/s  {args.new_tokens / best:7.1f} steps/s"
                f"  ({best:.3f} s)  match={match:.2f}",
                flush=True,
            )
        del gen
        if device == "cuda":
            torch.cuda.empty_cache()

    print("\n| mode | batch | tokens/s | steps/s | s | match dynamic |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['batch']} | {r['tokens_per_s']} | {r['steps_per_s']} | {r['seconds']} | {r['match_dynamic']:.2f} |"
        )
    device_name = (
        torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    )
    result = {
        "model": args.model,
        "device": device,
        "device_name": device_name,
        "dtype": dtype,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"llm_generate_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
