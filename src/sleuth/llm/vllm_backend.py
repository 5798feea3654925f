"""A `Generator` over an in-process vLLM engine (GPU rollouts). vllm is optional.

Importing this module never imports vllm; constructing `VLLMGenerator` does, and fails with an
install hint when it is missing. Not exercised by the test suite (no vllm/GPU here) except for the
missing-dependency error; the output mapping (`generation_from_vllm`) is tested with plain objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sleuth.errors import ConfigError
from sleuth.llm.base import Generation, Prompt, SamplingParams
from sleuth.llm.stops import normalise_stops

INSTALL_HINT = (
    "VLLMGenerator needs vllm on a CUDA machine: pip install vllm (or use the 'hf' or 'openai' backend)"
)


def _import_vllm() -> Any:
    try:
        import vllm  # deferred: optional and heavy; most installs lack it
    except ImportError as err:
        raise ConfigError(f"{INSTALL_HINT} ({err})") from err
    return vllm


def generation_from_vllm(
    completion: Any, stops: list[str], eos_ids: frozenset[int], decode: Callable[[list[int]], str]
) -> Generation:
    """Map one vLLM `CompletionOutput` to a `Generation`.

    vLLM's `finish_reason` is "stop" for both EOS and stop strings; `stop_reason` holds the matched
    stop string (str), a stop token id (int), or None for EOS.
    """
    token_ids = [int(t) for t in completion.token_ids]
    logprobs: list[float] = []
    for position, entry in enumerate(completion.logprobs or []):
        logprobs.append(float(entry[token_ids[position]].logprob))
    stop_reason = getattr(completion, "stop_reason", None)
    if completion.finish_reason == "length":
        finish, stop = "length", None
    elif isinstance(stop_reason, str) and stop_reason in stops:
        finish, stop = "stop", stop_reason
    else:
        finish, stop = "eos", None
    text = completion.text
    if finish == "eos" and token_ids and token_ids[-1] in eos_ids:
        # Same convention as HFGenerator: EOS stays in token_ids but not in the text.
        text = decode(token_ids[:-1])
    return Generation(text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=finish, stop=stop)


class VLLMGenerator:
    """`vllm.LLM` behind the `Generator` protocol. Extra keyword arguments go to `vllm.LLM`."""

    def __init__(self, model: str, *, tokenizer: Any = None, **llm_kwargs: Any) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(model=model, **llm_kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else [])

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _prompt_input(self, prompt: Prompt) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"prompt_token_ids": self.encode(prompt)}
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return {"prompt_token_ids": list(prompt)}
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return {"prompt_token_ids": self.encode(self.apply_chat_template(prompt))}
        raise ConfigError(
            f"unsupported prompt {str(prompt)[:80]!r}: pass a string, token ids, or chat messages"
        )

    def generate(
        self,
        batch: list[Prompt],
        stop: list[str] | list[list[str]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Generation]:
        params = params or SamplingParams()
        if not batch:
            return []
        stops = normalise_stops(stop, len(batch))
        sampling = [
            self._vllm.SamplingParams(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=None if params.seed is None else params.seed + i,
                stop=stops[i] or None,
                include_stop_str_in_output=True,
                skip_special_tokens=False,
                logprobs=0,  # the sampled token's log-prob only
            )
            for i in range(len(batch))
        ]
        inputs = [self._prompt_input(p) for p in batch]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False)
        return [
            generation_from_vllm(out.outputs[0], stops[i], self.eos_token_ids, self.decode)
            for i, out in enumerate(outputs)
        ]

    def load_weights(self, state_dict_iter: Iterable[tuple[str, Any]]) -> None:
        """Push trainer weights into the engine (weight sync between RL steps). Best effort, UNTESTED here.

        The internal path differs between vLLM versions; we try the known ones and say so if none fits.
        """
        engine = self.llm.llm_engine
        candidates = [
            lambda: engine.model_executor.driver_worker.model_runner.model,  # vLLM 0.4-0.6 (V0)
            lambda: engine.model_executor.driver_worker.worker.model_runner.model,
        ]
        for get_model in candidates:
            try:
                model = get_model()
            except AttributeError:
                continue
            model.load_weights(state_dict_iter)
            if hasattr(self.llm, "reset_prefix_cache"):
                self.llm.reset_prefix_cache()
            return
        if hasattr(self.llm, "collective_rpc"):  # vLLM V1: run on every worker
            weights = list(state_dict_iter)
            self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(weights))
            if hasattr(self.llm, "reset_prefix_cache"):
                self.llm.reset_prefix_cache()
            return
        raise ConfigError(
            "cannot find the model inside this vLLM version to load weights into; "
            "restart the engine from a saved checkpoint instead"
        )
