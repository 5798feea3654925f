"""The decode step's fused operations: Triton kernels on CUDA, plain torch references everywhere else.

Each public function takes the same arguments on every device. On CUDA tensors (and with Triton
importable) it launches the Triton kernel; otherwise it runs the torch reference, which is also what the
tests compare the kernels with (on a CPU the kernels run under Triton's interpreter,
`TRITON_INTERPRET=1`, see tests/test_decode_engine.py).

Why these five: one decode step of a 0.5B-7B model at batch 64 reads ~1-15 GB of weights in a few
milliseconds, so every extra launch and every extra pass over the KV cache shows. Per layer the step is
four matrix products plus these fused operations: residual add + RMSNorm, rotary + KV store, attention
over each row's *live* keys only (split over the sequence, flash-decoding style, then combined), and
SiLU-gate. Sampling (Gumbel-max, exact for the categorical distribution) and the sampled token's
log-prob run in one pass over the logits, inside the captured step.

KV layout ("ragged"): one pool of token slots per layer, `(slots, kv_heads, head_dim)`; row b owns the
slots `start[b] .. start[b] + capacity[b]` and its token at position p lives in slot `start[b] + p`.
Memory is the sum of what the rows asked for, not batch x longest row, and dropping finished rows from
the batch moves no key or value.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU installs may lack it (the references then run)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
log = logging.getLogger(__name__)


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for tensors like `t` (CUDA, or the interpreter on a CPU)."""
    return triton is not None and (t.is_cuda or _INTERPRET)


@dataclass(frozen=True)
class HeadLayout:
    """How a fused q/k/v projection splits into heads, and the rotary embedding applied to q and k."""

    heads: int
    kv_heads: int
    inv_freq: torch.Tensor  # (head_dim / 2,) fp32
    rope_scale: float = 1.0  # transformers' attention_scaling
    eps: float = 1e-6  # of the per-head RMSNorm (Qwen3's q_norm / k_norm)

    @property
    def head_dim(self) -> int:
        return self.inv_freq.numel() * 2


# ---------------------------------------------------------------------------------------------------
# References (torch): the arithmetic of transformers' Llama/Qwen2 modules, rounding where they round


def add_rmsnorm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight); x and the result in x's dtype, the norm in fp32."""
    if delta is not None:
        x = x + delta
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * h.to(x.dtype)


def rope_store_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    layout: HeadLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Split a decode step's fused projection (B, (H + 2 KV) * D) into heads, apply the optional per-head
    RMSNorm (Qwen3's q_norm, k_norm) and rotary embedding at `positions`, store k and v at `slots`; return q
    (B, H, D). `rotary`: `rotary_tables(positions, layout, qkv.dtype)` when the caller already has them (every layer
    of a step rotates the same positions)."""
    heads, kv_heads, inv_freq, eps = layout.heads, layout.kv_heads, layout.inv_freq, layout.eps
    b = qkv.shape[0]
    d = inv_freq.numel() * 2
    q, k, v = qkv.view(b, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], dim=1)
    if norms is not None:
        q = add_rmsnorm_reference(q, None, norms[0], eps)[1]
        k = add_rmsnorm_reference(k, None, norms[1], eps)[1]
    cos, sin = rotary if rotary is not None else rotary_tables(positions, layout, qkv.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]  # one position per row, shared by its heads
    k_cache[slots] = apply_rotary(k, cos, sin)
    v_cache[slots] = v
    return apply_rotary(q, cos, sin).contiguous()


def rotary_tables(
    positions: torch.Tensor, layout: HeadLayout, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape positions.shape + (head_dim,), in `dtype` as transformers casts them."""
    angles = positions.float()[..., None] * layout.inv_freq.float()
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * layout.rope_scale).to(dtype), (emb.sin() * layout.rope_scale).to(dtype)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `q * cos + rotate_half(q) * sin` over the last dimension, each product in t's dtype."""
    d = t.shape[-1]
    half = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], dim=-1)
    return (t * cos) + (half * sin)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per row (B, H, D) over that row's `lengths[b]` keys from slot `starts[b]`; (B, H, D)."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    width = int(lengths.max().item()) if b else 0
    idx = starts.long()[:, None] + torch.arange(width, device=q.device)[None, :]
    live = torch.arange(width, device=q.device)[None, :] < lengths.long()[:, None]
    idx = torch.where(live, idx, torch.zeros_like(idx))
    k = k_cache[idx].float()  # (B, W, KV, D)
    v = v_cache[idx].float()
    qg = q.float().view(b, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("bkgd,bwkd->bkgw", qg, k) * scale
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgw,bwkd->bkgd", scores.softmax(-1), v)
    return out.reshape(b, heads, d).to(q.dtype)


def decode_attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`decode_attention_reference` on a CPU: one SDPA call per row over views of its slots. The reference gathers
    every row's keys and values into a padded fp32 copy each layer and step, which made attention ~85% of a
    SmolLM2-135M decode step on a CPU core (8 rows of 1,200 keys: 8.3 -> 1.3 ms a layer); a row's slots are
    contiguous, so each row is read alone. In fp32, rounded to q's dtype at the end, as the reference and the CUDA
    kernel compute; a row's query heads attend in groups over their shared key/value head.

    With torch running several threads, the rows are split between them (`_ROW_THREADS`): a row's small operations
    gained nothing from torch's own threads (64 rows of ~600 keys, 30 layers: 234 ms a step on one thread, 244 on
    two), and each row computes exactly what it computes alone."""
    b = q.shape[0]
    out = q.new_empty(q.shape)
    spans = list(zip(starts.tolist(), lengths.tolist(), strict=True))
    threads = torch.get_num_threads()
    if threads < 2 or b < _MIN_SPLIT_ROWS:
        _attend_rows(out, q, k_cache, v_cache, spans, range(b), scale)
        return out
    parts = _balanced_parts([n for _, n in spans], threads)
    torch.set_num_threads(1)  # this thread's share runs on one core, the workers' on the others
    try:
        pending = [
            _row_workers(threads - 1).submit(_attend_rows, out, q, k_cache, v_cache, spans, part, scale)
            for part in parts[1:]
        ]
        _attend_rows(out, q, k_cache, v_cache, spans, parts[0], scale)
        for job in pending:
            job.result()
    finally:
        torch.set_num_threads(threads)
    return out


_MIN_SPLIT_ROWS = 4  # below it a handoff to the workers costs more than it saves
_ROW_THREADS: dict[int, ThreadPoolExecutor] = {}  # workers of decode_attention_rows, by count


def _row_workers(n: int) -> ThreadPoolExecutor:
    """n worker threads that run torch single-threaded (each is one core's share of the rows)."""
    pool = _ROW_THREADS.get(n)
    if pool is None:
        pool = ThreadPoolExecutor(
            n, thread_name_prefix="sleuth-attn", initializer=torch.set_num_threads, initargs=(1,)
        )
        _ROW_THREADS[n] = pool
    return pool


def _balanced_parts(lengths: list[int], parts: int) -> list[range]:
    """Consecutive row ranges with about equal numbers of keys (a row's attention costs about its keys)."""
    total, bounds, acc = sum(lengths), [0], 0
    for i, n in enumerate(lengths):
        acc += n
        if len(bounds) < parts and acc * parts >= total * len(bounds):
            bounds.append(i + 1)
    bounds.append(len(lengths))
    return [range(a, z) for a, z in zip(bounds, bounds[1:], strict=False) if z > a] or [range(0)]


def _attend_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[tuple[int, int]],
    rows: range,
    scale: float,
) -> None:
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    for row in rows:
        start, length = spans[row]
        k = k_cache[start : start + length].float().transpose(0, 1)  # (kv_heads, keys, d)
        v = v_cache[start : start + length].float().transpose(0, 1)
        # a group's queries share their head's keys
        grouped = q[row].float().view(kv_heads, heads // kv_heads, d)
        out[row] = F.scaled_dot_product_attention(grouped, k, v, scale=scale).view(heads, d)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gumbel_noise_reference(shape: tuple[int, int], seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
    u = torch.rand(shape, generator=gen, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(u))


def sample_reference(
    logits: torch.Tensor, temperature: float, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sampling at `temperature` (argmax when 0) with the sampled token's log-prob under
    `log_softmax(logits / temperature)` (`log_softmax(logits)` when greedy). `seed` is a one-element int
    tensor: the same seed gives the same tokens on the same device."""
    x = logits.float()
    if temperature <= 0:
        tokens = x.argmax(-1)
        logprobs = x.log_softmax(-1)
    else:
        x = x / temperature
        logprobs = x.log_softmax(-1)
        tokens = (x + gumbel_noise_reference(tuple(x.shape), int(seed.item()), x.device)).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(d_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)).to(
                x.dtype
            )
            tl.store(x_ptr + row * n + cols, x, mask=m)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / n
        h = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        tl.store(y_ptr + row * n + cols, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=m)

    @triton.jit
    def _rope_store_kernel(
        qkv_ptr,
        pos_ptr,
        slot_ptr,
        inv_ptr,
        qn_ptr,
        kn_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        rope_scale,
        eps,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        D: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)  # 0..HEADS-1 query heads, then KV_HEADS key heads, then KV_HEADS value heads
        half = tl.arange(0, D // 2)
        base = qkv_ptr + row * (HEADS + 2 * KV_HEADS) * D + head * D
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if head >= HEADS + KV_HEADS:  # value head: a plain store
            kvh = head - HEADS - KV_HEADS
            full = tl.arange(0, D)
            tl.store(v_ptr + (slot * KV_HEADS + kvh) * D + full, tl.load(base + full))
        else:
            lo = tl.load(base + half)
            hi = tl.load(base + D // 2 + half)
            dtype = lo.dtype
            if QK_NORM:
                if head < HEADS:
                    w_lo = tl.load(qn_ptr + half).to(tl.float32)
                    w_hi = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
                else:
                    w_lo = tl.load(kn_ptr + half).to(tl.float32)
                    w_hi = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
                var = (
                    tl.sum(lo.to(tl.float32) * lo.to(tl.float32), 0)
                    + tl.sum(hi.to(tl.float32) * hi.to(tl.float32), 0)
                ) / D
                r = 1.0 / tl.sqrt(var + eps)
                lo = (w_lo * (lo.to(tl.float32) * r).to(dtype).to(tl.float32)).to(dtype)
                hi = (w_hi * (hi.to(tl.float32) * r).to(dtype).to(tl.float32)).to(dtype)
            pos = tl.load(pos_ptr + row).to(tl.float32)
            angle = pos * tl.load(inv_ptr + half)
            cos = (tl.cos(angle) * rope_scale).to(dtype).to(tl.float32)
            sin = (tl.sin(angle) * rope_scale).to(dtype).to(tl.float32)
            lo32 = lo.to(tl.float32)
            hi32 = hi.to(tl.float32)
            # transformers: q * cos + rotate_half(q) * sin, each product rounded to the model dtype
            out_lo = ((lo32 * cos).to(dtype).to(tl.float32) + (-hi32 * sin).to(dtype).to(tl.float32)).to(
                dtype
            )
            out_hi = ((hi32 * cos).to(dtype).to(tl.float32) + (lo32 * sin).to(dtype).to(tl.float32)).to(dtype)
            if head < HEADS:
                dst = q_ptr + (row * HEADS + head) * D
            else:
                dst = k_ptr + (slot * KV_HEADS + (head - HEADS)) * D
            tl.store(dst + half, out_lo)
            tl.store(dst + D // 2 + half, out_hi)

    @triton.jit
    def group_program(GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
        """An attention program's (row, KV head, split) from its grid position, the head-dimension lanes, and
        the query heads of its KV head's group (padded to BLOCK_G, with their mask)."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        return row, kvh, split, tl.arange(0, D), g < GROUP, kvh * GROUP + g

    @triton.jit
    def attend_pool_keys(
        q,
        k_ptr,
        v_ptr,
        start,
        kvh,
        lo,
        hi,
        scale,
        KV_HEADS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Online softmax of one (row, KV head)'s queries `q` (BLOCK_G, D) over the pool's keys at positions
        [lo, hi) of the row starting at slot `start`: the running max, the sum of exp and the unnormalised
        output (shared by the split kernel here and fused_kernels' rope + attention kernel)."""
        dd = tl.arange(0, D)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            offs = ((start + n)[:, None] * KV_HEADS + kvh) * D + dd[None, :]
            k = tl.load(k_ptr + offs, mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs, mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _decode_attention_split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        start_ptr,
        len_ptr,
        acc_ptr,
        lse_ptr,
        scale,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        D: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        row, kvh, split, dd, gmask, heads = group_program(GROUP=GROUP, BLOCK_G=BLOCK_G, D=D)
        q = tl.load(q_ptr + (row * HEADS + heads[:, None]) * D + dd[None, :], mask=gmask[:, None], other=0.0)
        start = tl.load(start_ptr + row).to(tl.int64)
        length = tl.load(len_ptr + row)
        span = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * span
        hi = tl.minimum(lo + span, length)
        m_i, l_i, acc = attend_pool_keys(
            q,
            k_ptr,
            v_ptr,
            start,
            kvh,
            lo,
            hi,
            scale,
            KV_HEADS=KV_HEADS,
            D=D,
            BLOCK_G=BLOCK_G,
            BLOCK_N=BLOCK_N,
        )
        out_idx = (row * HEADS + heads) * SPLITS + split
        has = l_i > 0
        tl.store(
            acc_ptr + out_idx[:, None] * D + dd[None, :],
            acc / tl.where(has, l_i, 1.0)[:, None],
            mask=gmask[:, None],
        )
        tl.store(
            lse_ptr + out_idx, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")), mask=gmask
        )

    @triton.jit
    def _decode_attention_combine_kernel(acc_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
        idx = tl.program_id(0)  # row * HEADS + head
        s = tl.arange(0, SPLITS)
        dd = tl.arange(0, D)
        lse = tl.load(lse_ptr + idx * SPLITS + s)
        m = tl.max(lse, 0)
        w = tl.exp(lse - m)
        acc = tl.load(acc_ptr + (idx * SPLITS + s)[:, None] * D + dd[None, :])
        out = tl.sum(acc * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + idx * D + dd, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        gate = tl.load(gu_ptr + row * 2 * n + cols, mask=m, other=0.0)
        up = tl.load(gu_ptr + row * 2 * n + n + cols, mask=m, other=0.0)
        g32 = gate.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
        tl.store(out_ptr + row * n + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=m)

    @triton.jit
    def _sample_range(
        logits_ptr, seed, row, vocab, lo, hi, inv_temp, GREEDY: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One pass over a row's columns lo..hi: (best Gumbel score, its column, its tempered logit, running max
        and running sum of exp for the log-softmax). The noise of column c is Philox(seed, row * vocab + c)."""
        best = tl.full([1], float("-inf"), tl.float32)
        best_idx = tl.zeros([1], tl.int32)
        best_x = tl.zeros([1], tl.float32)
        run_m = tl.full([1], float("-inf"), tl.float32)
        run_s = tl.zeros([1], tl.float32)
        for v0 in range(lo, hi, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            m = cols < hi
            x = tl.load(logits_ptr + row.to(tl.int64) * vocab + cols, mask=m, other=float("-inf")).to(
                tl.float32
            )
            x = x * inv_temp
            if GREEDY:
                score = x
            else:
                u = tl.maximum(tl.rand(seed, row * vocab + cols), 1e-20)
                score = tl.where(m, x - tl.log(-tl.log(u)), float("-inf"))
            blk_best = tl.max(score, 0)
            blk_idx = tl.argmax(score, 0)
            blk_x = tl.sum(tl.where(cols == v0 + blk_idx, x, 0.0), 0)
            take = blk_best > best  # ties keep the earlier column
            best_idx = tl.where(take, v0 + blk_idx, best_idx)
            best_x = tl.where(take, blk_x, best_x)
            best = tl.where(take, blk_best, best)
            new_m = tl.maximum(run_m, tl.max(x, 0))
            run_s = run_s * tl.exp(run_m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            run_m = new_m
        return best, best_idx, best_x, run_m, run_s

    @triton.jit
    def _sample_kernel(
        logits_ptr, seed_ptr, tok_ptr, lp_ptr, vocab, inv_temp, GREEDY: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        _, best_idx, best_x, run_m, run_s = _sample_range(
            logits_ptr, tl.load(seed_ptr), row, vocab, 0, vocab, inv_temp, GREEDY, BLOCK
        )
        one = tl.arange(0, 1)
        tl.store(tok_ptr + row + one, best_idx.to(tl.int64))
        tl.store(lp_ptr + row + one, best_x - run_m - tl.log(run_s))

    @triton.jit
    def _sample_split_kernel(
        logits_ptr,
        seed_ptr,
        part_ptr,
        idx_ptr,
        vocab,
        inv_temp,
        CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # one program per (row, vocabulary chunk); the partials (best score, its logit, running max, running
        # sum) go to part_ptr[row, split, 0:4] and the best column to idx_ptr[row, split]
        row = tl.program_id(0)
        split = tl.program_id(1)
        lo = split * CHUNK
        best, best_idx, best_x, run_m, run_s = _sample_range(
            logits_ptr,
            tl.load(seed_ptr),
            row,
            vocab,
            lo,
            tl.minimum(lo + CHUNK, vocab),
            inv_temp,
            GREEDY,
            BLOCK,
        )
        one = tl.arange(0, 1)
        base = part_ptr + (row * SPLITS + split) * 4
        tl.store(base + one, best)
        tl.store(base + 1 + one, best_x)
        tl.store(base + 2 + one, run_m)
        tl.store(base + 3 + one, run_s)
        tl.store(idx_ptr + row * SPLITS + split + one, best_idx)

    @triton.jit
    def _sample_combine_kernel(
        part_ptr, idx_ptr, tok_ptr, lp_ptr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr
    ):
        # the first chunk holding the row's best score wins (as _sample_kernel's first block does)
        row = tl.program_id(0)
        k = tl.arange(0, BLOCK_S)
        km = k < SPLITS
        base = part_ptr + (row * SPLITS + k) * 4
        best = tl.load(base, mask=km, other=float("-inf"))
        win = tl.argmax(best, 0)
        x = tl.sum(tl.where(k == win, tl.load(base + 1, mask=km, other=0.0), 0.0), 0)
        m = tl.load(base + 2, mask=km, other=float("-inf"))
        total_m = tl.max(m, 0)
        total_s = tl.sum(tl.load(base + 3, mask=km, other=0.0) * tl.exp(m - total_m), 0)
        idx = tl.sum(tl.where(k == win, tl.load(idx_ptr + row * SPLITS + k, mask=km, other=0), 0), 0)
        tl.store(tok_ptr + row, idx.to(tl.int64))
        tl.store(lp_ptr + row, x - total_m - tl.log(total_s))


# ---------------------------------------------------------------------------------------------------
# Dispatch


def add_rmsnorm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on x when a delta is given (x += delta); returns (x, normed x * weight). x is (B, n) contiguous."""
    if not triton_enabled(x):
        new_x, y = add_rmsnorm_reference(x, delta, weight, eps)
        if delta is not None:
            x.copy_(new_x)
        if out is not None:
            out.copy_(y)
            y = out
        return x, y
    y = out if out is not None else torch.empty_like(x)
    n = x.shape[-1]
    _add_rmsnorm_kernel[(x.shape[0],)](
        x,
        delta if delta is not None else x,
        weight,
        y,
        n,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    return x, y


def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    layout: HeadLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `rope_store_reference`; positions and slots are int tensors of shape (B,)."""
    if not triton_enabled(qkv):
        q = rope_store_reference(qkv, positions, slots, layout, k_cache, v_cache, norms)
        if q_out is not None:
            q_out.copy_(q)
            return q_out
        return q
    b, heads, kv_heads = qkv.shape[0], layout.heads, layout.kv_heads
    q = q_out if q_out is not None else qkv.new_empty((b, heads, layout.head_dim))
    q_norm, k_norm = (
        norms if norms is not None else (layout.inv_freq, layout.inv_freq)
    )  # unread without norms
    _rope_store_kernel[(b, heads + 2 * kv_heads)](
        qkv,
        positions,
        slots,
        layout.inv_freq,
        q_norm,
        k_norm,
        q,
        k_cache,
        v_cache,
        layout.rope_scale,
        layout.eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=layout.head_dim,
        QK_NORM=norms is not None,
    )
    return q


def attention_splits(batch: int, kv_heads: int, multiprocessors: int = 132) -> int:
    """Sequence splits per (row, KV head): enough programs for two waves over the chip, at most 16."""
    want = math.ceil(2 * multiprocessors / max(1, batch * kv_heads))
    return max(1, min(16, triton.next_power_of_2(want) if triton is not None else want))


_ATTENTION_BLOCK_N = 64  # keys per inner iteration of the split kernel


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `decode_attention_reference`; reads only the live keys of each row."""
    if not triton_enabled(q):
        if q.device.type == "cpu":
            res = decode_attention_rows(q, k_cache, v_cache, starts, lengths, scale)
        else:
            res = decode_attention_reference(q, k_cache, v_cache, starts, lengths, scale)
        if out is not None:
            out.copy_(res)
            return out
        return res
    b, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    acc = torch.empty((b, heads, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, heads, splits), dtype=torch.float32, device=q.device)
    _decode_attention_split_kernel[(b, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        starts,
        lengths,
        acc,
        lse,
        scale,
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=d,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=_ATTENTION_BLOCK_N,
        SPLITS=splits,
    )
    res = out if out is not None else q.new_empty((b, heads, d))
    _decode_attention_combine_kernel[(b * heads,)](acc, lse, res, D=d, SPLITS=splits)
    return res


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if not triton_enabled(gate_up):
        res = silu_mul_reference(gate_up)
        if out is not None:
            out.copy_(res)
            return out
        return res
    b, n2 = gate_up.shape
    n = n2 // 2
    res = out if out is not None else gate_up.new_empty((b, n))
    block = 1024
    _silu_mul_kernel[(b, triton.cdiv(n, block))](gate_up, res, n, BLOCK=block)
    return res


# vocabulary columns per program: a 152k vocabulary gives each row 19 programs (SLEUTH_SAMPLE_CHUNK=0: one
# program per row, the comparison row of bench/gpu_paper.sh's s_short)
SAMPLE_CHUNK = int(os.environ.get("SLEUTH_SAMPLE_CHUNK", "8192")) or 2**62
_SPLIT_SAMPLER_FAILED: list[Exception] = []  # set once the split sampler failed to compile on this machine


def sample(
    logits: torch.Tensor,
    temperature: float,
    seed: torch.Tensor,
    tokens: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    chunk: int = SAMPLE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (int64) and their log-probs (fp32) for (B, V) logits; see `sample_reference`. The kernel
    draws its Gumbel noise from Philox(seed, row * V + column): `seed` lives on the device so a captured
    step can advance it between replays. A vocabulary wider than `chunk` is split over several programs per
    row and combined (one program per row took 0.27 ms per step at batch 64 on an H100, 13% of a 0.5B
    decode step); the split draws the same noise, so it samples the same tokens."""
    if not triton_enabled(logits):
        tok, lp = sample_reference(logits, temperature, seed)
        if tokens is not None:
            tokens.copy_(tok)
            logprobs.copy_(lp)
            return tokens, logprobs
        return tok, lp
    b, vocab = logits.shape
    tok = tokens if tokens is not None else torch.empty(b, dtype=torch.int64, device=logits.device)
    lp = logprobs if logprobs is not None else torch.empty(b, dtype=torch.float32, device=logits.device)
    greedy = temperature <= 0
    inv_temp = 1.0 if greedy else 1.0 / temperature
    splits = triton.cdiv(vocab, chunk)
    if splits > 1 and not _SPLIT_SAMPLER_FAILED:
        parts = torch.empty((b, splits, 4), dtype=torch.float32, device=logits.device)
        idx = torch.empty((b, splits), dtype=torch.int32, device=logits.device)
        try:
            _sample_split_kernel[(b, splits)](
                logits,
                seed,
                parts,
                idx,
                vocab,
                inv_temp,
                CHUNK=chunk,
                SPLITS=splits,
                GREEDY=greedy,
                BLOCK=min(4096, chunk),
            )
            _sample_combine_kernel[(b,)](
                parts, idx, tok, lp, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits)
            )
            return tok, lp
        except Exception as err:  # a compiler that rejects it: the one-program sampler draws the same tokens
            log.warning("split sampler unavailable (%s); sampling with one program per row", err)
            _SPLIT_SAMPLER_FAILED.append(err)
    _sample_kernel[(b,)](logits, seed, tok, lp, vocab, inv_temp, GREEDY=greedy, BLOCK=4096)
    return tok, lp
