"""Cold-start trajectories for supervised fine-tuning: from the oracle, a teacher model or chat messages.

One jsonl record per trajectory, with the token ids and loss mask exactly as the RL
rollout builds them (inserted documents and feedback masked), plus the text:

    {"loop": "s3", "source": "oracle", "question_id": ..., "question": ..., "golden_answers": [...],
     "prompt_ids": [...], "response_ids": [...], "loss_mask": [...], "prompt_text": ..., "response_text": ...,
     "reward": 1.0, "retrieval_count": 2}

`read_records` checks every line (JSON, fields, mask length, known loop) and names the
file and line of the first problem; `write_records` writes atomically.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sleuth.agent.base import AgentLoop
from sleuth.agent.engine import RolloutBudget, encode_prompt, encode_text, rollout
from sleuth.agent.oracle import OracleGenerator, oracle_check
from sleuth.agent.registry import loop_names
from sleuth.agent.trajectory import Trajectory
from sleuth.data.formats import QAExample
from sleuth.errors import DataFormatError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.retrieval.base import Retriever
from sleuth.utils import atomic_open


@dataclass
class SFTRecord:
    loop: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    source: str = "oracle"
    question_id: str = ""
    question: str = ""
    golden_answers: list[str] = field(default_factory=list)
    prompt_text: str = ""
    response_text: str = ""
    reward: float | None = None
    retrieval_count: int = 0

    @classmethod
    def from_trajectory(cls, traj: Trajectory, source: str, reward: float | None = None) -> SFTRecord:
        return cls(
            loop=traj.method,
            prompt_ids=list(traj.prompt_ids),
            response_ids=list(traj.response_ids),
            loss_mask=list(traj.loss_mask),
            source=source,
            question_id=traj.question_id,
            question=traj.question,
            golden_answers=list(traj.golden_answers),
            prompt_text=traj.prompt_text,
            response_text=traj.response_text,
            reward=reward,
            retrieval_count=traj.retrieval_count,
        )


_REQUIRED = ("loop", "prompt_ids", "response_ids", "loss_mask")


def _check_ids(value: Any, name: str, path: Path, line: int, binary: bool = False) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise DataFormatError(str(path), line, f"{name} must be a list of integers")
    if binary and any(x not in (0, 1) for x in value):
        raise DataFormatError(str(path), line, f"{name} must hold only 0 and 1")
    return value


def record_from_dict(data: Any, path: Path, line: int) -> SFTRecord:
    if not isinstance(data, dict):
        raise DataFormatError(str(path), line, "a trajectory record must be a JSON object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise DataFormatError(str(path), line, f"missing field(s) {', '.join(missing)}")
    if data["loop"] not in loop_names():
        raise DataFormatError(
            str(path), line, f"unknown loop {data['loop']!r}; known loops: {', '.join(loop_names())}"
        )
    prompt = _check_ids(data["prompt_ids"], "prompt_ids", path, line)
    response = _check_ids(data["response_ids"], "response_ids", path, line)
    mask = _check_ids(data["loss_mask"], "loss_mask", path, line, binary=True)
    if len(mask) != len(response):
        raise DataFormatError(
            str(path), line, f"loss_mask has {len(mask)} entries but response_ids has {len(response)}"
        )
    if not prompt or not any(mask):
        raise DataFormatError(str(path), line, "empty prompt or no policy token (loss_mask all 0)")
    known = {f for f in SFTRecord.__dataclass_fields__}
    return SFTRecord(**{k: v for k, v in data.items() if k in known})


def read_records(path: str | Path) -> list[SFTRecord]:
    """Every record of a trajectory jsonl; the first bad line raises a DataFormatError naming file and line."""
    path = Path(path)
    records = [record_from_dict(data, path, number) for number, data in _json_lines(path)]
    if not records:
        raise DataFormatError(str(path), None, "no trajectories in the file")
    return records


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) of every non-blank line; a bad line raises naming file and line."""
    if not path.exists():
        raise DataFormatError(str(path), None, "file does not exist")
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as err:
                raise DataFormatError(
                    str(path), number, f"not valid JSON ({type(err).__name__}: {err})"
                ) from None


def write_records(path: str | Path, records: Iterable[SFTRecord]) -> int:
    count = 0
    with atomic_open(path, "w") as fh:
        for rec in records:
            fh.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
            count += 1
    return count


# -- sources ----------------------------------------------------------------------------------------------


def collect_oracle(
    loop: AgentLoop,
    retriever: Retriever,
    tokenizer: Any,
    examples: Sequence[QAExample],
    *,
    seed: int = 0,
    variants: int = 1,
    budget: RolloutBudget | None = None,
) -> tuple[list[SFTRecord], dict[str, int]]:
    """Oracle trajectories through the real rollout engine; only those that pass `oracle_check` are kept.

    `variants` > 1 plays every question again with other wordings (other seeds)."""
    kept: list[SFTRecord] = []
    stats = {"played": 0, "kept": 0}
    for v in range(variants):
        oracle = OracleGenerator(loop, retriever, tokenizer, examples, seed=seed * 1_000 + v)
        trajs = rollout(loop, oracle, retriever, examples, n=1, budget=budget, tokenizer=tokenizer)
        for traj, ex in zip(trajs, examples, strict=True):
            stats["played"] += 1
            if oracle_check(traj, ex):
                kept.append(SFTRecord.from_trajectory(traj, "oracle", reward=None))
    stats["kept"] = len(kept)
    return kept, stats


@dataclass(frozen=True)
class RejectionSampling:
    """Play every question `n` times; keep a trajectory whose `reward_fn(trajs, services)` total is >= `threshold`."""

    reward_fn: Any
    services: Any
    threshold: float
    n: int = 1


def collect_teacher(
    loop: AgentLoop,
    teacher: Generator,
    retriever: Retriever,
    examples: Sequence[QAExample],
    sampling: RejectionSampling,
    *,
    params: SamplingParams | None = None,
    budget: RolloutBudget | None = None,
    tokenizer: Any = None,
) -> tuple[list[SFTRecord], dict[str, int]]:
    """Rejection sampling: the teacher plays the loop `sampling.n` times per question; rewards >= threshold are kept."""
    trajs = rollout(
        loop,
        teacher,
        retriever,
        examples,
        params or SamplingParams(temperature=0.7),
        n=sampling.n,
        budget=budget,
        tokenizer=tokenizer,
    )
    results = sampling.reward_fn(trajs, sampling.services)
    kept = [
        SFTRecord.from_trajectory(t, "teacher", reward=float(r.total))
        for t, r in zip(trajs, results, strict=True)
        if r.total >= sampling.threshold
    ]
    return kept, {"played": len(trajs), "kept": len(kept)}


def records_from_messages(path: str | Path, tokenizer: Any, loop: str) -> list[SFTRecord]:
    """Chat-message jsonl (`{"messages": [{"role", "content"}, ...]}`) as trajectory records.

    The messages up to the first assistant message are the chat-templated prompt; after it, as in a
    sleuth rollout, everything is one assistant turn: assistant contents are policy tokens (mask 1),
    every other message's content (tool results, documents) is inserted text (mask 0)."""
    path = Path(path)
    if loop not in loop_names():
        raise DataFormatError(
            str(path), None, f"unknown loop {loop!r}; known loops: {', '.join(loop_names())}"
        )
    records = [
        _record_from_messages(data, tokenizer, loop, path, number) for number, data in _json_lines(path)
    ]
    if not records:
        raise DataFormatError(str(path), None, "no conversations in the file")
    return records


def _record_from_messages(data: Any, tokenizer: Any, loop: str, path: Path, line: int) -> SFTRecord:
    messages = data.get("messages") if isinstance(data, dict) else None
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise DataFormatError(str(path), line, 'expected {"messages": [{"role": ..., "content": ...}, ...]}')
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise DataFormatError(str(path), line, "a conversation needs a prompt message and an assistant reply")
    prompt_ids, prompt_text = encode_prompt(tokenizer, messages[:first])
    response_ids: list[int] = []
    mask: list[int] = []
    texts = []
    for m in messages[first:]:
        ids = encode_text(tokenizer, m["content"])
        response_ids += ids
        mask += [1 if m["role"] == "assistant" else 0] * len(ids)
        texts.append(m["content"])
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
        mask.append(1)
    question = next((m["content"] for m in messages[:first] if m["role"] == "user"), "")
    return SFTRecord(
        loop=loop,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        loss_mask=mask,
        source="messages",
        question_id=str(data.get("id", line)),
        question=question,
        golden_answers=[str(a) for a in data.get("golden_answers", [])],
        prompt_text=prompt_text,
        response_text="".join(texts),
    )


def split_records(
    records: list[SFTRecord], held_out: float, seed: int
) -> tuple[list[SFTRecord], list[SFTRecord]]:
    """(train, held out) split by question, so no question's variants sit on both sides."""
    qids = sorted({r.question_id for r in records})
    random.Random(seed).shuffle(qids)
    n_held = int(round(len(qids) * held_out))
    held = set(qids[:n_held])
    return [r for r in records if r.question_id not in held], [r for r in records if r.question_id in held]


def iter_limited(records: Sequence[SFTRecord], limit: int | None, seed: int) -> Iterator[SFTRecord]:
    """At most `limit` records, a seeded sample of whole questions (the small format warm-up set)."""
    if limit is None or limit >= len(records):
        yield from records
        return
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    for i in sorted(order[:limit]):
        yield records[i]
