"""Fused decode-step kernels: fewer launches per layer than `kernels.py`'s one-operation kernels.

Why: at batch 64 a 0.5B decode step is ~10 latency-bound kernels per layer of 2-7 us each (a profile on an H200,
bench/results/rollout_0.5b_short_profile_h200x4_run2.json), so each launch saved per layer is ~24 per step.
- `rope_attention`: the rotary of q and k (and Qwen3's per-head RMSNorm), the store of the new key/value
  into the pool and attention over the row's live keys in one program per (row, KV head[, split]). The new
  token's key/value enter the softmax from registers (the program that stores them is the only one that
  could read them back), and with one split the program normalises and writes the output itself: no
  `rope_store` kernel, no combine kernel, no fp32 scratch. Several splits still write partials that
  `kernels`' combine kernel merges (long contexts at small batch need the extra programs).
- `gate_up_silu`: the MLP's gate/up product for a decode-sized batch with SiLU(gate) * up in its epilogue,
  so `silu_mul` and the (B, 2 x intermediate) intermediate disappear. Opt-in (SLEUTH_FUSED_MLP=1) until it
  is timed against cuBLAS on a GPU.

Switches, read once at import (bench/rollout.py records them in its JSON): SLEUTH_FUSED_DECODE=0 turns the
fused attention off (the comparison row), SLEUTH_FUSED_MLP=1 turns the fused MLP on, SLEUTH_ATTENTION_SPLITS=N
fixes the attention splits (default: `attention_splits` chooses). Each public function runs the torch references
(the same ones `kernels.py` uses) where Triton does not run, and falls back to the unfused kernels if this
machine's Triton rejects a fused kernel.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from sleuth.llm import kernels
from sleuth.llm.kernels import HeadLayout, triton, triton_enabled

tl = kernels.tl
log = logging.getLogger(__name__)

FUSED_DECODE = os.environ.get("SLEUTH_FUSED_DECODE", "1") != "0"
FUSED_MLP = os.environ.get("SLEUTH_FUSED_MLP", "0") == "1"
ATTENTION_SPLITS = int(os.environ.get("SLEUTH_ATTENTION_SPLITS", "0"))  # 0: chosen per batch and length
_FAILED: dict[str, Exception] = {}  # fused kernels this machine's Triton rejected (the unfused path serves)


def settings() -> dict[str, object]:
    """The switches in force (bench/rollout.py records them with each row)."""
    return {
        "fused_decode_attention": FUSED_DECODE,
        "fused_mlp": FUSED_MLP,
        "attention_splits": ATTENTION_SPLITS or "auto",
        "sample_chunk": kernels.SAMPLE_CHUNK,
        "failed": sorted(_FAILED),
    }


def attention_splits(batch: int, kv_heads: int, max_len: int, multiprocessors: int = 132) -> int:
    """Sequence splits per (row, KV head) for rows of at most `max_len` live keys.

    One split (no combine pass, no scratch) once the (row, KV head) programs alone fill half the chip and no
    row is longer than 1,024 keys (16 blocks of 64: a program's serial walk stays a few microseconds);
    otherwise `kernels.attention_splits`' two waves over the chip. SLEUTH_ATTENTION_SPLITS overrides both."""
    if ATTENTION_SPLITS > 0:
        return ATTENTION_SPLITS
    if 2 * batch * kv_heads >= multiprocessors and max_len <= 16 * kernels._ATTENTION_BLOCK_N:
        return 1
    return kernels.attention_splits(batch, kv_heads, multiprocessors)


# ---------------------------------------------------------------------------------------------------
# References: the unfused operations, composed


def rope_attention_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    starts: torch.Tensor,
    layout: HeadLayout,
    cache: tuple[torch.Tensor, torch.Tensor],
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`rope_store` at slot starts + positions, then attention over positions + 1 keys; (B, H, D)."""
    k_cache, v_cache = cache
    q = kernels.rope_store_reference(
        qkv, positions.long(), (starts + positions).long(), layout, k_cache, v_cache, norms
    )
    return kernels.decode_attention_reference(
        q, k_cache, v_cache, starts, positions + 1, 1.0 / math.sqrt(layout.head_dim)
    )


def gate_up_silu_reference(h: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """silu(h @ W_gate^T) * (h @ W_up^T), each product rounded to h's dtype as the unfused step rounds it."""
    return kernels.silu_mul_reference(torch.nn.functional.linear(h, w_gate_up))


# ---------------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:

    @triton.jit
    def _rope_attention_kernel(
        qkv_ptr,
        pos_ptr,
        start_ptr,
        inv_ptr,
        qn_ptr,
        kn_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        acc_ptr,
        lse_ptr,
        scale,
        rope_scale,
        eps,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        D: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        row, kvh, split, dd, gmask, heads = kernels.group_program(GROUP=GROUP, BLOCK_G=BLOCK_G, D=D)
        # rotate_half as a second load: column d pairs with d +- D/2, the first half negated
        partner = (dd + D // 2) % D
        sign = tl.where(dd < D // 2, -1.0, 1.0)
        base = qkv_ptr + row * (HEADS + 2 * KV_HEADS) * D
        q = tl.load(base + heads[:, None] * D + dd[None, :], mask=gmask[:, None], other=0.0)
        qp = tl.load(base + heads[:, None] * D + partner[None, :], mask=gmask[:, None], other=0.0)
        k = tl.load(base + (HEADS + kvh) * D + dd)
        kp = tl.load(base + (HEADS + kvh) * D + partner)
        v_new = tl.load(base + (HEADS + KV_HEADS + kvh) * D + dd)
        dtype = q.dtype
        if QK_NORM:  # Qwen3: RMSNorm over each head before the rotary, as _rope_store_kernel rounds it
            rq = 1.0 / tl.sqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), 1) / D + eps)
            q = (
                tl.load(qn_ptr + dd).to(tl.float32)[None, :]
                * (q.to(tl.float32) * rq[:, None]).to(dtype).to(tl.float32)
            ).to(dtype)
            qp = (
                tl.load(qn_ptr + partner).to(tl.float32)[None, :]
                * (qp.to(tl.float32) * rq[:, None]).to(dtype).to(tl.float32)
            ).to(dtype)
            rk = 1.0 / tl.sqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), 0) / D + eps)
            k = (tl.load(kn_ptr + dd).to(tl.float32) * (k.to(tl.float32) * rk).to(dtype).to(tl.float32)).to(
                dtype
            )
            kp = (
                tl.load(kn_ptr + partner).to(tl.float32) * (kp.to(tl.float32) * rk).to(dtype).to(tl.float32)
            ).to(dtype)
        pos = tl.load(pos_ptr + row)
        angle = pos.to(tl.float32) * tl.load(inv_ptr + dd % (D // 2))
        cos = (tl.cos(angle) * rope_scale).to(dtype).to(tl.float32)
        sin = (tl.sin(angle) * rope_scale).to(dtype).to(tl.float32)
        # transformers: q * cos + rotate_half(q) * sin, each product rounded to the model dtype
        q = (
            (q.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
            + (qp.to(tl.float32) * (sign * sin)[None, :]).to(dtype).to(tl.float32)
        ).to(dtype)
        k = (
            (k.to(tl.float32) * cos).to(dtype).to(tl.float32)
            + (kp.to(tl.float32) * (sign * sin)).to(dtype).to(tl.float32)
        ).to(dtype)
        start = tl.load(start_ptr + row).to(tl.int64)
        length = pos + 1  # live keys, the new one included
        span = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * span
        hi = tl.minimum(lo + span, length)
        pool_hi = tl.minimum(hi, pos)  # keys already in the pool; the new one comes from registers
        m_i, l_i, acc = kernels.attend_pool_keys(
            q,
            k_ptr,
            v_ptr,
            start,
            kvh,
            lo,
            pool_hi,
            scale,
            KV_HEADS=KV_HEADS,
            D=D,
            BLOCK_G=BLOCK_G,
            BLOCK_N=BLOCK_N,
        )
        # the new token, in the split whose range holds position `pos` (the last non-empty one)
        mine = (lo <= pos) & (pos < hi)
        s_new = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale
        s_new = tl.where(mine, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_safe = tl.where(
            m_new == float("-inf"), 0.0, m_new
        )  # an empty split: keep exp() away from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p_new = tl.exp(s_new - m_safe)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new
        slot = start + pos
        store = dd < tl.where(
            mine, D, 0
        )  # all columns or none (the interpreter rejects a scalar & vector mask)
        tl.store(k_ptr + (slot * KV_HEADS + kvh) * D + dd, k, mask=store)
        tl.store(v_ptr + (slot * KV_HEADS + kvh) * D + dd, v_new, mask=store)
        if SPLITS == 1:  # the only program of this (row, KV head): normalise and write the output
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + (row * HEADS + heads)[:, None] * D + dd[None, :], out.to(dtype), mask=gmask[:, None]
            )
        else:
            out_idx = (row * HEADS + heads) * SPLITS + split
            has = l_i > 0
            tl.store(
                acc_ptr + out_idx[:, None] * D + dd[None, :],
                acc / tl.where(has, l_i, 1.0)[:, None],
                mask=gmask[:, None],
            )
            tl.store(
                lse_ptr + out_idx,
                tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")),
                mask=gmask,
            )

    @triton.jit
    def _gate_up_silu_kernel(
        h_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        # out[m, n] = silu(h[m] . w[n]) * (h[m] . w[N + n]): the gate and up rows of one column block share
        # the activation tile, and the product never leaves the program
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mmask = rm < M
        nmask = rn < N
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            kmask = kk < K
            a = tl.load(
                h_ptr + rm[:, None] * K + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
            )
            wmask = nmask[:, None] & kmask[None, :]
            wg = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            wu = tl.load(w_ptr + (N + rn)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc_g += tl.dot(a, tl.trans(wg))
            acc_u += tl.dot(a, tl.trans(wu))
        dtype = out_ptr.dtype.element_ty  # (not a loop variable: compiled Triton scopes those to the loop)
        # as the unfused step rounds: gate and up to the model dtype (the GEMM's output), then _silu_mul_kernel
        gate = acc_g.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = (act.to(tl.float32) * acc_u.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], out, mask=mmask[:, None] & nmask[None, :])


# ---------------------------------------------------------------------------------------------------
# Dispatch


def _failed(name: str, err: Exception) -> None:
    log.warning("fused kernel %s unavailable (%s); the unfused kernels serve", name, err)
    _FAILED[name] = err


def rope_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    starts: torch.Tensor,
    layout: HeadLayout,
    cache: tuple[torch.Tensor, torch.Tensor],
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: q/k rotary (and norms), k/v stored at slot starts + positions, attention over
    the row's positions + 1 live keys; returns (B, H, D). See `rope_attention_reference`."""
    k_cache, v_cache = cache
    if not triton_enabled(qkv) or "rope_attention" in _FAILED:
        if not triton_enabled(qkv):
            res = rope_attention_reference(qkv, positions, starts, layout, cache, norms)
            return out.copy_(res) if out is not None else res
        q = kernels.rope_store(qkv, positions, starts + positions, layout, k_cache, v_cache, norms)
        return kernels.decode_attention(
            q, k_cache, v_cache, starts, positions + 1, 1.0 / math.sqrt(layout.head_dim), splits, out
        )
    b, heads, kv_heads, d = qkv.shape[0], layout.heads, layout.kv_heads, layout.head_dim
    group = heads // kv_heads
    res = out if out is not None else qkv.new_empty((b, heads, d))
    if splits > 1:
        acc = torch.empty((b, heads, splits, d), dtype=torch.float32, device=qkv.device)
        lse = torch.empty((b, heads, splits), dtype=torch.float32, device=qkv.device)
    else:
        acc = lse = res  # unread with one split
    q_norm, k_norm = (
        norms if norms is not None else (layout.inv_freq, layout.inv_freq)
    )  # unread without norms
    try:
        _rope_attention_kernel[(b, kv_heads, splits)](
            qkv,
            positions,
            starts,
            layout.inv_freq,
            q_norm,
            k_norm,
            k_cache,
            v_cache,
            res,
            acc,
            lse,
            1.0 / math.sqrt(d),
            layout.rope_scale,
            layout.eps,
            HEADS=heads,
            KV_HEADS=kv_heads,
            D=d,
            GROUP=group,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_N=kernels._ATTENTION_BLOCK_N,
            SPLITS=splits,
            QK_NORM=norms is not None,
        )
    except Exception as err:  # noqa: BLE001 - a compiler that rejects it: the unfused kernels compute the same
        _failed("rope_attention", err)
        return rope_attention(qkv, positions, starts, layout, cache, norms, splits, out)
    if splits > 1:
        kernels._decode_attention_combine_kernel[(b * heads,)](acc, lse, res, D=d, SPLITS=splits)
    return res


def gate_up_silu(h: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection of h (B, hidden): (B, intermediate); for the decode step's
    small B (the whole batch is one or two row blocks). See `gate_up_silu_reference`."""
    if not triton_enabled(h) or "gate_up_silu" in _FAILED:
        if not triton_enabled(h):
            res = gate_up_silu_reference(h, w_gate_up)
            return out.copy_(res) if out is not None else res
        return kernels.silu_mul(torch.nn.functional.linear(h, w_gate_up), out)
    m, k = h.shape
    n = w_gate_up.shape[0] // 2
    res = out if out is not None else h.new_empty((m, n))
    # 64 x 32 output tiles: 152 programs for a 4,864-wide MLP at batch 64, two resident per SM (3 stages of
    # 64 + 2 x 32 rows of 128 columns: 96 KB of shared memory each), so one wave streams the weights
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 32, 128
    try:
        _gate_up_silu_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
            h,
            w_gate_up,
            res,
            m,
            n,
            k,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=8 if block_m > 64 else 4,
            num_stages=3,
        )
    except Exception as err:  # noqa: BLE001 - see rope_attention
        _failed("gate_up_silu", err)
        return gate_up_silu(h, w_gate_up, out)
    return res
