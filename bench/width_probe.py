"""Issue 43: does each new micro-batch width cost a one-off (an attention plan, allocator growth)? One model
(random-weight Qwen2.5-3B, LoRA r64, the trainer's bf16 adapter inputs), micro-batches of 5 rows at widths never
seen, then seen again: the first and second call's seconds per width, with or without cuDNN's SDPA. Measured on
an H200 (bench/results/update43_h200_20261129/s16_call6_*): a new width cost ~0.15 s more than a repeat of
~0.7 s with cuDNN, ~0.03 s without (whose repeats were ~5% slower); hence `sleuth.rl.batch.GPU_WIDTH_MULTIPLE`.

    python bench/width_probe.py --tokenizer .models/qwen3-tokenizer --out width_probe.json [--no-cudnn-sdpa]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import update_profile as up  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:qwen2.5-3b")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--widths", type=int, nargs="+", default=[3141, 3077, 2990, 3141, 2861, 3077, 2733, 2990])
    p.add_argument("--out", required=True)
    p.add_argument("--no-cudnn-sdpa", action="store_true", help="SDPA without its cuDNN backend")
    args = p.parse_args()
    ns = argparse.Namespace(
        model=args.model,
        tokenizer=args.tokenizer,
        rows=5,
        length=3141,
        prompt_tokens=141,
        turn_tokens=500,
        obs_tokens=250,
        lora_rank=64,
    )
    device = "cuda"
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, info = up.build(ns, "no_input_cast", device)
    vocab = info.get("vocab_size") or model.config.vocab_size
    rows = []
    for width in args.widths:
        ns.length = width
        batch = up.synthetic_batch(ns, vocab, device)
        adv = torch.linspace(-1, 1, 5, device=device)[:, None].expand_as(batch.action_mask).contiguous()
        times = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            start = up._common.timer(device)
            up.micro_step(model, batch, adv, True, device)
            times.append(up._common.timer(device) - start)
        rows.append(
            {
                "width": width,
                "first_s": times[0],
                "second_s": times[1],
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            }
        )
        print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
