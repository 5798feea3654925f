"""Supervised fine-tuning on trajectory records (`sleuth sft RECIPE`, or a recipe's `sft:` section).

The loss is the mean cross-entropy over policy tokens only (loss_mask 1): the prompt and
every inserted document or feedback token are context, never targets, exactly as in the RL
update. LoRA or full fine-tuning follows `model.lora`. Checkpoints are the RL trainer's
(`checkpoints/step_N` with `searcher.json`), so `sleuth train` starts RL from one
(`model.init_from`), and `sleuth eval --model`, `serve-searcher` and `serve-mcp` load them.
A run resumes from its newest checkpoint; the data order of every epoch is a function of the
seed, so a resumed run trains on exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from sleuth.agent.coldstart import SFTRecord, iter_limited, read_records, split_records
from sleuth.agent.searcher import resolve_checkpoint
from sleuth.errors import ConfigError, DataFormatError
from sleuth.progress import progress_bar
from sleuth.rl.checkpoint import (
    TrainingStates,
    latest_checkpoint,
    load_training_state,
    save_checkpoint,
    set_rng_state,
)
from sleuth.rl.checkpoint_compat import FINGERPRINT, check_init_from, recipe_fingerprint
from sleuth.rl.config import Recipe
from sleuth.rl.interrupts import StoppedBySignal, sigterm_received
from sleuth.rl.loggers import open_recipe_loggers
from sleuth.rl.models import autocast, load_policy
from sleuth.rl.setup import build_optimizer, searcher_info
from sleuth.run_layout import POLICY_DIR, SFT_DIR, SFT_INFO
from sleuth.utils import atomic_write_json, seed_everything


def sft_out_dir(recipe: Recipe) -> Path:
    assert recipe.sft is not None
    return Path(recipe.sft.out_dir or Path(recipe.trainer.out_dir) / SFT_DIR)


def sft_batch(
    records: Sequence[SFTRecord], pad_id: int, max_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, target mask), both (B, L), rows right-padded. The target mask is 1 where position t's
    token is a policy token; position t is predicted from positions < t."""
    rows, masks = [], []
    for r in records:
        ids = (r.prompt_ids + r.response_ids)[:max_length]
        mask = ([0] * len(r.prompt_ids) + r.loss_mask)[:max_length]
        rows.append(ids)
        masks.append(mask)
    width = max(len(x) for x in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(mask)] = torch.tensor(mask)
    return ids, target


def masked_nll(model: torch.nn.Module, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed negative log-likelihood of the target tokens, and how many there are.

    The LM head runs only at the positions that predict a target token: (B, L, V) logits of whole
    trajectories, mostly inserted documents, took ~20 GB for 8 s3 trajectories at a 49k vocabulary.
    No attention mask: padding sits at the right end of each row, and causal attention keeps every
    real token from seeing it."""
    pick = target[:, 1:].bool()
    decoder, head = _decoder_and_head(model)
    if decoder is None:
        logits = model(input_ids=ids).logits[:, :-1][pick]
    else:
        hidden = decoder(input_ids=ids).last_hidden_state[:, :-1]
        logits = head(hidden[pick])
    logits = logits if logits.dtype == torch.float64 else logits.float()
    labels = ids[:, 1:][pick]
    nll = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    return nll, int(pick.sum().item())


def _decoder_and_head(model: torch.nn.Module) -> tuple[Any, Any]:
    """The transformer body and LM head of a causal LM (PEFT-wrapped or not), or (None, None) where the
    logits are more than head(hidden) (final soft-capping) or the model does not expose them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "final_logit_softcapping", None) or not hasattr(base, "get_decoder"):
        return None, None
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is None or decoder is base or head is None:
        return None, None
    return decoder, head


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 7_919 + epoch).shuffle(order)
    return order


@torch.no_grad()
def heldout_loss(
    model, records: Sequence[SFTRecord], pad_id: int, micro: int, max_length: int, device
) -> float:

    total, count = 0.0, 0
    for start in range(0, len(records), micro):
        ids, target = sft_batch(records[start : start + micro], pad_id, max_length)
        with autocast(device):
            nll, n = masked_nll(model, ids.to(device), target.to(device))
        total, count = total + float(nll), count + n
    return total / max(count, 1)


def load_sft_data(recipe: Recipe, vocab_size: int) -> tuple[list[SFTRecord], list[SFTRecord]]:
    cfg = recipe.sft
    assert cfg is not None
    records = read_records(cfg.data)
    wrong = sorted({r.loop for r in records} - {recipe.agent.loop})
    if wrong:
        raise ConfigError(
            f"sft.data={cfg.data} holds trajectories of loop(s) {', '.join(wrong)} but agent.loop is "
            f"{recipe.agent.loop!r}; make trajectories with `sleuth trajectories --loop {recipe.agent.loop}`"
        )
    top = max(max(r.prompt_ids + r.response_ids) for r in records)
    if top >= vocab_size:
        raise DataFormatError(
            cfg.data,
            None,
            f"token id {top} is outside the model's vocabulary ({vocab_size}): the trajectories "
            f"were tokenised for another model than {recipe.model.policy!r}",
        )
    train, held = split_records(records, cfg.held_out, recipe.seed)
    train = list(iter_limited(train, cfg.limit, recipe.seed))
    if not train:
        raise ConfigError(f"sft.data={cfg.data}: no training trajectories left after the held-out split")
    return train, held


def run_sft(recipe: Recipe, *, resume: bool = True, console: Any = None) -> dict[str, Any]:
    """Fine-tune the recipe's policy on `recipe.sft.data`; returns {"out_dir", "checkpoint", "metrics"}."""

    cfg = recipe.sft
    if cfg is None:
        raise ConfigError("the recipe has no sft: section (sft.data names the trajectory jsonl)")
    console = console or Console()
    out_dir = sft_out_dir(recipe)
    seed_everything(recipe.seed)
    device = torch.device(recipe.model.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = latest_checkpoint(out_dir) if resume else None
    init = (
        None
        if ckpt is not None or recipe.model.init_from is None
        else resolve_checkpoint(recipe.model.init_from)
    )
    if init is not None:
        check_init_from(recipe, init, console)
    tokenizer, policy, _ = load_policy(
        recipe, device, ckpt / POLICY_DIR if ckpt else (init / POLICY_DIR if init else None)
    )
    train, held = load_sft_data(recipe, policy.get_input_embeddings().num_embeddings)
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    trainer_state, tensor_state = load_training_state(ckpt) if ckpt else ({}, {})
    done = int(trainer_state.get("step", 0))
    opt, sched = build_optimizer(policy.parameters(), cfg.lr, recipe)
    if tensor_state:
        opt.load_state_dict(tensor_state["optimizers"]["policy"])
        sched.load_state_dict(tensor_state["schedulers"]["policy"])
        set_rng_state(tensor_state["rng"])
        console.print(f"[bold]resuming SFT[/] from {ckpt} (step {done} of {total})")
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open_recipe_loggers(recipe.model_copy(update={"name": f"{recipe.name}-sft"}), out_dir, done)
    pad = tokenizer.pad_token_id
    params = [p for p in policy.parameters() if p.requires_grad]
    info = {"records": len(train), "held_out_records": len(held), "steps": total, "data": cfg.data}

    def save(step: int, epoch: int) -> Path:
        states = TrainingStates(policy, tokenizer, optimizers={"policy": opt}, schedulers={"policy": sched})
        return save_checkpoint(
            out_dir,
            step,
            states,
            trainer_state={
                "kind": "sft",
                "epoch": epoch,
                "recipe": recipe.name,
                FINGERPRINT: recipe_fingerprint(recipe, algorithm="sft"),
            },
            searcher=replace(searcher_info(recipe), extra={"trained_with": "sft", **info}),
            keep=recipe.trainer.keep_checkpoints,
        )

    last: dict[str, float] = {}
    # on a terminal a live bar; in a log a plain line with the loss and the ETA every 30 s (sleuth.progress)
    bar = progress_bar(
        console,
        TextColumn("SFT"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeRemainingColumn(),
    )
    with bar:
        task = bar.add_task("sft", total=total, completed=done, loss="")
        for step in range(done, total):
            epoch, k = divmod(step, steps_per_epoch)
            order = _epoch_order(len(train), recipe.seed, epoch)
            batch = [train[i] for i in order[k * cfg.batch_size : (k + 1) * cfg.batch_size]]
            t0 = time.perf_counter()
            policy.train()
            opt.zero_grad(set_to_none=True)
            n_tokens = sum(sum(r.loss_mask) for r in batch)  # token-mean over the whole optimizer batch
            loss_sum = 0.0
            for m in range(0, len(batch), cfg.micro_batch_size):
                ids, target = sft_batch(batch[m : m + cfg.micro_batch_size], pad, cfg.max_length)
                with autocast(device):
                    nll, _ = masked_nll(policy, ids.to(device), target.to(device))
                (nll / max(n_tokens, 1)).backward()
                loss_sum += float(nll.detach())
            norm = torch.nn.utils.clip_grad_norm_(params, recipe.optim.grad_clip)
            if torch.isfinite(norm):
                opt.step()
            sched.step()
            last = {
                "sft/loss": loss_sum / max(n_tokens, 1),
                "sft/grad_norm": float(norm),
                "sft/tokens": n_tokens,
                "sft/epoch": epoch + (k + 1) / steps_per_epoch,
                "time/step": time.perf_counter() - t0,
            }
            end_of_epoch = k == steps_per_epoch - 1
            if held and (end_of_epoch or step + 1 == total):
                policy.eval()
                last["sft/heldout_loss"] = heldout_loss(
                    policy, held, pad, cfg.micro_batch_size, cfg.max_length, device
                )
            log.write(step + 1, last)
            held_text = f" heldout {last['sft/heldout_loss']:.4f}" if "sft/heldout_loss" in last else ""
            bar.update(task, advance=1, loss=f"loss {last['sft/loss']:.4f}{held_text}")
            stop = sigterm_received() and step + 1 < total  # a preempted job: keep this step, then stop
            if stop or (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == total:
                save(step + 1, epoch)
            if stop:
                raise StoppedBySignal(
                    f"SIGTERM received after SFT step {step + 1} of {total}; checkpoint saved"
                )
    final = latest_checkpoint(out_dir)
    if final is None:
        raise ConfigError(f"SFT wrote no checkpoint under {out_dir}")
    log.finish({"checkpoint": str(final), "steps": total, "final_metrics": last})
    # The recipe too, as run.json holds it for RL: `sleuth report` names the recipe and model from it.
    atomic_write_json(
        out_dir / SFT_INFO,
        {
            **info,
            "kind": "sft",
            "final_checkpoint": str(final),
            "last": last,
            "recipe": recipe.model_dump(),
            "device": str(device),
        },
    )
    return {"out_dir": str(out_dir), "checkpoint": str(final), "metrics": last}
