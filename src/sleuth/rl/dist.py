"""Data-parallel training on torch.distributed (torchrun), single or multi node.

Layout: every rank holds a full copy of the policy wrapped in DDP, or a shard of
it under FSDP2 (`fully_shard`) when the model does not fit one GPU. Each rank
rolls out its own slice of the step's prompts; the n samples of a prompt are
always generated on one rank, so group-relative advantages (GRPO, RLOO) are
exact. Batch-wide statistics (advantage whitening, token counts for the loss
normaliser, logged metrics) are all-reduced, so a step on W ranks computes the
same update as one process on the whole batch.

Launch: `torchrun --nproc_per_node G -m sleuth.cli train RECIPE` (add
`--nnodes N --node_rank R --rdzv_endpoint HOST:PORT` across nodes). Without
torchrun, `DistContext` is a no-op single process.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sleuth.errors import ConfigError


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def gather_floats(self, values: list[float]) -> list[float]:
        """Concatenate every rank's list (rank order)."""
        return [float(v) for v in self.gather_objects(values)]

    def gather_objects(self, values: list[Any]) -> list[Any]:
        """Concatenate every rank's list of picklable items (rank order); every rank gets the whole list."""
        if not self.enabled:
            return list(values)
        out: list[list[Any]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(out, list(values))
        return [v for part in out for v in part]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed(requested_device: str | None = None) -> DistContext:
    """Join the process group torchrun describes (env RANK/WORLD_SIZE/LOCAL_RANK), or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        dev = torch.device(requested_device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return DistContext(device=dev)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (requested_device or "cuda").startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistContext(rank=rank, world_size=world, local_rank=local, device=device)


def shutdown_distributed() -> None:
    """Leave the process group before the process exits: gloo's threads torn down by interpreter exit instead
    can abort the process after the run finished (seen once in CI: rank 0 SIGABRT with every step logged)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # modules sharded over the group (DTensors) hold it: free them while the interpreter is whole
        dist.destroy_process_group()


def shard_range(total: int, ctx: DistContext, what: str) -> slice:
    """This rank's contiguous slice of `total` items (prompts); `total` must divide evenly."""
    if total % ctx.world_size:
        raise ConfigError(f"{what}={total} must be divisible by the number of ranks ({ctx.world_size})")
    per = total // ctx.world_size
    return slice(ctx.rank * per, (ctx.rank + 1) * per)


def wrap_model(model: torch.nn.Module, ctx: DistContext, strategy: str) -> torch.nn.Module:
    """DDP (a full replica per rank) or FSDP2 (parameters sharded over ranks)."""
    if not ctx.enabled:
        return model
    if strategy == "fsdp":
        # deferred: a heavy torch submodule only multi-process runs need
        from torch.distributed.fsdp import fully_shard

        # shard each transformer block, then the root, so only one block is gathered at a time
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        return fully_shard(model)
    # deferred: only multi-process runs wrap the model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DDP(model, device_ids=ids, find_unused_parameters=False)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def dist_masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, ctx: DistContext, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten over the selected positions of the batch on *all* ranks (unbiased variance)."""
    m = (mask != 0).to(values.dtype)
    stats = torch.stack([(values * m).sum(), (values * values * m).sum(), m.sum()]).double()
    total, total_sq, count = ctx.all_reduce_sum(stats).tolist()
    mean = total / max(count, 1.0)
    # equal values can give a variance a rounding error below 0, whose ** 0.5 is a complex number: clamp it
    var = max((total_sq - count * mean * mean) / max(count - 1.0, 1.0), 0.0)
    return ((values - mean) * (1.0 / (var + eps) ** 0.5)) * m


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, ctx: DistContext) -> float:
    """Clip gradients to a global L2 norm; returns the norm before clipping.

    DDP gradients are identical on every rank, so the local norm is the global one. FSDP gradients
    are disjoint shards (DTensors): their squared norms are summed over ranks first.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.stack([g.detach().double().pow(2).sum() for g in local]).sum()
    if ctx.enabled and any(hasattr(g, "to_local") for g in grads):
        sq = ctx.all_reduce_sum(sq.cpu()).to(sq.device)
    total = float(sq.sqrt())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in local:
            g.mul_(scale)
    return total
