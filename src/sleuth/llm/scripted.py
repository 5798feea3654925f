"""A scripted generator for deterministic tests of agent loops, with a real tokenizer.

It speaks the `Generator` protocol token-in/token-out like a real backend: the
script chooses the text of the next policy turn, which is encoded and emitted
token by token; emission stops at the token that completes the first stop string
(the stop string is kept, `finish_reason="stop"`), at `max_new_tokens`
(`"length"`), or after the whole text, followed by the EOS token (`"eos"`).
`token_ids` are exactly the emitted ids and `logprobs` a fixed fake value each.

A script is either
- a mapping {question text: [turn 0 text, turn 1 text, ...]}: the question is found
  in the prompt and the turn index is the number of earlier prompts this one extends
  (so n samples of a question follow the same list); past the list, only EOS; or
- a callable `(ScriptCall) -> str`.

A turn's text is what the model "would write": when emission was cut by a stop
string and the next input is exactly the previous input plus that output (the
loop resumed generation without inserting anything), the rest of the same text
is emitted, as a real model would continue it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sleuth.llm.base import Generation, Prompt, SamplingParams
from sleuth.llm.stops import normalise_stops


@dataclass
class ScriptCall:
    prompt_text: str  # the decoded input: prompt plus the response so far
    prompt_ids: list[int]
    turn_index: int  # how many earlier inputs this one extends
    call_index: int  # which generate() call (0-based)
    batch_index: int  # position in that call's batch


Script = Mapping[str, Sequence[str]] | Callable[[ScriptCall], str]


class ScriptedGenerator:
    def __init__(self, tokenizer, script: Script, *, logprob: float = -0.25, eos: bool = True):
        if not (callable(script) or isinstance(script, Mapping)):
            raise TypeError(
                "script must be a mapping {question: [turn texts]} or a callable (ScriptCall) -> str"
            )
        self.tokenizer = tokenizer
        self.script = script
        self.logprob = logprob
        self.eos = eos
        self.calls: list[list[list[int]]] = []  # every batch fed, as token ids
        self.stops: list[list[list[str]]] = []  # the stop strings of each batch item
        self.outputs: list[list[Generation]] = []
        self._seen: set[tuple[int, ...]] = set()
        self._pending: dict[tuple[int, ...], str] = {}  # input after a stop cut -> the rest of its text

    # -- helpers ------------------------------------------------------------------------------------
    def _to_ids(self, prompt: Prompt) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            return list(tok.encode(prompt, add_special_tokens=False))
        if prompt and isinstance(prompt[0], dict):
            text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            return list(tok.encode(text, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _turn_index(self, ids: list[int]) -> int:
        key = tuple(ids)
        return sum(1 for seen in self._seen if len(seen) < len(key) and key[: len(seen)] == seen)

    def _script_text(self, call: ScriptCall) -> str:
        if callable(self.script):
            return self.script(call)
        matches = [q for q in self.script if q in call.prompt_text]
        if not matches:
            raise KeyError(f"no scripted question occurs in the prompt: {call.prompt_text[:200]!r}")
        turns = self.script[max(matches, key=len)]
        return turns[call.turn_index] if call.turn_index < len(turns) else ""

    def emit(self, text: str, stop: Sequence[str], max_new_tokens: int) -> Generation:
        """Emit `text` token by token as a backend would, honouring stop strings and the token limit."""
        tok = self.tokenizer
        ids = list(tok.encode(text, add_special_tokens=False)) if text else []
        out: list[int] = []
        for tid in ids:
            if len(out) >= max_new_tokens:
                return self._gen(out, "length", None)
            out.append(tid)
            decoded = tok.decode(out)
            hits = [(decoded.find(s), s) for s in stop if s and s in decoded]
            if hits:
                _, matched = min(hits)
                return self._gen(out, "stop", matched)
        if self.eos and tok.eos_token_id is not None:
            if len(out) >= max_new_tokens:
                return self._gen(out, "length", None)
            return self._gen(out + [tok.eos_token_id], "eos", None)
        return self._gen(out, "length", None)

    def _gen(self, ids: list[int], reason: str, stop: str | None) -> Generation:
        tok = self.tokenizer
        text = tok.decode(ids, skip_special_tokens=True)
        if stop is not None:
            # a backend's text ends with the stop string even when its last token runs past it
            text = text[: text.find(stop) + len(stop)]
        return Generation(
            text=text,
            token_ids=list(ids),
            logprobs=[self.logprob] * len(ids),
            finish_reason=reason,
            stop=stop,
        )

    # -- the protocol --------------------------------------------------------------------------------
    def generate(
        self,
        batch: list[Prompt],
        stop: list[str] | list[list[str]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Generation]:
        params = params or SamplingParams()
        stops = normalise_stops(stop, len(batch))
        all_ids = [self._to_ids(p) for p in batch]
        call_index = len(self.calls)
        outs: list[Generation] = []
        fresh: list[tuple[int, ...]] = []
        for i, (ids, stop_list) in enumerate(zip(all_ids, stops, strict=True)):
            key = tuple(ids)
            if key in self._pending:
                text = self._pending[key]  # resumed turn: no new turn index
            else:
                fresh.append(key)
                call = ScriptCall(
                    prompt_text=self.tokenizer.decode(ids),
                    prompt_ids=ids,
                    turn_index=self._turn_index(ids),
                    call_index=call_index,
                    batch_index=i,
                )
                text = self._script_text(call)
            out = self.emit(text, stop_list, params.max_new_tokens)
            if out.finish_reason == "stop":
                emitted = self.tokenizer.decode(out.token_ids)
                if text.startswith(emitted) and len(emitted) < len(text):
                    self._pending[tuple(ids + out.token_ids)] = text[len(emitted) :]
            outs.append(out)
        self._seen.update(fresh)
        self.calls.append(all_ids)
        self.stops.append(stops)
        self.outputs.append(outs)
        return outs
