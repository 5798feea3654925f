"""sleuth's own decode engine for Llama-family decoders (Llama, Qwen2, Qwen3): a bf16 inference copy of
the policy, a ragged KV pool that follows the tokens each row asked for, and one CUDA graph per batch
bucket for the whole decode step (layers, attention over live keys, sampling and log-probs).

Why not the transformers model with a static cache: on an H100 that path decoded a Qwen2.5-0.5B shape at
batch 64 at 7% of the memory-bandwidth bound (bench/rollout.py): attention read the whole static bucket
rather than each row's live keys, a mask/rotary kernel per layer and full-vocabulary sampling outside the
graph took most of the step, and every new (batch, length) shape cost a 20-70 s compile. Here:
- the weights are copied once per policy update (`refresh`), gathering FSDP2 shards layer by layer and
  merging LoRA adapters, so sharded and LoRA policies decode like a plain bf16 model;
- row b's keys live in slots `start[b] .. start[b] + len(prompt) + max_new` of one pool per layer, so the
  pool is the sum of the rows' needs, attention reads only live slots, and finished rows leave the batch
  (a smaller graph takes over) without moving any key or value;
- the step is captured once per batch bucket (powers of two): no compiler, capture takes well under a
  second, and the length of the rows does not change the graph.
Prefill runs eagerly (large matrix products; SDPA with a causal mask over right-padded rows).

The arithmetic follows transformers' modules (RMSNorm in fp32 rounded to the model dtype, rotary in the
model dtype, residual adds in the model dtype); greedy decoding equals transformers' on CPU in fp32
(tests/test_decode_engine.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sleuth.errors import ConfigError
from sleuth.llm import fused_kernels, kernels
from sleuth.llm.decoding import select_next_tokens
from sleuth.llm.policy_weights import SUPPORTED_MODEL_TYPES, base_model, full_tensor, linear_weight, supports
from sleuth.llm.prefix_cache import (
    PrefixStore,
    attend_over_prefix,
    move_prefixes,
    prefill_chunks,
    prefix_attention_index,
)

log = logging.getLogger(__name__)
__all__ = ["SUPPORTED_MODEL_TYPES", "DecodeEngine", "DecodeState", "PolicyEngines", "supports"]

_SEED_STRIDE = 1_000_003  # advances the Philox seed between steps: each step draws a fresh stream


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class _Bucket:
    """Static buffers and the captured step of one batch size."""

    size: int
    tokens: torch.Tensor
    positions: torch.Tensor  # int32: this step writes its key/value at start + position
    starts: torch.Tensor  # int32
    logprobs: torch.Tensor
    # captured steps by (temperature, sampled inside, attention splits); None: the capture failed, decode eagerly
    graphs: dict[tuple, Any] = field(default_factory=dict)
    logits: torch.Tensor | None = None


@dataclass
class DecodeState:
    """The rows of one `DecodeEngine.start` call still being decoded, in their batch order."""

    rows: list[int]  # caller's row index of each live batch slot
    bucket: _Bucket
    temperature: float
    top_p: float
    generator: torch.Generator | None
    max_len: int = (
        0  # keys of its longest row at the end (prompt + max_new): what the attention splits follow
    )
    splits: int = (
        1  # attention splits of the captured step (its grid is fixed; a smaller bucket may change it)
    )

    @property
    def graph_key(self) -> tuple:
        return (self.temperature, self.samples_inside, self.splits)

    @property
    def samples_inside(self) -> bool:
        """Whether the captured step samples (Gumbel-max, full vocabulary, the engine's seed); else it stops at
        the logits and `select_next_tokens` samples outside (top_p < 1, or the caller's torch generator)."""
        return samples_inside(self.top_p, self.generator)


def samples_inside(top_p: float, generator: torch.Generator | None) -> bool:
    return top_p >= 1.0 and generator is None


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


class DecodeEngine:
    """Batched decoding of a Llama-family model from a bf16 (or fp32 on CPU) copy of its weights.

    `start(prompts, max_new, ...)` prefills and samples each row's first token; `steps(state, k)` runs k
    more decode steps on the device and returns the sampled (tokens, log-probs) of the live rows, shape
    (rows, k), still on the device; `keep(state, rows)` drops finished rows. `refresh(model)` re-reads the
    weights after a policy update (a collective under FSDP2: every rank calls it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 256,
        use_graphs: bool | None = None,
        prefill_tokens: int = 16384,
        min_bucket: int = 8,
    ) -> None:
        why = supports(model)
        if why is not None:
            raise ConfigError(
                f"the decode engine cannot decode this model: {why}; use model.generation_cache=static"
            )
        base = base_model(model)
        config = base.config
        self.device = torch.device(device) if device is not None else next(base.parameters()).device
        # a CPU decodes in the model's own dtype: float32, or bf16 where `sleuth.llm.hf.cpu_dtype` loaded it so
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else _floating_dtype(base))
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.hidden = int(config.hidden_size)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.vocab = int(config.vocab_size)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        rotary = base.model.rotary_emb
        inv_freq = rotary.inv_freq.detach().to(self.device, torch.float32).clone()
        self.layout = kernels.HeadLayout(
            self.heads, self.kv_heads, inv_freq, float(getattr(rotary, "attention_scaling", 1.0)), self.eps
        )
        self.max_batch_size = max_batch_size
        self.min_bucket = min(min_bucket, max_batch_size)
        self.prefill_tokens = prefill_tokens
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        # eager steps (a CPU): nothing runs ahead of the host and a finished row costs a live one's step, so a
        # caller steps one token at a time and drops each finished row at once (`HFGenerator._decode_engine`)
        self.step_by_step = not self.use_graphs
        self.layers: list[_Layer] = []
        self.embed = self.final_norm = self.lm_head = None
        self.prefixes = PrefixStore()  # rows of the last decode whose keys/values a next turn can reuse
        self._last_starts: list[int] = []
        self.reused_tokens = (
            0  # prompt tokens not prefilled again thanks to `prefixes` (bench/rollout.py reports it)
        )
        self.reuse_prefixes = (
            True  # False: every prompt is prefilled whole (bench/rollout.py --no-prefix-reuse)
        )
        self.refresh(model)
        self.pool_k: torch.Tensor | None = None  # (layers, slots, kv_heads, head_dim)
        self.pool_v: torch.Tensor | None = None
        self._buckets: dict[int, _Bucket] = {}
        self._graph_pool: Any = None
        self._pool_high_water = 0
        self.graph_failures = 0  # captures that failed: those batches decoded eagerly (slow), see the log
        self._seed = torch.zeros(1, dtype=torch.int64, device=self.device)
        # the fused decode kernels (fused_kernels.py; SLEUTH_FUSED_DECODE / SLEUTH_FUSED_MLP): where Triton runs
        self.fused_attention = fused_kernels.FUSED_DECODE
        self.fused_mlp = fused_kernels.FUSED_MLP
        self._multiprocessors = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 132
        )
        self.splits_used: dict[
            int, int
        ] = {}  # attention splits -> decodes (and batch changes) that chose them
        self.capture_seconds = 0.0
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self._tensors())

    # -- weights ---------------------------------------------------------------------------------

    def _tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out

    def _put(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        new = new.to(self.device, self.dtype)
        if old is None:
            return new.contiguous().clone()
        old.copy_(new)  # in place: captured graphs keep reading the same memory
        return old

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module, merge_adapters: bool = True) -> None:
        """Copy the model's current weights in (LoRA merged unless `merge_adapters` is False; FSDP2 shards
        gathered one matrix at a time, so the extra memory is one layer's weights)."""
        self.prefixes.clear()  # keys/values computed by the old weights
        base = base_model(model)
        inner = base.model
        first = not self.layers
        for i, block in enumerate(inner.layers):
            attn, mlp = block.self_attn, block.mlp
            qkv = [linear_weight(getattr(attn, n), merge_adapters) for n in ("q_proj", "k_proj", "v_proj")]
            w_qkv = torch.cat([w.float() for w, _ in qkv])
            b_qkv = torch.cat([b.float() for _, b in qkv]) if qkv[0][1] is not None else None
            gate, _ = linear_weight(mlp.gate_proj, merge_adapters)
            up, _ = linear_weight(mlp.up_proj, merge_adapters)
            old = None if first else self.layers[i]
            layer = _Layer(
                ln1=self._put(old and old.ln1, full_tensor(block.input_layernorm.weight.detach())),
                ln2=self._put(old and old.ln2, full_tensor(block.post_attention_layernorm.weight.detach())),
                w_qkv=self._put(old and old.w_qkv, w_qkv),
                b_qkv=self._put(old and old.b_qkv, b_qkv) if b_qkv is not None else None,
                w_o=self._put(old and old.w_o, linear_weight(attn.o_proj, merge_adapters)[0]),
                w_gate_up=self._put(old and old.w_gate_up, torch.cat([gate.float(), up.float()])),
                w_down=self._put(old and old.w_down, linear_weight(mlp.down_proj, merge_adapters)[0]),
            )
            if hasattr(attn, "q_norm"):
                layer.q_norm = self._put(old and old.q_norm, full_tensor(attn.q_norm.weight.detach()))
                layer.k_norm = self._put(old and old.k_norm, full_tensor(attn.k_norm.weight.detach()))
            if first:
                self.layers.append(layer)
            del qkv, w_qkv, gate, up
        self.embed = self._put(self.embed, full_tensor(inner.embed_tokens.weight.detach()))
        self.final_norm = self._put(self.final_norm, full_tensor(inner.norm.weight.detach()))
        tied = base.lm_head.weight is inner.embed_tokens.weight or getattr(
            base.config, "tie_word_embeddings", False
        )
        if tied:
            self.lm_head = self.embed
        else:
            self.lm_head = self._put(
                None if first else self.lm_head, linear_weight(base.lm_head, merge_adapters)[0]
            )

    # -- KV pool ---------------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        return (
            2
            * len(self.layers)
            * self.kv_heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )

    def _ensure_pool(self, slots: int) -> bool:
        """A pool of at least `slots`; True when the stored prefixes were lost on the way."""
        if self.pool_k is not None and self.pool_k.shape[1] >= slots:
            return False
        if self.pool_k is not None:  # each growth drops the captured graphs: grow with a margin
            slots = max(slots, int(1.25 * self.pool_k.shape[1]))
        # after a release, start at the size the last rollout reached: a rollout's later turns need more slots
        # than its first, and growing mid-rollout recaptures the graphs (so only the first rollout grows)
        slots = max(slots, self._pool_high_water)
        self._pool_high_water = slots
        old = (self.pool_k, self.pool_v) if self.prefixes else None  # a grown pool keeps the stored rows
        self.pool_k = self.pool_v = None
        self._drop_graphs()  # graphs hold the old pool's addresses
        shape = (len(self.layers), slots, self.kv_heads, self.head_dim)
        try:
            self.pool_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.pool_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError:
            if old is None:
                raise
            old = self.pool_k = self.pool_v = None  # both pools do not fit at once: the new one alone must
            self.pool_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.pool_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if old is not None:
            self.pool_k[:, : old[0].shape[1]] = old[0]
            self.pool_v[:, : old[1].shape[1]] = old[1]
        else:
            self.prefixes.clear()
        log.info(
            "decode engine: KV pool of %d slots (%.2f GiB)",
            slots,
            2 * self.pool_k.numel() * self.pool_k.element_size() / 2**30,
        )
        return old is None

    def _drop_graphs(self) -> None:
        # The graphs' private memory pool goes with its last graph: a capture into the handle of a freed pool
        # fails inside the caching allocator ("use_count > 0"), so the handle is dropped with the graphs.
        self._buckets.clear()
        self._graph_pool = None

    def release(self, weights: bool = False) -> None:
        """Free the KV pool and the captured graphs; with `weights`, the bf16 copy too (the next `refresh`
        builds it again: the trainer refreshes after every update anyway, and the update needs the memory)."""
        self.pool_k = self.pool_v = None
        self.prefixes.clear()
        self._drop_graphs()
        if weights:
            self.layers = []
            self.embed = self.final_norm = self.lm_head = None

    @property
    def has_weights(self) -> bool:
        return bool(self.layers)

    # -- the decode step ---------------------------------------------------------------------------

    def _forward_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor, splits: int = 1
    ) -> torch.Tensor:
        """Logits (B, V) of one token per row; stores its key and value. Per layer: norm, qkv product,
        attention (rotary + store + attention fused into one kernel unless SLEUTH_FUSED_DECODE=0), output
        product, norm, gate/up product, SiLU gate (fused into the gate/up product with SLEUTH_FUSED_MLP=1),
        down product."""
        b = tokens.shape[0]
        fused_attention = self.fused_attention and kernels.triton_enabled(tokens)
        fused_mlp = self.fused_mlp and kernels.triton_enabled(tokens)
        if not fused_attention:
            slots = starts + positions
            lengths = positions + 1
        # the reference path (a CPU) rotates every layer at the same positions: the tables once a step, not per layer
        rotary = None if kernels.triton_enabled(tokens) else self._rotary(positions)
        x = self.embed.index_select(0, tokens)
        delta = None
        for i, layer in enumerate(self.layers):
            x, h = kernels.add_rmsnorm(x, delta, layer.ln1, self.eps)
            qkv = F.linear(h, layer.w_qkv, layer.b_qkv)
            norms = (layer.q_norm, layer.k_norm) if layer.q_norm is not None else None
            if fused_attention:
                a = fused_kernels.rope_attention(
                    qkv, positions, starts, self.layout, (self.pool_k[i], self.pool_v[i]), norms, splits
                )
            else:
                q = self._rope_store(qkv, positions, slots, i, norms, rotary)
                a = kernels.decode_attention(
                    q, self.pool_k[i], self.pool_v[i], starts, lengths, self.scale, splits
                )
            x, h = kernels.add_rmsnorm(x, F.linear(a.view(b, -1), layer.w_o), layer.ln2, self.eps)
            if fused_mlp:
                act = fused_kernels.gate_up_silu(h, layer.w_gate_up)
            else:
                act = kernels.silu_mul(F.linear(h, layer.w_gate_up))
            delta = F.linear(act, layer.w_down)
        _, h = kernels.add_rmsnorm(x, delta, self.final_norm, self.eps)
        return F.linear(h, self.lm_head)

    def _rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        layer: int,
        norms: tuple[torch.Tensor, torch.Tensor] | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """`kernels.rope_store` into layer `layer`'s pool; with `rotary` (the reference path) its tables."""
        pools = (self.pool_k[layer], self.pool_v[layer])
        if rotary is None:
            return kernels.rope_store(qkv, positions, slots, self.layout, *pools, norms)
        return kernels.rope_store_reference(qkv, positions, slots, self.layout, *pools, norms, rotary)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin) tables of `positions` in the model's dtype, as `kernels.rope_store_reference` makes
        them (the same tables, computed once instead of once per layer)."""
        return kernels.rotary_tables(positions, self.layout, self.dtype)

    def _splits(self, batch: int, max_len: int) -> int:
        """Attention splits for a decode of `batch` rows of at most `max_len` keys (fixed while it runs: the
        captured step's grid cannot change)."""
        if self.device.type != "cuda":
            splits = fused_kernels.ATTENTION_SPLITS or 1
        elif self.fused_attention:
            splits = fused_kernels.attention_splits(batch, self.kv_heads, max_len, self._multiprocessors)
        else:
            splits = kernels.attention_splits(batch, self.kv_heads)
        self.splits_used[splits] = self.splits_used.get(splits, 0) + 1
        return splits

    def _step(self, bucket: _Bucket, state: DecodeState) -> None:
        logits = self._forward_step(bucket.tokens, bucket.positions, bucket.starts, state.splits)
        if state.samples_inside:
            kernels.sample(logits, state.temperature, self._seed, bucket.tokens, bucket.logprobs)
            self._seed.add_(_SEED_STRIDE)
        elif bucket.logits is None:
            bucket.logits = logits
        else:
            bucket.logits.copy_(logits)
        bucket.positions.add_(1)

    def _bucket(self, live: int) -> _Bucket:
        if self.use_graphs:  # few sizes, each captured once
            size = max(self.min_bucket, 1 << max(0, live - 1).bit_length())
            size = min(size, max(self.max_batch_size, live))
        else:  # eager steps (a CPU): a padding row would cost as much as a live one
            size = live
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = _Bucket(
                size=size,
                tokens=torch.zeros(size, dtype=torch.long, device=self.device),
                positions=torch.zeros(size, dtype=torch.int32, device=self.device),
                starts=torch.zeros(size, dtype=torch.int32, device=self.device),
                logprobs=torch.zeros(size, dtype=torch.float32, device=self.device),
            )
            self._buckets[size] = bucket
        return bucket

    def _capture(self, bucket: _Bucket, state: DecodeState) -> None:
        key = state.graph_key
        if not self.use_graphs or key in bucket.graphs:
            return
        started = time.perf_counter()
        scratch = self.pool_k.shape[1] - self._scratch
        bucket.starts.fill_(scratch)  # the warm-up writes only into the scratch slots
        bucket.positions.zero_()
        bucket.tokens.zero_()
        seed = self._seed.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels and settles cuBLAS workspaces
                bucket.positions.zero_()
                self._step(bucket, state)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        bucket.positions.zero_()
        try:
            # the buckets' graphs share the first one's memory pool (they never replay at the same time)
            with torch.cuda.graph(graph, pool=self._graph_pool):
                self._step(bucket, state)
        except RuntimeError as err:  # decode eagerly (slower, same tokens) rather than fail the rollout
            log.warning(
                "decode engine: CUDA graph capture failed (%s); decoding batch %d eagerly", err, bucket.size
            )
            self._seed.copy_(seed)
            bucket.graphs[key] = None
            self.graph_failures += 1
            self._graph_pool = None  # a failed capture may leave the shared pool unusable for the next bucket
            return
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        self._seed.copy_(seed)
        bucket.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        log.info(
            "decode engine: captured the step for batch %d (%d attention splits) in %.2f s",
            bucket.size,
            state.splits,
            seconds,
        )

    def _load_rows(
        self, bucket: _Bucket, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor
    ) -> None:
        n = tokens.shape[0]
        bucket.tokens[:n] = tokens
        bucket.positions[:n] = positions
        bucket.starts[:n] = starts
        if n < bucket.size:  # padding rows decode into the scratch slots
            bucket.tokens[n:] = 0
            bucket.positions[n:] = 0
            bucket.starts[n:] = self.pool_k.shape[1] - self._scratch

    # -- prefill -----------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], starts: list[int], offsets: list[int]) -> torch.Tensor:
        """Run the prompts' tokens (causal), store their keys/values; logits of each last token. Row r's first
        `offsets[r]` tokens are already in the pool (a reused prefix): `prompts[r]` holds only the tokens after
        them, at positions from offsets[r] on, and attends over the stored ones too.

        The tokens run packed, one row of activations per real token, through the decode step's fused kernels
        (norms, rotary + store, SiLU); only attention sees them padded to (rows, width), to attend over each row's
        keys in the pool. An eager prefill is bound by its kernel launches, and these cut them ~3x."""
        lengths = [len(p) for p in prompts]
        b, width = len(prompts), max(lengths)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long).to(self.device)
        positions = torch.tensor(
            [o + c for o, n in zip(offsets, lengths, strict=True) for c in range(n)], dtype=torch.int32
        ).to(self.device)
        slots = torch.tensor(
            [st + o + c for st, o, n in zip(starts, offsets, lengths, strict=True) for c in range(n)],
            dtype=torch.int32,
        ).to(self.device)
        # where each packed token sits in the padded (rows x width) layout, and each row's last token
        padded = torch.tensor(
            [r * width + c for r, n in enumerate(lengths) for c in range(n)], device=self.device
        )
        last = torch.tensor(lengths).cumsum(0).sub_(1).to(self.device)
        key_slots, mask = prefix_attention_index(starts, offsets, lengths, width, self.device)
        rotary = None if kernels.triton_enabled(ids) else self._rotary(positions)  # shared by the layers
        x = self.embed.index_select(0, ids)
        delta = None
        for i, layer in enumerate(self.layers):
            x, h = kernels.add_rmsnorm(x, delta, layer.ln1, self.eps)
            qkv = F.linear(h, layer.w_qkv, layer.b_qkv)
            norms = (layer.q_norm, layer.k_norm) if layer.q_norm is not None else None
            q = self._rope_store(qkv, positions, slots, i, norms, rotary)
            q = q.new_zeros((b * width, self.heads, self.head_dim)).index_copy_(0, padded, q)
            a = attend_over_prefix(
                q.view(b, width, self.heads, self.head_dim),
                self.pool_k[i],
                self.pool_v[i],
                key_slots,
                mask,
                self.scale,
            )
            a = a.reshape(b * width, self.heads * self.head_dim).index_select(0, padded)
            x, h = kernels.add_rmsnorm(x, F.linear(a, layer.w_o), layer.ln2, self.eps)
            delta = F.linear(kernels.silu_mul(F.linear(h, layer.w_gate_up)), layer.w_down)
        _, h = kernels.add_rmsnorm(
            x.index_select(0, last), delta.index_select(0, last), self.final_norm, self.eps
        )
        return F.linear(h, self.lm_head)

    # -- public API ---------------------------------------------------------------------------------

    @torch.no_grad()
    def start(
        self,
        prompts: list[list[int]],
        max_new: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[DecodeState, torch.Tensor, torch.Tensor]:
        """Prefill the prompts and sample each one's first token: (state, tokens (B,), log-probs (B,)). A prompt
        that continues a row `remember`ed after the last decode prefills only its new tokens."""
        if not prompts or len(prompts) > self.max_batch_size:
            raise ConfigError(f"the decode engine takes 1..{self.max_batch_size} prompts, got {len(prompts)}")
        if not self.has_weights:
            raise RuntimeError(
                "decode engine: its weights were released; call refresh(model) before decoding"
            )
        self._scratch = max_new + 2
        reuse = self.reuse_prefixes and self.prefixes
        found = [self.prefixes.match(p) for p in prompts] if reuse else [None] * len(prompts)
        held = self.prefixes.rows()  # rows kept for forks (hold mode), placed behind this start's rows
        need = [len(p) + max_new + 1 for p in prompts]
        if self._ensure_pool(sum(need) + sum(len(seq) - 1 for seq, _ in held) + self._scratch):
            found, held = [None] * len(prompts), []  # a new pool: the stored keys/values are gone
        starts = [0]
        for n in (need + [len(seq) - 1 for seq, _ in held])[:-1]:  # held rows go behind the new ones
            starts.append(starts[-1] + n)
        starts, held_starts = starts[: len(prompts)], starts[len(prompts) :]
        offsets = [0 if f is None else f.tokens for f in found]
        move_prefixes(
            self.pool_k,
            self.pool_v,
            [(f.start, st, f.tokens) for f, st in zip(found, starts, strict=True) if f is not None]
            + [(old, new, len(seq) - 1) for (seq, old), new in zip(held, held_starts, strict=True)],
        )
        self.prefixes.clear()  # this layout reassigns the slots; `remember` records the rows after the decode
        self.prefixes.remember([list(seq) for seq, _ in held], held_starts)
        self._last_starts = starts
        self.reused_tokens += sum(offsets)
        if seed is not None:
            self._seed.fill_(int(seed))
        elif generator is None:  # drawn on the host: the CUDA generator's state must not move outside capture
            self._seed.fill_(int(torch.randint(0, 2**31, (1,)).item()))
        logits_rows = []
        for chunk in prefill_chunks([len(p) for p in prompts], offsets, self.prefill_tokens):
            logits_rows.append(
                (
                    chunk,
                    self._prefill(
                        [prompts[i][offsets[i] :] for i in chunk],
                        [starts[i] for i in chunk],
                        [offsets[i] for i in chunk],
                    ),
                )
            )
        logits = torch.empty((len(prompts), self.vocab), dtype=self.dtype, device=self.device)
        for rows, lg in logits_rows:
            logits[torch.tensor(rows, device=self.device)] = lg.to(self.dtype)
        tokens, logprobs = self._sample_eager(logits, temperature, top_p, generator)
        bucket = self._bucket(len(prompts))
        state = DecodeState(
            rows=list(range(len(prompts))),
            bucket=bucket,
            temperature=temperature,
            top_p=top_p,
            generator=generator,
            max_len=max(len(p) for p in prompts) + max_new,
        )
        state.splits = self._splits(bucket.size, state.max_len)
        positions = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=self.device)
        self._capture(bucket, state)
        self._load_rows(
            bucket, tokens, positions, torch.tensor(starts, dtype=torch.int32, device=self.device)
        )
        return state, tokens, logprobs

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Within it, every remembered row stays in the pool across later starts and a prompt reuses the longest
        prefix it shares with any of them (`PrefixStore.hold`): a trajectory forked at an earlier turn boundary
        continues from its parent's keys/values instead of prefilling them again. They are dropped at the end."""
        self.prefixes.clear()  # rows remembered outside the hold would be matched as whole prefixes only
        self.prefixes.hold = True
        try:
            yield
        finally:
            self.prefixes.hold = False
            self.prefixes.clear()

    def remember(self, sequences: list[list[int]]) -> None:
        """After decoding the rows of the last `start`: row i's prompt and every token it generated, so a
        later prompt that continues it (the agent's next turn) reuses its keys/values."""
        if self.reuse_prefixes:  # else nothing would ever be matched: skip building the index
            self.prefixes.remember(sequences, self._last_starts)

    def _sample_eager(
        self, logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if samples_inside(top_p, generator):
            tokens, logprobs = kernels.sample(logits, temperature, self._seed)
            self._seed.add_(_SEED_STRIDE)
            return tokens, logprobs
        return select_next_tokens(logits.float(), temperature=temperature, top_p=top_p, generator=generator)

    @torch.no_grad()
    def steps(self, state: DecodeState, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k decode steps for the live rows: (tokens, log-probs), each (live rows, k), on the device."""
        bucket, n, inside = state.bucket, len(state.rows), state.samples_inside
        tokens = torch.empty((n, k), dtype=torch.long, device=self.device)
        logprobs = torch.empty((n, k), dtype=torch.float32, device=self.device)
        graph = bucket.graphs.get(state.graph_key)
        for t in range(k):
            if graph is not None:
                graph.replay()
            else:
                self._step(bucket, state)
            if not inside:
                tok, lp = self._sample_eager(
                    bucket.logits[:n], state.temperature, state.top_p, state.generator
                )
                bucket.tokens[:n] = tok
                bucket.logprobs[:n] = lp
            tokens[:, t] = bucket.tokens[:n]
            logprobs[:, t] = bucket.logprobs[:n]
        return tokens, logprobs

    @torch.no_grad()
    def keep(self, state: DecodeState, live: list[int]) -> None:
        """Continue with only these batch slots (indices into `state.rows`, in order); moves to a smaller
        graph when the live rows fit one. No key or value moves."""
        if len(live) == len(state.rows):
            return
        if not live:
            state.rows = []
            return
        old = state.bucket
        idx = torch.tensor(live, device=self.device)
        tokens, positions, starts = (
            old.tokens[idx].clone(),
            old.positions[idx].clone(),
            old.starts[idx].clone(),
        )
        state.rows = [state.rows[i] for i in live]
        bucket = self._bucket(len(live))
        if bucket is not old:
            state.splits = self._splits(bucket.size, state.max_len)
            self._capture(bucket, state)
        self._load_rows(bucket, tokens, positions, starts)
        state.bucket = bucket


class PolicyEngines:
    """The decode engines of one generator: a LoRA policy and its adapter-disabled base (a frozen generator)
    get one each, built from the weights on first use, the first with the adapters merged."""

    def __init__(self) -> None:
        self._engines: dict[bool, DecodeEngine] = {}

    def get(
        self, model: torch.nn.Module, base_only: bool, device: torch.device, max_batch_size: int
    ) -> DecodeEngine:
        engine = self._engines.get(base_only)
        if engine is None:
            engine = DecodeEngine(model, device=device, max_batch_size=max_batch_size)
            self._engines[base_only] = engine
        elif not engine.has_weights:  # released without a refresh since (the trainer refreshes after updates)
            engine.refresh(model)
        return engine

    def refresh(self, model: torch.nn.Module) -> None:
        """After an update: the policy's copy is read again; the adapter-free base of a LoRA policy does not
        change."""
        engine = self._engines.get(False)
        if engine is not None:
            engine.refresh(model)

    def release(self) -> None:
        """KV pools and graphs go, and the policy's bf16 copy, which `refresh` rebuilds after the update (at 7B
        that copy is 15 GB on every rank, which the update needs); the frozen base's copy stays."""
        for base_only, engine in self._engines.items():
            engine.release(weights=not base_only)
        if any(e.device.type == "cuda" for e in self._engines.values()):
            torch.cuda.empty_cache()

    @property
    def graph_failures(self) -> int:
        return sum(e.graph_failures for e in self._engines.values())

    @property
    def capture_seconds(self) -> float:
        return sum(e.capture_seconds for e in self._engines.values())
