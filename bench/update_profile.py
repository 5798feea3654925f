"""Where the update's time goes: one micro-batch of the trainer's update (the policy-position log-probs and
entropy, a PPO-clip loss, the backward) on a random-weight model with a LoRA adapter, timed per variant, with a
kernel profile of the first (issue 43: the 3B LoRA update at 10-15k tokens/s per H200 against a 20k target).

    PYTHONPATH=src python bench/update_profile.py --model random:qwen2.5-3b --rows 5 --length 3141 \
        --variants base checkpoint_full lora_bf16 compile
    # CPU check: --model random:qwen-tiny --device cpu --rows 2 --length 64 --reps 1

Rows have Search-R1's full-budget layout (bench/paper_scale.py's `full` shape): a prompt, then turns of
`--turn-tokens` policy tokens each followed by `--obs-tokens` inserted observation tokens (not trained). Every
variant runs `--reps` timed micro-batches after one warm-up; tokens/s counts every token of the rows (the issue's
counter) and MFU is verl's (`_common.verl_flops`). Variants:
  base             the trainer's path: bf16 base, adapter weights as loaded, no activation checkpointing
  checkpoint_full  every decoder layer checkpointed (what `gradient_checkpointing: true` costs)
  lora_bf16        the adapter weights cast to bf16 (no float32 copies of the layers' inputs)
  compile          the model under torch.compile (the update's elementwise work fused)
  no_input_cast    float32 adapter weights, but peft no longer casts each layer's input to float32 (autocast runs
                   the adapter's products in bf16 from the bf16 input; no float32 copy kept for the backward)
  no_entropy       log-probs without the entropy (its float32 work and backward)
  packed_flex      the rows packed into one padding-free sequence under flex attention (`model.packing: packed`)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from sleuth.rl import losses as loss_fns  # noqa: E402
from sleuth.rl.batch import TokenBatch, forward_logprobs  # noqa: E402

VARIANTS = ("base", "checkpoint_full", "lora_bf16", "no_input_cast", "no_entropy", "packed_flex", "compile")
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-3b")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--rows", type=int, default=5, help="rows per micro-batch")
    p.add_argument("--length", type=int, default=3141, help="tokens per row (prompt + response)")
    p.add_argument("--prompt-tokens", type=int, default=141)
    p.add_argument("--turn-tokens", type=int, default=500)
    p.add_argument("--obs-tokens", type=int, default=250)
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument(
        "--profile-kernels", type=int, default=25, help="top kernels listed for the first variant (0: none)"
    )
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def synthetic_batch(args: argparse.Namespace, vocab: int, device: str) -> TokenBatch:
    """Rows of `--length` tokens: the prompt, then policy turns and observations alternating."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.rows, args.length), generator=g)
    width = args.length - args.prompt_tokens
    mask = torch.zeros(args.rows, width)
    col = 0
    while col < width:
        mask[:, col : col + args.turn_tokens] = 1.0
        col += args.turn_tokens + args.obs_tokens
    starts = torch.full((args.rows,), args.prompt_tokens, dtype=torch.long)
    lengths = torch.full((args.rows,), args.length, dtype=torch.long)
    return TokenBatch(ids.to(device), starts.to(device), mask.to(device), lengths.to(device))


def build(args: argparse.Namespace, variant: str, device: str) -> tuple[Any, dict[str, Any]]:
    from peft import LoraConfig, get_peft_model

    dtype = _common.pick_dtype(None, device)
    model, _tok, info = _common.build_model(args.model, args.tokenizer, device, dtype)
    model.config.use_cache = False
    if variant == "packed_flex":
        model.set_attn_implementation("flex_attention")
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules=LORA_MODULES,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    if variant == "lora_bf16" and device.startswith("cuda"):
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    if variant == "no_input_cast":
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    if variant == "checkpoint_full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    if variant == "compile":
        model = torch.compile(model)
    return model, info


def micro_step(
    model: Any,
    batch: TokenBatch,
    advantages: torch.Tensor,
    with_entropy: bool,
    device: str,
    packed: bool = False,
) -> float:
    """One micro-batch as the trainer runs it (sleuth.rl.trainer._micro_step, on-policy): the loss's value."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=device.startswith("cuda")):
        logprobs, _entropy = forward_logprobs(model, batch, 1.0, with_entropy=with_entropy, packed=packed)
        agg = loss_fns.LossAgg(
            "token-mean", num_tokens=float(batch.action_mask.sum()), num_seqs=float(len(advantages))
        )
        clip = loss_fns.PolicyClip(0.2, 0.2, None)
        loss, _ = loss_fns.get_policy_loss("ppo_clip")(
            logprobs.detach(), logprobs, advantages, batch.action_mask, clip=clip, agg=agg
        )
        loss.backward()
    return float(loss.detach())


def run_variant(args: argparse.Namespace, variant: str, device: str, profile: int) -> dict[str, Any]:
    _common.sync(device)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, info = build(args, variant, device)
    vocab = info.get("vocab_size") or model.config.vocab_size
    batch = synthetic_batch(args, vocab, device)
    advantages = (
        torch.linspace(-1, 1, args.rows, device=device)[:, None].expand_as(batch.action_mask).contiguous()
    )
    with_entropy, packed = variant != "no_entropy", variant == "packed_flex"
    start = _common.timer(device)
    micro_step(model, batch, advantages, with_entropy, device, packed)  # warm-up (and compilation)
    warm_s = _common.timer(device) - start
    times = []
    for _ in range(args.reps):
        model.zero_grad(set_to_none=True)
        start = _common.timer(device)
        micro_step(model, batch, advantages, with_entropy, device, packed)
        times.append(_common.timer(device) - start)
    seconds = sorted(times)[len(times) // 2]
    tokens = args.rows * args.length
    row: dict[str, Any] = {
        "variant": variant,
        "rows": args.rows,
        "tokens": tokens,
        "warmup_s": warm_s,
        "micro_step_s": seconds,
        "tokens_per_s": tokens / seconds,
    }
    arch = _common.RANDOM_ARCHS.get(args.model.removeprefix("random:"))
    peak = _common.default_bf16_tflops(torch.cuda.get_device_name() if device.startswith("cuda") else "")
    if arch and peak:
        row["mfu_verl"] = _common.verl_flops(arch, [args.length] * args.rows) / seconds / (peak * 1e12)
    if device.startswith("cuda"):
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if profile:
        row["kernels"] = top_kernels(model, batch, advantages, with_entropy, device, profile, packed)
    del model
    return row


def top_kernels(
    model: Any,
    batch: TokenBatch,
    advantages: torch.Tensor,
    with_entropy: bool,
    device: str,
    count: int,
    packed: bool = False,
) -> list[dict[str, Any]]:
    """The `count` kernels (or CPU ops on a CPU) with the most self time over one micro-batch."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    model.zero_grad(set_to_none=True)
    with profile(activities=activities) as prof:
        micro_step(model, batch, advantages, with_entropy, device, packed)
        _common.sync(device)
    cuda = device.startswith("cuda")
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr, 0) for e in events) or 1
    ranked = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)[:count]
    return [
        {
            "name": e.key[:90],
            "calls": e.count,
            "ms": getattr(e, attr, 0) / 1e3,
            "share": getattr(e, attr, 0) / total,
        }
        for e in ranked
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = _common.pick_device(args.device)
    env = _common.environment(device)
    out = _common.out_path(args.out, "update_profile.json")
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for i, variant in enumerate(args.variants):
        try:
            row = run_variant(args, variant, device, args.profile_kernels if i == 0 else 0)
        except (
            Exception
        ) as exc:  # a variant that cannot run here (e.g. compile) is reported, the rest still run
            row = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(
            f"{variant}: "
            + ", ".join(f"{k} {_common.fmt(v)}" for k, v in row.items() if k not in ("kernels", "variant")),
            flush=True,
        )
        result = {
            "bench": "update_profile",
            "environment": env,
            "date": time.strftime("%Y-%m-%d"),
            "command": "bench/update_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
        }
        _common.write_json(out, result)
    columns = [
        ("variant", "variant"),
        ("micro_step_s", "s / micro-batch"),
        ("tokens_per_s", "tokens/s"),
        ("mfu_verl", "MFU (verl)"),
        ("peak_allocated_gib", "peak GiB"),
        ("warmup_s", "warm-up s"),
    ]
    _common.print_table(
        f"update micro-batch: {args.model}",
        columns,
        rows,
        [f"{env['card']} | {args.rows} rows x {args.length} tokens | LoRA r{args.lora_rank}"],
    )
    kernels = next((r["kernels"] for r in rows if r.get("kernels")), [])
    if kernels:
        _common.print_table(
            f"top kernels ({rows[0]['variant']})",
            [("name", "kernel"), ("calls", "calls"), ("ms", "ms"), ("share", "share")],
            kernels,
            [],
        )
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
