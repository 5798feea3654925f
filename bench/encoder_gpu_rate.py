"""Passages/s of the dense encoder's model alone on a GPU (issue 24: is the GPU or the tokenizer the limit?).

    PYTHONPATH=src python bench/encoder_gpu_rate.py --model .gpu/minilm --lengths 128 192 --batches 512 2048

Random token ids of a fixed length (no padding, no tokenizer), fp16, mean-pooled last hidden state; 3 warm-up
batches, then 10 timed ones per (length, batch). Real passages (~100 words) are ~130-190 MiniLM tokens.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

import torch

from _common import out_path, write_json


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local sentence-transformers / BERT folder")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 192])
    p.add_argument("--batches", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers import AutoModel

    if not torch.cuda.is_available():
        raise SystemExit("encoder_gpu_rate: needs a CUDA device")
    model = AutoModel.from_pretrained(args.model, dtype=torch.float16).cuda().eval()
    rows = []
    for length in args.lengths:
        for batch in args.batches:
            ids = torch.randint(1000, 30000, (batch, length), device="cuda")
            mask = torch.ones_like(ids)
            with torch.no_grad():
                for _ in range(3):
                    model(input_ids=ids, attention_mask=mask)
                torch.cuda.synchronize()
                start, n = time.perf_counter(), 10
                for _ in range(n):
                    model(input_ids=ids, attention_mask=mask).last_hidden_state.mean(1)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            rows.append({"length": length, "batch": batch, "passages_per_s": round(n * batch / seconds)})
            print(
                f"{args.model} fp16, length {length}, batch {batch}: {rows[-1]['passages_per_s']:,} passages/s"
            )
    result = {
        "bench": "encoder_gpu_rate",
        "card": torch.cuda.get_device_name(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    write_json(out_path(args.out, "encoder_gpu_rate.json"), result)
    return result


if __name__ == "__main__":
    main()
