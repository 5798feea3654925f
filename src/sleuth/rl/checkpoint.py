"""Atomic training checkpoints.

A checkpoint is a directory `step_000012/` holding the policy (full weights or
LoRA adapters, via `save_pretrained`), the critic, optimizer and scheduler
states, RNG states and the trainer state (step, data cursor, stage). It is
written under a temporary name and renamed into place, and `latest` is updated
atomically afterwards, so a run killed at any moment (even SIGKILL) leaves
either the previous complete checkpoint or the new one, never half of one.
`manifest.json`, written last, lists every file with its size and sha256; resume
checks it, so a checkpoint damaged later (a truncated copy, a full disk) is
skipped for the newest intact one, and the skipped one is named.

Only our own tensors and plain Python values are stored; loading uses
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from sleuth.errors import CheckpointError
from sleuth.run_layout import (
    CRITIC,
    LATEST,
    MANIFEST,
    POLICY_DIR,
    RUN_INFO,
    TRAINER_STATE,
    TRAINING_STATE,
    SearcherInfo,
    checkpoint_dir,
    checkpoints_dir,
)
from sleuth.run_layout import latest_checkpoint as latest_checkpoint  # re-exported for the trainer's callers
from sleuth.utils import (
    atomic_write_json,
    atomic_write_text,
    is_write_failure,
    output_error,
    sha256_file,
    tree_bytes,
)


def rng_state() -> dict[str, Any]:
    state = {
        "python": _py_state_to_list(random.getstate()),
        "numpy": _np_state_to_list(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _py_state_to_list(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def _np_state_to_list(s: tuple) -> list:
    return [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]


@dataclass
class TrainingStates:
    """What a checkpoint saves of the models and optimisation. Under FSDP the caller also passes the
    full (gathered) `policy_state`, `critic_state` and `optimizer_states` (see `full_states`), since
    sharded modules cannot be saved directly; None means: take the module's own state_dict."""

    policy: torch.nn.Module
    tokenizer: Any
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    critic: torch.nn.Module | None = None
    policy_state: dict[str, Any] | None = None
    critic_state: dict[str, Any] | None = None
    optimizer_states: dict[str, Any] | None = None


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    states: TrainingStates,
    *,
    trainer_state: dict[str, Any],
    searcher: SearcherInfo | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` under `out_dir/checkpoints/` atomically; prune to the newest `keep`. A full disk
    or read-only directory raises OutputError (one line: path, bytes needed) and leaves no temp directory;
    the previous checkpoint stays intact."""
    root = checkpoints_dir(out_dir)
    final = checkpoint_dir(out_dir, step)
    tmp = root / f".tmp_{final.name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):  # a save killed earlier (SIGKILL) left its temp directory
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        _write_checkpoint(tmp, step, states, trainer_state, searcher)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        atomic_write_text(root / LATEST, final.name + "\n")
    except (OSError, SafetensorError) as err:
        if isinstance(err, OSError) and not is_write_failure(err):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(out_dir)
        kept = (
            f"the last good checkpoint {last.name} is intact" if last is not None else "no earlier checkpoint"
        )
        raise output_error(
            f"checkpoint {final.name}",
            root,
            err,
            _needed_bytes(last, states),
            f"{kept}; free space (or move trainer.out_dir) and rerun with --resume",
        ) from None
    prune_checkpoints(root, final, keep)
    return final


def _write_checkpoint(
    tmp: Path, step: int, states: TrainingStates, trainer_state: dict[str, Any], searcher: SearcherInfo | None
) -> None:
    """Every file of one checkpoint into `tmp`, the manifest last."""
    policy, tokenizer, critic = states.policy, states.tokenizer, states.critic
    optimizers, schedulers = states.optimizers, states.schedulers
    policy_state, critic_state, optimizer_states = (
        states.policy_state,
        states.critic_state,
        states.optimizer_states,
    )
    policy.save_pretrained(tmp / POLICY_DIR, safe_serialization=True, state_dict=policy_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / POLICY_DIR)
    if critic is not None:
        torch.save(critic_state if critic_state is not None else critic.state_dict(), tmp / CRITIC)
    torch.save(
        {
            "optimizers": optimizer_states or {k: o.state_dict() for k, o in optimizers.items()},
            "schedulers": {k: s.state_dict() for k, s in schedulers.items()},
            "rng": rng_state(),
        },
        tmp / TRAINING_STATE,
    )
    (tmp / TRAINER_STATE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
    if searcher is not None:
        # what `sleuth.agent.searcher.load_searcher` needs to serve or evaluate this policy
        replace(searcher, step=step).write(tmp)
    write_manifest(tmp)


def _needed_bytes(last: Path | None, states: TrainingStates) -> int:
    """About what one checkpoint takes: the last one's size, else the trained weights plus Adam's two moments."""
    if last is not None:
        return tree_bytes(last)
    trained = sum(p.numel() * p.element_size() for p in states.policy.parameters() if p.requires_grad)
    critic = (
        sum(p.numel() * p.element_size() for p in states.critic.parameters())
        if states.critic is not None
        else 0
    )
    return 3 * (trained + critic)


def prune_checkpoints(root: Path, final: Path, keep: int) -> None:
    """Keep `final` and the newest `keep - 1` checkpoints before it. Higher-numbered ones are left over
    from steps this run redoes (resume skipped them as damaged): `final` supersedes them, so they go too;
    never the checkpoint just written, whatever its name sorts like."""
    others = sorted(p for p in root.glob("step_*") if p.is_dir() and p != final)
    older = [p for p in others if p.name < final.name]
    newer = [p for p in others if p.name > final.name]
    for old in newer + older[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def full_states(models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]):
    """Unsharded model and optimizer states (on the CPU, complete on rank 0) through the distributed
    checkpoint API; optimizer states are keyed by parameter name, so a checkpoint written by N ranks
    (DDP or FSDP) loads on M. A collective: every rank must call it."""
    # deferred: a heavy torch submodule only checkpoints need
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_states = {k: get_model_state_dict(m, options=opts) for k, m in models.items()}
    optim_states = {k: get_optimizer_state_dict(models[k], o, options=opts) for k, o in optimizers.items()}
    return model_states, optim_states


def load_optimizer_states(
    models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer], states: dict[str, Any]
) -> None:
    # deferred: a heavy torch submodule only checkpoints need
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    for k, o in optimizers.items():
        set_optimizer_state_dict(models[k], o, optim_state_dict=states[k], options=opts)


def write_manifest(ckpt: Path) -> None:
    """List every file of `ckpt` (relative path, size, sha256) in `manifest.json`, written last."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {
        p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in files
    }
    atomic_write_json(ckpt / MANIFEST, {"version": 1, "files": entries})


def verify_checkpoint(ckpt: Path) -> None:
    """Raise CheckpointError naming the first missing, resized or altered file. A checkpoint from
    before manifests existed is accepted if its trainer state is there."""
    manifest_path = ckpt / MANIFEST
    if not manifest_path.exists():
        if not (ckpt / TRAINER_STATE).exists():
            raise CheckpointError(f"{ckpt}: no {MANIFEST} and no {TRAINER_STATE}; not a complete checkpoint")
        return
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable checkpoint manifest ({err})") from None
    for rel, entry in files.items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {MANIFEST} but missing")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(
                f"{path}: {size} bytes, {MANIFEST} says {entry.get('size')} (truncated or damaged)"
            )
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(f"{path}: content differs from {MANIFEST} (sha256 mismatch; damaged)")


def _candidates(root: Path) -> list[Path]:
    """Checkpoint directories, newest first; the `latest` pointer's target leads."""
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    pointer = root / LATEST
    if pointer.exists():
        named = root / pointer.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def resumable_checkpoint(out_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that passes `verify_checkpoint`, and the (path, reason) of each newer
    one skipped as damaged."""
    root = checkpoints_dir(out_dir)
    skipped: list[tuple[Path, str]] = []
    if not root.is_dir():
        return None, skipped
    for ckpt in _candidates(root):
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as err:
            skipped.append((ckpt, str(err)))
            continue
        return ckpt, skipped
    return None, skipped


def load_training_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (trainer_state json, tensor state with optimizers/schedulers/rng); a damaged file
    raises CheckpointError naming it."""
    state_json = ckpt / TRAINER_STATE
    try:
        trainer_state = json.loads(state_json.read_text(encoding="utf-8"))
        int(trainer_state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{state_json}: unreadable trainer state ({type(err).__name__}: {err})"
        ) from None
    state_pt = ckpt / TRAINING_STATE
    try:
        state = torch.load(state_pt, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch.load raises EOFError, RuntimeError, UnpicklingError...
        raise CheckpointError(
            f"{state_pt}: damaged optimizer/RNG state ({type(err).__name__}: {err}); "
            "delete this checkpoint directory to resume from an older one"
        ) from None
    return trainer_state, state


def write_run_info(out_dir: str | Path, info: dict[str, Any]) -> None:
    atomic_write_json(Path(out_dir) / RUN_INFO, info)
