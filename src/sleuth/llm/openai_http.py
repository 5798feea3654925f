"""A `Generator` for any OpenAI-compatible HTTP server (vLLM, llama.cpp, SGLang, hosted APIs).

- chat messages -> POST {base_url}/chat/completions; text -> chat (chat=True) or /completions;
  token ids -> /completions with `prompt` as a list of ids (vLLM and SGLang accept it);
- up to `max_concurrency` requests in flight (a thread pool over one pooled httpx client);
- transport errors, 429 and 5xx are retried with exponential backoff (`sleuth.utils.retry`); other 4xx
  fail at once; after the last attempt a `ServiceError` names the URL and the last error. A request that
  timed out waiting for its answer is not sent again: the server is likely still computing it, and a second
  copy would double its work; the error says how to wait longer (`timeout`, default SLEUTH_OPENAI_TIMEOUT
  or 60 s; `sleuth eval --openai-timeout`).

The protocol keeps the stop string in `text`, while OpenAI servers cut it off. vLLM reports which one
matched (`stop_reason`) and we append it; other servers do not say, so we append it only when a
single stop string was requested. Token ids come back only when the server returns tokens as
"token_id:<n>" (vLLM with `vllm_extensions=True`, which also keeps the stop string in the output).
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from sleuth.errors import ConfigError, ServiceError
from sleuth.llm.base import Generation, Prompt, SamplingParams
from sleuth.llm.stops import normalise_stops
from sleuth.utils import RetryPolicy, retry

_TOKEN_ID = re.compile(r"^token_id:(\d+)$")
_MISSING = object()
TIMEOUT_ENV = "SLEUTH_OPENAI_TIMEOUT"  # seconds to wait for an answer when a spec sets no `timeout`
DEFAULT_TIMEOUT_S = 60.0


def default_timeout() -> float:
    """SLEUTH_OPENAI_TIMEOUT (seconds) if set, else 60 s."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{TIMEOUT_ENV}={raw!r}: set it to the seconds to wait for a model server's answer, e.g. 300"
        )
    return value


class _RetryableHTTP(Exception):
    """A response worth retrying (429 / 5xx)."""


class _IdsRefused(ServiceError):
    """A server that takes text prompts only refused a prompt of token ids (HTTP 400 / 422)."""


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _as_messages(prompt: Prompt, chat: bool) -> list[dict] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return prompt
    if isinstance(prompt, str) and chat:
        return [{"role": "user", "content": prompt}]
    return None


def parse_token_ids(tokens: list[str]) -> list[int]:
    """Token ids from "token_id:<n>" strings; [] if any token is plain text (the server sent text tokens)."""
    ids = []
    for token in tokens:
        match = _TOKEN_ID.match(token or "")
        if match is None:
            return []
        ids.append(int(match.group(1)))
    return ids


def parse_choice(choice: dict[str, Any], stops: list[str], chat: bool) -> Generation:
    """One `Generation` from one OpenAI `choices[0]` object (chat or completions shape)."""
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    text = text or ""
    tokens: list[str] = []
    logprobs: list[float] = []
    raw_lp = choice.get("logprobs")
    if isinstance(raw_lp, dict):
        if chat:
            for entry in raw_lp.get("content") or []:
                tokens.append(entry.get("token", ""))
                logprobs.append(float(entry.get("logprob", 0.0)))
        else:
            tokens = list(raw_lp.get("tokens") or [])
            logprobs = [float(x) if x is not None else 0.0 for x in raw_lp.get("token_logprobs") or []]

    reason = choice.get("finish_reason")
    stop_hit: str | None = None
    if reason == "length":
        finish = "length"
    elif reason == "stop":
        stop_reason = choice.get("stop_reason", _MISSING)
        kept = _first_stop_in(text, stops) if stop_reason is _MISSING else None
        if isinstance(stop_reason, str) and stop_reason:
            stop_hit = stop_reason
        elif kept is not None:
            # a server that keeps the stop string in the text (transformers serve) and may run a few characters
            # past it within the token that completed it: cut after the first one, as vLLM reports it
            text, stop_hit = text[: kept[0] + len(kept[1])], kept[1]
        elif stop_reason is _MISSING and len(stops) == 1:
            # Servers without stop_reason do not tell EOS from a stop string; with one stop string
            # requested, a stop is the likelier reading and the agent needs the closing tag.
            stop_hit = stops[0]
        finish = "stop" if stop_hit is not None else "eos"
        if stop_hit is not None and not text.endswith(stop_hit):
            text += stop_hit
    else:
        finish = "length" if reason is None else "stop"
    return Generation(
        text=text, token_ids=parse_token_ids(tokens), logprobs=logprobs, finish_reason=finish, stop=stop_hit
    )


def _first_stop_in(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(text.find(s), s) for s in stops if s and s in text]
    return min(found) if found else None


@dataclass(frozen=True)
class OpenAIOptions:
    """How an `OpenAIGenerator` talks to its server (the keys of an openai model spec besides base_url, model,
    api_key). `retry` (a recipe's services.retry) replaces retries/backoff with a time budget; `service` is
    named in errors ("judge", "generator", ...)."""

    chat: bool = True
    max_concurrency: int = 8
    timeout: float | None = None  # seconds to wait for an answer; None: SLEUTH_OPENAI_TIMEOUT, else 60
    retries: int = 4
    backoff: float = 0.5
    request_logprobs: bool = True
    vllm_extensions: bool = False
    extra_body: dict[str, Any] | None = None
    retry: RetryPolicy | None = None
    service: str = "model server"


class OpenAIGenerator:
    """Talks to `base_url` (e.g. "http://localhost:8000/v1") with model name `model`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        tokenizer: Any = None,
        options: OpenAIOptions | None = None,
    ) -> None:
        options = options or OpenAIOptions()
        chat, max_concurrency, timeout, retries = (
            options.chat,
            options.max_concurrency,
            options.timeout,
            options.retries,
        )
        backoff, retry, service = options.backoff, options.retry, options.service
        request_logprobs, vllm_extensions, extra_body = (
            options.request_logprobs,
            options.vllm_extensions,
            options.extra_body,
        )
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"base_url {base_url!r} must start with http:// or https:// (e.g. http://localhost:8000/v1)"
            )
        if max_concurrency < 1 or retries < 1:
            raise ConfigError(f"max_concurrency and retries must be >= 1 (got {max_concurrency}, {retries})")

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = chat
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.backoff = backoff
        # `retry` (a recipe's services.retry) replaces retries/backoff with a time budget
        self.retry_policy = retry or RetryPolicy(
            max_attempts=retries, initial_delay_s=backoff, budget_s=math.inf
        )
        self.service = service  # named in errors: "judge", "generator", ...
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.request_logprobs = request_logprobs
        self.vllm_extensions = vllm_extensions
        self.extra_body = dict(extra_body or {})
        # The agent engine reads `.tokenizer`; a remote model has none unless the caller passes it.
        self.tokenizer = tokenizer
        # set once a server refused token ids (transformers serve takes text): later prompts go as text
        self.text_prompts = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> OpenAIGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build_request(self, prompt: Prompt, stops: list[str], params: SamplingParams, index: int,
                      raw: bool = False) -> tuple[str, dict]:  # fmt: skip
        """(url, JSON body) for one prompt; `raw`: a text prompt that already holds the chat format (token ids
        decoded) goes to /completions as it is."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.seed is not None:
            # Distinct seeds per item: a batch often repeats one prompt (GRPO groups) and must not get copies.
            body["seed"] = int(params.seed) + index
        if stops:
            body["stop"] = stops
        messages = None if raw else _as_messages(prompt, self.chat)
        if messages is not None:
            url = f"{self.base_url}/chat/completions"
            body["messages"] = messages
            if self.request_logprobs:
                body["logprobs"] = True
        elif isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            url = f"{self.base_url}/completions"
            body["prompt"] = prompt
            if self.request_logprobs:
                body["logprobs"] = 0  # the sampled token's log-prob only
        else:
            raise ConfigError(
                f"unsupported prompt {str(prompt)[:80]!r}: pass a string, token ids, or chat messages"
            )
        if self.vllm_extensions:
            body["return_tokens_as_token_ids"] = True
            body["include_stop_str_in_output"] = True
            body["skip_special_tokens"] = False
        body.update(self.extra_body)
        return url, body

    def _post(self, url: str, body: dict) -> dict:
        def attempt() -> dict:
            try:
                response = self._client.post(url, json=body)
            except httpx.ReadTimeout:
                # sent, and no answer yet: the server is probably still computing it; sending it again would
                # make it compute twice, so stop and say how to wait longer
                raise ServiceError(
                    f"{self.service} POST {url}: no answer within {self.timeout:g} s; not sent again (the server may "
                    f"still be computing it). Wait longer: {TIMEOUT_ENV}=SECONDS, `sleuth eval --openai-timeout "
                    "SECONDS`, or `timeout` in the model spec"
                ) from None
            if response.status_code == 429 or response.status_code >= 500:
                raise _RetryableHTTP(f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code in (400, 422) and _is_ids(body.get("prompt")):
                raise _IdsRefused(
                    f"POST {url} refused a prompt of token ids: HTTP {response.status_code}: "
                    f"{response.text[:300]}"
                )
            if response.status_code >= 400:
                raise ServiceError(
                    f"POST {url} was rejected: HTTP {response.status_code}: {response.text[:300]}"
                )
            try:
                return response.json()
            except ValueError as err:
                raise _RetryableHTTP(f"invalid JSON from server: {response.text[:200]!r}") from err

        return retry(
            attempt,
            policy=self.retry_policy,
            retry_on=(httpx.TransportError, _RetryableHTTP),
            what=f"{self.service} POST {url}",
        )

    def _one(self, prompt: Prompt, stops: list[str], params: SamplingParams, index: int) -> Generation:
        raw = self.text_prompts and _is_ids(prompt)
        url, body = self.build_request(
            self._as_text(prompt) if raw else prompt, stops, params, index, raw=raw
        )
        try:
            payload = self._post(url, body)
        except _IdsRefused as err:
            if self.tokenizer is None:
                raise ServiceError(
                    f"{err}; pass the model's tokenizer (a local model directory as the model name, "
                    "or `sleuth eval --tokenizer DIR`) so prompts go as text"
                ) from None
            self.text_prompts = True  # the same text the ids decode to, tokenised by the server alike
            url, body = self.build_request(self._as_text(prompt), stops, params, index, raw=True)
            payload = self._post(url, body)
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not choices:
            raise ServiceError(f"POST {url} returned no choices: {str(payload)[:300]}")
        return parse_choice(choices[0], stops, chat=url.endswith("/chat/completions"))

    def _as_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

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
        if len(batch) == 1:
            return [self._one(batch[0], stops[0], params, 0)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(batch))) as pool:
            futures = [
                pool.submit(self._one, p, s, params, i)
                for i, (p, s) in enumerate(zip(batch, stops, strict=True))
            ]
            return [f.result() for f in futures]
