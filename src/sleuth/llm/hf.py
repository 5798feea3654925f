"""A transformers-backed `Generator` with a hand-written batched decode loop.

Why not `model.generate`: the agent engine needs per-sequence stop strings (one sequence stops at
`</search>` while the others keep going), the exact sampled token ids and their log-probs, and
token-id prompts; a small explicit loop gives all three and lets finished rows leave the batch.

Decoding:
- prompts are left-padded; the attention mask hides pads and position ids count only real tokens,
  so a padded row computes the same logits as the prompt alone;
- "dynamic" cache (default on CPU): rows that finished are dropped from the batch and the KV cache;
- "engine" (default on CUDA for Llama/Qwen models): sleuth's decode engine (`decode_engine.py`);
- "static" cache: a preallocated `StaticCache` with fixed shapes, optionally with the decode step compiled
  (`compile=True`, CUDA graphs); finished rows keep their slot but their tokens are ignored.
The device runs `sync_every` steps between two reads of the sampled tokens; the host checks stops for one
chunk while the next computes (exactly step-by-step's result).

Log-probs are `log_softmax(logits / temperature)` at the sampled id (`log_softmax(logits)` when greedy):
what a trainer recomputes from the same logits. With top_p < 1 the token was drawn from the renormalised
nucleus, whose log-prob differs; trainers use the untruncated value, so that is what we return.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sleuth.errors import ConfigError
from sleuth.llm.attention import use_grouped_decode_attention
from sleuth.llm.base import Generation, Prompt, SamplingParams
from sleuth.llm.decode_engine import DecodeEngine, PolicyEngines
from sleuth.llm.decode_engine import supports as engine_supports
from sleuth.llm.decoding import left_pad, positions_from_mask, select_next_tokens
from sleuth.llm.gguf import ensure_converted
from sleuth.llm.special_tokens import disable_bpe_cleanup
from sleuth.llm.stops import StopEndTokens, first_stop_in, normalise_stops, stop_tails, stop_window

log = logging.getLogger(__name__)

# Compiled shapes are bucketed so that a handful of graphs serve every batch.
_STATIC_LEN_BUCKET = 256
_DEFAULT_BATCH = 64  # rows decoded together unless `max_batch_size` says otherwise
# The decode engine decodes a generate call's rows (an evaluation batch: 128 rows at most; a training step's rows, as
# sleuth.rl.run asks) as one batch. Its prefix store holds the rows of the last batch only: with batches of 64, a
# turn's first batch reassigned the pool's slots, so its second batch found none of its rows' keys, and the first
# found only rows that had been in the previous turn's second batch (rows sorted by length mostly stay in theirs): at
# 100 questions nearly every turn prefilled every row's whole context again (measured on a CPU; on a GPU the same
# evaluation re-encoded the rows of every later turn too). On a CPU a row costs the same in one batch or two (eager
# steps, no padding rows); the pool holds every row's keys at once (~1.6x the pool of 64 rows: ~3 GB for 100 rows of
# SmolLM2 on a CPU; on a GPU the KV pool follows the rows' tokens, as for the training step's 256).
_ENGINE_BATCH = 256


# ---------------------------------------------------------------------------------------------------


@dataclass
class _Row:
    """Decode state of one sequence."""

    index: int  # position in the caller's batch
    prompt_ids: list[int]
    stops: list[str]
    window: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop: str | None = None


def _is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(t, numbers.Integral) for t in prompt)
    )


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def auto_cache(device: torch.device, model: Any, compile: bool = False) -> str:
    """cache="auto": sleuth's decode engine on CUDA where it supports the model (as the trainer's rollouts),
    else (or to compile) a static cache; on a CPU HF's dynamic cache, or the engine inside `cpu_cache("engine")`
    where it supports the model."""
    if device.type != "cuda":
        engine = _AUTO_ON_CPU["cache"] == "engine" and not compile and engine_supports(model) is None
        return "engine" if engine else "dynamic"
    return "engine" if not compile and engine_supports(model) is None else "static"


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# What "auto" means on a CPU while `cpu_dtype` ("dtype") and `cpu_cache` ("cache") are in effect (None: float32,
# the dynamic cache)
_AUTO_ON_CPU: dict[str, Any] = {"dtype": None, "cache": None}


@contextlib.contextmanager
def _auto_on_cpu(key: str, value: Any) -> Iterator[None]:
    """`_AUTO_ON_CPU[key]` set to `value` for the block, the previous value back on leaving (also on an error)."""
    before, _AUTO_ON_CPU[key] = _AUTO_ON_CPU[key], value
    try:
        yield
    finally:
        _AUTO_ON_CPU[key] = before


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products in hardware (AVX512-BF16 or AMX): there bf16 runs
    SmolLM2-135M ~2.6x faster than float32 (2 cores, 16 rows: prefill 9.6 -> 3.7 s, 64 decode steps 6.1 -> 2.3 s);
    elsewhere it is emulated and slower."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


@contextlib.contextmanager
def cpu_dtype(dtype: torch.dtype | str | None) -> Iterator[None]:
    """Models loaded with dtype "auto" on a CPU inside this block use `dtype` (None: float32, the default): an
    evaluation that should match a GPU run's bf16 arithmetic, as `sleuth reproduce --from-committed` does."""
    chosen = None if dtype is None else _resolve_dtype(dtype, torch.device("cpu"))
    with _auto_on_cpu("dtype", chosen):
        yield


@contextlib.contextmanager
def cpu_cache(kind: str | None) -> Iterator[None]:
    """Generators built with cache="auto" on a CPU inside this block decode with `kind`: "engine" is sleuth's decode
    engine (as a GPU run decodes), which keeps each row's keys and values across the turns of a rollout and prefills
    only a turn's new tokens, where the dynamic cache (None, the default) encodes every turn's whole context again."""
    if kind not in (None, "dynamic", "engine"):
        raise ConfigError(f"cpu_cache({kind!r}): use 'engine', 'dynamic' or None")
    with _auto_on_cpu("cache", kind):
        yield


def auto_cpu_dtype() -> torch.dtype | None:
    """The dtype `cpu_dtype` set for models loaded on a CPU, or None (float32)."""
    return _AUTO_ON_CPU["dtype"]


def _resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else (_AUTO_ON_CPU["dtype"] or torch.float32)
    if isinstance(dtype, torch.dtype):
        return dtype
    named = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in named:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(named)}")
    return named[dtype]


def _forward_param_names(model: Any) -> set[str]:
    """Parameter names of the underlying transformers model's forward (unwrapping PEFT and similar)."""
    seen = model
    for _ in range(4):
        names = set(inspect.signature(type(seen).forward).parameters)
        if "input_ids" in names and ("cache" in names or "past_key_values" in names):
            return names
        inner = seen.get_base_model() if hasattr(seen, "get_base_model") else getattr(seen, "model", None)
        if inner is None or inner is seen:
            break
        seen = inner
    return names


def _adapters_disabled(model: Any) -> bool:
    """Whether a PEFT model currently decodes with its adapters off (the frozen base of a LoRA policy)."""
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "disable_adapters"):
            return bool(module.disable_adapters)
    return False


class HFGenerator:
    """Batched generation with a transformers causal LM; implements the `Generator` protocol.

    `model_or_path` is a hub name, a local checkpoint directory, a `.gguf` file (converted once and
    cached, see `sleuth.llm.gguf`), or an already loaded model (then `tokenizer` is required and the
    model's current weights are used, e.g. the trainer's live policy). `source` says where such a model's
    weights came from (a checkpoint); evaluation records it so that stored predictions of one model are
    never resumed for another.
    """

    def __init__(
        self,
        model_or_path: Any,
        *,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: Any = None,
        gguf_file: str | None = None,
        max_batch_size: int | None = None,
        cache: str = "auto",
        compile: bool = False,
        attn_implementation: str | None = None,
        sync_every: int = 8,
        grouped_decode_attention: bool = False,
        source: str | None = None,
    ) -> None:
        if cache not in ("auto", "dynamic", "static", "engine"):
            raise ConfigError(f"cache={cache!r}: use 'dynamic', 'static', 'engine' or 'auto'")
        if sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1, got {sync_every}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")

        if isinstance(model_or_path, torch.nn.Module):
            if tokenizer is None:
                raise ConfigError("HFGenerator(model) with a loaded model also needs tokenizer=")
            self.model = model_or_path
            self.device = next(self.model.parameters()).device
            self.tokenizer = tokenizer
            name = getattr(getattr(model_or_path, "config", None), "_name_or_path", None) or "?"
            self.source = source or f"{type(model_or_path).__name__}({name})"
        else:
            self.device = torch.device(device) if device is not None else _default_device()
            self.model, self.tokenizer = self._load(
                str(model_or_path),
                tokenizer,
                gguf_file,
                _resolve_dtype(dtype, self.device),
                attn_implementation,
            )
            self.source = str(model_or_path)

        # one-token decode steps attend each key/value head once instead of a copy per query head
        # (sleuth.llm.attention); changes nothing else, and nothing where the model has no GQA
        self.grouped_decode_attention = grouped_decode_attention and use_grouped_decode_attention(self.model)
        self.cache_kind = cache if cache != "auto" else auto_cache(self.device, self.model, compile)
        self.compile = compile
        # see _ENGINE_BATCH: the engine takes a whole evaluation batch
        if max_batch_size is None:
            max_batch_size = _ENGINE_BATCH if self.cache_kind == "engine" else _DEFAULT_BATCH
        self.max_batch_size = max_batch_size
        if compile and self.cache_kind != "static":
            raise ConfigError("compile=True needs cache='static' (a dynamic cache changes shape every step)")
        self._param_names = _forward_param_names(self.model)
        self._cache_kw = "cache" if "cache" in self._param_names else "past_key_values"
        self._static_caches: dict[tuple[int, int], Any] = {}
        self._compiled_step: Any = None
        self._engines = PolicyEngines()
        # wall seconds of the engine's prefills (each ends when its first tokens reach the host, a wait the
        # decode loop needs anyway, so measuring adds no synchronisation)
        self.prefill_seconds = 0.0
        self.compile_seconds = 0.0  # one-time compiles of new decode shapes so far (a trainer logs it)
        self.sync_every = sync_every

        disable_bpe_cleanup(
            self.tokenizer
        )  # a no-op for BPE in transformers 5, but warned about at every decode
        self._stop_ends = StopEndTokens(self.tokenizer)
        self.pad_token_id = self._pick_pad_id()
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.eos_token_ids = self._collect_eos_ids()

    def _load(
        self, spec: str, tokenizer: Any, gguf_file: str | None, dtype: torch.dtype, attn: str | None
    ) -> tuple[Any, Any]:
        # deferred: transformers takes seconds to import; needed only once a model loads
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(spec).expanduser()
        if gguf_file is not None:
            path = path / gguf_file
        if path.suffix.lower() == ".gguf":
            path = ensure_converted(path)
        source = str(path) if path.exists() else spec
        kwargs: dict[str, Any] = {"dtype": dtype}
        if attn is not None:
            kwargs["attn_implementation"] = attn
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(source)
        except OSError as err:
            raise ConfigError(
                f"could not load model {spec!r}: not a local checkpoint directory and not loadable from the hub "
                f"({err}). Pass a directory with config.json, a .gguf file, or a model alias (see `sleuth models`)."
            ) from err
        model.to(self.device)
        model.eval()
        return model, tok

    def _pick_pad_id(self) -> int:
        tok = self.tokenizer
        for candidate in (
            tok.pad_token_id,
            tok.eos_token_id,
            getattr(self.model.config, "pad_token_id", None),
        ):
            if isinstance(candidate, int):
                return candidate
        return 0

    def _collect_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_config = getattr(self.model, "generation_config", None)
        for source in (getattr(gen_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return frozenset(ids)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The chat-formatted prompt text, ending with the assistant generation prompt."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"the tokenizer of {self.source} has no chat template; pass plain text prompts")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without added special tokens (BOS etc.), so pieces can be concatenated."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids for one batch item (text, chat messages or token ids)."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif _is_token_ids(prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ConfigError(
                    f"token-id prompt has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
                )
        elif _is_messages(prompt):
            ids = self.encode(self.apply_chat_template(list(prompt)))
        else:
            raise ConfigError(
                f"unsupported prompt {str(prompt)[:80]!r}: pass a string, a non-empty list of token ids, "
                "or a non-empty list of chat messages ({'role': ..., 'content': ...})"
            )
        if not ids:
            raise ConfigError(
                f"prompt {str(prompt)[:80]!r} encodes to no tokens; generation needs at least one"
            )
        return ids

    # -- generation ------------------------------------------------------------------------------

    def generate(
        self,
        batch: list[Prompt],
        stop: list[str] | list[list[str]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Generation]:
        params = params or SamplingParams()
        if params.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not 0.0 < params.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {params.top_p}")
        if not batch:
            return []
        stops = normalise_stops(stop, len(batch))
        rows = [
            _Row(index=i, prompt_ids=self.prompt_ids(p), stops=stops[i], window=stop_window(stops[i]))
            for i, p in enumerate(batch)
        ]
        generator = None
        if params.temperature > 0 and params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(params.seed))

        # Similar lengths together: less padding per chunk.
        ordered = sorted(rows, key=lambda r: len(r.prompt_ids))
        with self._inference_mode():
            for start in range(0, len(ordered), self.max_batch_size):
                chunk = ordered[start : start + self.max_batch_size]
                if self.cache_kind == "engine":
                    seed = None if params.seed is None else int(params.seed) + 7919 * start
                    self._decode_engine(chunk, params, seed)
                    self.engine.remember(
                        [r.prompt_ids + r.generated for r in chunk]
                    )  # the next turn reuses these
                elif self.cache_kind == "static":
                    self._decode_static(chunk, params, generator)
                else:
                    self._decode_dynamic(chunk, params, generator)
        return [self._to_generation(r) for r in rows]

    @contextlib.contextmanager
    def _inference_mode(self) -> Iterator[None]:
        # no_grad rather than inference_mode: a live training model must not get inference tensors in caches.
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            if was_training:
                self.model.train()

    def _to_generation(self, row: _Row) -> Generation:
        ids = row.generated
        # EOS stays in token_ids (the trajectory needs it) but not in the text callers parse.
        text_ids = ids[:-1] if row.finish_reason == "eos" else ids
        return Generation(
            text=self.decode(text_ids),
            token_ids=list(ids),
            logprobs=list(row.logprobs),
            finish_reason=row.finish_reason or "length",
            stop=row.stop,
        )

    def _accept_tokens(
        self,
        rows: Sequence[_Row],
        tokens: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        max_new_tokens: int,
    ) -> list[bool]:
        """Feed each unfinished row its next sampled tokens, in order, until it finishes (EOS, a stop
        string, the token budget); tokens after the finishing one are dropped. Returns per row whether it
        is finished. Equal to checking after every token: after each token that may complete a stop string
        (`StopEndTokens`) the decoded tail of the last `window` tokens is searched; one tokenizer call decodes all.
        """
        tails: list[list[int]] = []
        checked: list[list[bool]] = []  # per row, per new token: is its tail decoded and searched
        for row, new in zip(rows, tokens, strict=True):
            live = row.finish_reason is None and bool(row.stops)
            checked.append(self._stop_ends.checks(row.stops, new) if live else [False] * len(new))
            tails.extend(stop_tails(row.generated, new, row.window, checked[-1]))
        texts = iter(self.tokenizer.batch_decode(tails, skip_special_tokens=False) if tails else ())
        finished = []
        for row, new, lps, checks in zip(rows, tokens, logprobs, checked, strict=True):
            if row.finish_reason is None:
                row_texts = [next(texts) if c else None for c in checks]
                for k, (token, logprob) in enumerate(zip(new, lps, strict=True)):
                    row.generated.append(token)
                    row.logprobs.append(logprob)
                    if token in self.eos_token_ids:
                        row.finish_reason = "eos"
                    elif (
                        row_texts[k] is not None
                        and (hit := first_stop_in(row_texts[k], row.stops)) is not None
                    ):
                        row.finish_reason, row.stop = "stop", hit
                    elif len(row.generated) >= max_new_tokens:
                        row.finish_reason = "length"
                    if row.finish_reason is not None:
                        break
            finished.append(row.finish_reason is not None)
        return finished

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        cache_position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_kw: cache,
            "use_cache": True,
        }
        if "logits_to_keep" in self._param_names:
            kwargs["logits_to_keep"] = 1
        # transformers < 5.x tracks static cache writes through cache_position; newer versions track it inside the cache.
        if cache_position is not None and "cache_position" in self._param_names:
            kwargs["cache_position"] = cache_position
        out = self.model(**kwargs)
        return out.logits[:, -1, :]

    def _new_dynamic_cache(self) -> Any:
        # deferred: transformers takes seconds to import; needed only once a model loads
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def _decode_dynamic(
        self, rows: list[_Row], params: SamplingParams, generator: torch.Generator | None
    ) -> None:
        ids, mask = left_pad([r.prompt_ids for r in rows], self.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = positions_from_mask(mask)
        cache = self._new_dynamic_cache()
        logits = self._forward(ids, mask, positions, cache).float()
        next_pos = positions[:, -1] + 1
        active = list(rows)
        since_compaction = 0
        while True:
            tokens, logprobs = select_next_tokens(
                logits, temperature=params.temperature, top_p=params.top_p, generator=generator
            )
            done = self._accept_tokens(
                active,
                [[t] for t in tokens.tolist()],
                [[lp] for lp in logprobs.tolist()],
                params.max_new_tokens,
            )
            n_done = sum(done)
            if n_done == len(active):
                return
            since_compaction += 1
            # Copying the cache costs about one decode step, so drop finished rows once they are a
            # noticeable share of the batch, or every 16 steps.
            if n_done and (4 * n_done >= len(active) or since_compaction >= 16):
                keep = [j for j, d in enumerate(done) if not d]
                keep_t = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(keep_t)
                mask, next_pos, tokens = mask[keep_t], next_pos[keep_t], tokens[keep_t]
                active = [active[j] for j in keep]
                since_compaction = 0
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = self._forward(tokens[:, None], mask, next_pos[:, None], cache).float()
            next_pos = next_pos + 1

    # -- sleuth's decode engine -------------------------------------------------------------------

    @property
    def engine(self) -> DecodeEngine:
        """The decode engine (cache="engine") for the model's current adapter state (see `PolicyEngines`)."""
        return self._engines.get(self.model, _adapters_disabled(self.model), self.device, self.max_batch_size)

    def refresh_weights(self) -> None:
        """Re-read the policy's weights into the engine after an update (every rank calls it under FSDP)."""
        self._engines.refresh(self.model)

    def release(self) -> None:
        """Free the engines' KV pools, graphs and the policy's bf16 copy until the next rollout."""
        self._engines.release()

    @property
    def graph_failures(self) -> int:
        return self._engines.graph_failures

    @property
    def capture_seconds(self) -> float:
        return self._engines.capture_seconds

    def _decode_engine(self, rows: list[_Row], params: SamplingParams, seed: int | None) -> None:
        """Decode with the engine: chunks of `sync_every` steps run on the device while the host checks the
        previous chunk's stops (the first chunk too, when the device samples: no host random state to keep);
        rows that finished leave the batch once they are half of it, at the same chunks either way."""
        engine, max_new = self.engine, params.max_new_tokens
        started = time.perf_counter()
        state, tokens, logprobs = engine.start(
            [r.prompt_ids for r in rows],
            max_new,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=seed,
        )
        pending = first = (list(state.rows), self._to_host(tokens[:, None], logprobs[:, None]))
        if not state.samples_inside:  # the host samples: launch nothing before the first stop check
            self._accept_chunk(rows, pending[1], max_new)
            pending, self.prefill_seconds = None, self.prefill_seconds + time.perf_counter() - started
        remaining = max_new - 1
        eager = engine.step_by_step  # a CPU: a row leaves the batch at the step after its last token
        while pending is not None or (remaining > 0 and any(r.finish_reason is None for r in rows)):
            k = min(1 if eager else self.sync_every, remaining)
            chunk = (list(state.rows), self._to_host(*engine.steps(state, k))) if k > 0 else None
            remaining -= k
            if pending is not None:
                self._accept_chunk([rows[i] for i in pending[0]], pending[1], max_new)
                live = [j for j, i in enumerate(state.rows) if rows[i].finish_reason is None]
                if pending is first:  # first tokens on the host (the first chunk queued behind them), no keep
                    self.prefill_seconds += time.perf_counter() - started
                elif (
                    chunk is not None
                    and live
                    and len(live) <= (len(state.rows) - 1 if eager else state.bucket.size // 2)
                ):
                    engine.keep(
                        state, live
                    )  # (rows' seeded noise follows their batch slot: keep where it was)
                if not live:
                    return  # the chunk in flight is dropped
            pending = chunk

    def _static_cache(self, batch: int, length: int) -> Any:
        # deferred: transformers takes seconds to import; needed only once a model loads
        from transformers import StaticCache

        key = (batch, length)
        cache = self._static_caches.get(key)
        if cache is None:
            try:
                cache = StaticCache(config=self.model.config, max_cache_len=length)
            except TypeError:  # transformers 4.x signature
                cache = StaticCache(
                    config=self.model.config,
                    max_batch_size=batch,
                    max_cache_len=length,
                    device=self.device,
                    dtype=self.model.dtype,
                )
            # Keep few caches: each holds a full (batch, length) KV buffer. A compiled step's CUDA
            # graphs hold the addresses of the caches they were captured with, so with compile no
            # cache is ever freed (a replay must not write into memory that was handed back).
            if not self.compile and len(self._static_caches) >= 2:
                self._static_caches.pop(next(iter(self._static_caches)))
            self._static_caches[key] = cache
        else:
            cache.reset()
        return cache

    def _decode_step_fn(self) -> Any:
        if not self.compile:
            return self._forward
        if self._compiled_step is None:
            import torch._dynamo  # deferred: only the compiled decode step needs dynamo

            # One graph per (cache length, model mode): a LoRA policy and its adapter-disabled base are
            # two modes; the default limit of 8 would silently fall back to eager decoding.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._compiled_step = torch.compile(
                self._forward, mode="reduce-overhead", fullgraph=False, dynamic=False
            )
        return self._compiled_step

    def _decode_static(
        self, rows: list[_Row], params: SamplingParams, generator: torch.Generator | None
    ) -> None:
        prompts = [r.prompt_ids for r in rows]
        batch = len(rows)
        if self.compile:
            # Each new shape is a fresh compile, and multi-turn rollouts change the live batch and the
            # context length every turn. Measured in RL runs of SmolLM2 on an H100 with batch buckets of
            # 16/32/64: 20-70 s per new shape, 285-357 s of compiling in a run's first step (four runs
            # compiling at once). So every batch is padded (copies of row 0) to max_batch_size, and the
            # length rounded up to a power of two: a run decodes with one graph per cache length and
            # model mode. Padded rows cost little while decoding is bound by launches and weight reads.
            batch = self.max_batch_size
            prompts = prompts + [prompts[0]] * (batch - len(rows))
        width = max(len(p) for p in prompts)
        needed = width + params.max_new_tokens
        if self.compile:
            length = max(_STATIC_LEN_BUCKET, 1 << (needed - 1).bit_length())
        else:
            length = math.ceil(needed / _STATIC_LEN_BUCKET) * _STATIC_LEN_BUCKET
        # compiled decoding keeps every cache it made, so a new cache is a shape not yet compiled
        new_shape = self.compile and (batch, length) not in self._static_caches
        cache = self._static_cache(batch, length)

        ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        ids = ids.to(self.device)
        # The mask always spans the whole cache so the decode step sees one shape; unwritten slots are 0.
        mask = torch.zeros((batch, length), dtype=torch.long, device=self.device)
        mask[:, :width] = prompt_mask.to(self.device)
        positions = positions_from_mask(mask[:, :width])
        started = time.perf_counter()
        logits = self._forward(ids, mask, positions, cache, torch.arange(width, device=self.device))
        logits = logits.to(torch.float32, copy=True)
        next_pos = positions[:, -1:] + 1
        step = self._decode_step_fn()
        max_new = params.max_new_tokens
        slots = torch.arange(width, width + max_new, device=self.device)
        sampled = torch.empty((batch, max_new), dtype=torch.long, device=self.device)
        sampled_logprobs = torch.empty((batch, max_new), dtype=torch.float32, device=self.device)
        # The device runs `sync_every` decode steps between two reads of the sampled tokens: no
        # per-token synchronisation. The host checks EOS and stop strings of one chunk while the device
        # computes the next, and stops launching once every row has finished; the few steps decoded past
        # a row's end are dropped, so tokens and their distribution are those of step-by-step decoding.
        pending: tuple[torch.Tensor, torch.Tensor, Any] | None = None
        for chunk_start in range(0, max_new, self.sync_every):
            chunk_end = min(chunk_start + self.sync_every, max_new)
            for t in range(chunk_start, chunk_end):
                tokens, logprobs = select_next_tokens(
                    logits, temperature=params.temperature, top_p=params.top_p, generator=generator
                )
                sampled[:, t] = tokens
                sampled_logprobs[:, t] = logprobs
                if t + 1 < max_new:
                    mask[:, width + t] = 1
                    # Outputs of a CUDA-graph step are overwritten by the next replay: copy before reuse.
                    logits = step(tokens[:, None], mask, next_pos, cache, slots[t : t + 1]).to(
                        torch.float32, copy=True
                    )
                    next_pos = next_pos + 1
                    if new_shape:  # the first call of a new shape compiles it: report the one-time cost
                        self._synchronize()
                        new_shape = False
                        seconds = time.perf_counter() - started
                        self.compile_seconds += seconds
                        log.info(
                            "compiled the decode step for batch %d x cache %d in %.1f s",
                            batch,
                            length,
                            seconds,
                        )
            chunk = self._to_host(
                sampled[: len(rows), chunk_start:chunk_end],
                sampled_logprobs[: len(rows), chunk_start:chunk_end],
            )
            if pending is not None and self._accept_chunk(rows, pending, max_new):
                break  # every row finished: the chunk in flight is dropped
            pending = chunk
        else:
            if pending is not None:
                self._accept_chunk(rows, pending, max_new)

    def _to_host(
        self, tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Start copying a chunk of sampled tokens to the host without waiting for it."""
        if self.device.type != "cuda":
            return tokens.cpu(), logprobs.cpu(), None
        event = torch.cuda.Event()
        host = tokens.to("cpu", non_blocking=True), logprobs.to("cpu", non_blocking=True)
        event.record()
        return host[0], host[1], event

    def _accept_chunk(
        self, rows: list[_Row], chunk: tuple[torch.Tensor, torch.Tensor, Any], max_new: int
    ) -> bool:
        tokens, logprobs, event = chunk
        if event is not None:
            event.synchronize()
        return all(self._accept_tokens(rows, tokens.tolist(), logprobs.tolist(), max_new))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
