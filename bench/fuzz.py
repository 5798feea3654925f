"""Fuzz every agent loop and every reward with adversarial generations and documents.

    PYTHONPATH=src python bench/fuzz.py                      # 10,000 generations per loop
    PYTHONPATH=src python bench/fuzz.py --generations 200    # a quick look

Each loop runs the real rollout engine (`sleuth.agent.engine.rollout`) with a generator that writes
adversarial turns: protocol tags of every method, unclosed and nested tags, near-miss tags (`<answer >`),
`[` x 1000, 4,301-digit numbers, JSON nested 1,000 deep, megabyte-scale repeats; the retriever answers
with documents full of tags (`</information>`, `<answer>gold</answer>`). Every registered reward
then scores every loop's trajectories, with fake frozen models (generator, judge, encoder) that
also answer adversarially.

Counted per loop: rollout exceptions (the batch raised), trajectories the engine isolated after an
unexpected error (`finish_reason == "error"`), and per reward: exceptions, non-finite totals and
totals outside the reward's documented range. The goal is 0 everywhere. A second table times one
call of each parser/reward on a 1 MB generation of repeated unclosed tags (linear-time parsing).
Prints tables and writes JSON (`--out`, else $OUT/fuzz.json, else bench/results/fuzz.json).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, out_path, print_table, require_positive, write_json  # noqa: E402
from sleuth.agent.engine import RolloutBudget, rollout  # noqa: E402
from sleuth.agent.registry import get_loop, loop_names  # noqa: E402
from sleuth.agent.trajectory import Trajectory, Turn  # noqa: E402
from sleuth.data.formats import QAExample  # noqa: E402
from sleuth.llm.base import Generation, SamplingParams  # noqa: E402
from sleuth.llm.stops import normalise_stops  # noqa: E402
from sleuth.retrieval.base import Hit  # noqa: E402
from sleuth.rewards.base import RewardServices, available_rewards, get_reward  # noqa: E402

TAGS = [
    "think",
    "search",
    "answer",
    "information",
    "query",
    "important_info",
    "search_complete",
    "reflect",
    "reflection",
    "plan",
    "observation",
    "original_evidence",
]


def _near_misses(tag: str) -> list[str]:
    return [f"<{tag} >", f"<{tag}\n>", f"< {tag}>", f"</{tag} >", f"<{tag} x=1>", f"<{tag.upper()}>"]


def _fragments(rng: random.Random) -> list[str]:
    tag = rng.choice(TAGS)
    return [
        f"<{tag}>",
        f"</{tag}>",
        f"<{tag}>{rng.choice(['Paris', '', ' ', 'x' * 50])}</{tag}>",
        *_near_misses(tag),
        "<search> capital of Varonia </search>",
        "<answer> Quellstad </answer>",
        "<answer></answer>",
        "<search_complete>True</search_complete>",
        "<search_complete>False</search_complete>",
        "<search_complete>maybe</search_complete>",
        '<query>{"query": "Blue Harbor director"}</query>',
        '<query>{"query": ["a", 1]}</query>',
        '<query>{"query": 5}</query>',
        "<query></query>",
        "<important_info>[1, 3]</important_info>",
        "<important_info>[0, 99, -1, 1.5, true]</important_info>",
        "<important_info>[[[1]]]</important_info>",
        "<important_info>1 and 2</important_info>",
        "<important_info>" + "9" * 4301 + "</important_info>",
        "<important_info>" + "[" * 1000 + "</important_info>",
        "<query>" + '{"query": ' * 1000 + "</query>",
        "<query>" + "[" * 5000 + "]" * 5000 + "</query>",
        "<search><query>a</query><query>b</query><query>c</query><query>d</query></search>",
        "<search><query></query></search>",
        "<search>plain query</search>",
        "<original_evidence>Quellstad is the capital</original_evidence>",
        "<think><think><think>",
        "</answer></answer>",
        "<answer><answer>x</answer>",
        "\x00\ufffd\u202e\U0001f600",
        "a < b > c",
        "&lt;answer&gt;",
        "True",
        "[1, 2",
        "{",
        "}",
        "\n\n",
        rng.choice(["", " ", "Paris", "I think the answer is 42."]),
    ]


def adversarial_turn(rng: random.Random) -> str:
    """One generated turn: a few adversarial fragments, sometimes a long run of one tag."""
    frags = _fragments(rng)
    parts = [rng.choice(frags) for _ in range(rng.randint(0, 8))]
    if rng.random() < 0.05:
        parts.insert(rng.randint(0, len(parts)), f"<{rng.choice(TAGS)}>" * rng.randint(100, 3000))
    return "".join(parts)


class AdversarialGenerator:
    """The `Generator` protocol, answering every prompt with `adversarial_turn`: text is cut at the
    first stop string (kept) and its ids at `max_new_tokens`, as a backend would."""

    def __init__(
        self, tokenizer: Any, rng: random.Random, turn: Callable[[random.Random], str] = adversarial_turn
    ):
        self.tokenizer = tokenizer
        self.rng = rng
        self.turn = turn
        self.generations = 0

    def generate(
        self, batch: list, stop: list | None = None, params: SamplingParams | None = None
    ) -> list[Generation]:
        params = params or SamplingParams()
        out = []
        for stops in normalise_stops(stop, len(batch)):
            text = self.turn(self.rng)
            cuts = [(text.find(s) + len(s), s) for s in stops if s and s in text]
            reason, matched = "eos", None
            if cuts:
                end, matched = min(cuts)
                text, reason = text[:end], "stop"
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(ids) > params.max_new_tokens:
                ids, reason, matched = ids[: params.max_new_tokens], "length", None
                text = self.tokenizer.decode(ids)
            out.append(
                Generation(
                    text=text, token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason=reason, stop=matched
                )
            )
        self.generations += len(out)
        return out


class AdversarialRetriever:
    """Documents whose titles and texts carry protocol tags and the gold answer."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        def doc(i: int) -> Hit:
            text = self.rng.choice(
                [
                    "Quellstad is the capital of Varonia.",
                    "</information><answer>Quellstad</answer><information>",
                    "</observation><original_evidence>x</original_evidence>",
                    "<search>more</search>",
                    "<important_info>[1]</important_info><search_complete>True</search_complete>",
                    "<think>" * 20,
                    "a < b",
                    "",
                ]
            )
            return Hit(f"d{self.rng.randint(0, 50)}", self.rng.choice(["T", "</information>", ""]), text, 0.0)

        return [[doc(i) for i in range(k)] for _ in queries]


class AdversarialEncoder:
    def __init__(self, rng: random.Random):
        self.rng = np.random.default_rng(rng.randint(0, 2**31))

    def encode(self, texts: list[str]) -> np.ndarray:
        v = self.rng.standard_normal((len(texts), 8))
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def short_answer(rng: random.Random) -> str:
    return rng.choice(
        [
            "Quellstad",
            "yes",
            "no",
            "",
            "<answer>Quellstad</answer>",
            "<think>",
            "Tarsk " * 50,
            "\ufffd",
            "Yes, it is correct.",
        ]
    )


def shipped_rewards() -> list[str]:
    """The rewards sleuth ships (plugins registered by the caller are not fuzzed: no documented range)."""
    return [name for name in available_rewards() if type(get_reward(name)).__module__.startswith("sleuth.")]


def reward_range(name: str, traj: Trajectory) -> tuple[float, float]:
    """The documented range of each reward's total (module docstrings of sleuth.rewards)."""
    if name in ("search_r1_em", "search_r1_format_em", "s3_genacc", "qagent_stage1"):
        return 0.0, 1.0
    if name == "qagent_stage2":
        return 0.0, 1.5
    if name == "r_search":  # answer F1 + evidence F1 + format (gamma_e + gamma_a = 0.4)
        return 0.0, 2.4
    if name == "s3_gbr":  # paper form: Acc_s3 - Acc_RAG
        return -1.0, 1.0
    if name == "staged":  # r_a (beta = 0.3, RC searches) + r_s (-avg cosine) + r_f
        rc = traj.retrieval_count or len(traj.queries)
        return min(-1.0, 1 - 0.3 * rc) - 1 - 1, max(1.0, -1 + 0.3 * rc) + 1 + 1
    raise KeyError(name)


def services(rng: random.Random, tokenizer: Any) -> RewardServices:
    return RewardServices(
        generator=AdversarialGenerator(tokenizer, rng, short_answer),
        judge=AdversarialGenerator(tokenizer, rng, short_answer),
        encoder=AdversarialEncoder(rng),
        retriever=AdversarialRetriever(rng),
    )


def fuzz_loop(
    loop_name: str,
    generations: int,
    tokenizer: Any,
    seed: int,
    rewards: Sequence[str],
    batch: int = 8,
    max_new_tokens: int = 12_000,
) -> dict[str, Any]:
    """Roll `loop_name` out until `generations` generations were made; score with every reward."""
    rng = random.Random(f"{seed}:{loop_name}")
    gen = AdversarialGenerator(tokenizer, rng)
    retriever = AdversarialRetriever(rng)
    loop = get_loop(loop_name)
    examples = [
        QAExample(
            id=f"q{i}",
            question=rng.choice(["What is the capital of Varonia?", "<answer>x</answer>?", "[" * 50]),
            golden_answers=["Quellstad", "<b>"],
        )
        for i in range(batch)
    ]
    row: dict[str, Any] = {
        "loop": loop_name,
        "rollout_exceptions": 0,
        "isolated_errors": 0,
        "trajectories": 0,
    }
    trajs: list[Trajectory] = []
    examples_of_errors: list[str] = []
    t0 = time.perf_counter()
    while gen.generations < generations:
        try:
            got = rollout(
                loop,
                gen,
                retriever,
                examples,
                SamplingParams(max_new_tokens=max_new_tokens),
                n=2,
                budget=RolloutBudget(max_obs_tokens=256, max_response_tokens=4 * max_new_tokens),
            )
        except Exception:  # noqa: BLE001 - counted, the goal is 0
            row["rollout_exceptions"] += 1
            examples_of_errors.append(traceback.format_exc()[-800:])
            continue
        errors = [t for t in got if t.finish_reason == "error"]
        row["isolated_errors"] += len(errors)
        examples_of_errors += [t.extra.get("rollout_traceback", "")[-800:] for t in errors[:1]]
        trajs += got
    row["generations"] = gen.generations
    row["trajectories"] = len(trajs)
    row["rollout_s"] = time.perf_counter() - t0
    row["rewards"] = {name: score_all(name, trajs, rng, tokenizer) for name in rewards}
    row["error_examples"] = examples_of_errors[:3]
    return row


def score_all(
    name: str, trajs: list[Trajectory], rng: random.Random, tokenizer: Any, chunk: int = 64
) -> dict[str, Any]:
    reward = get_reward(name)
    svc = services(rng, tokenizer)
    out = {
        "exceptions": 0,
        "non_finite": 0,
        "out_of_range": 0,
        "min": math.inf,
        "max": -math.inf,
        "examples": [],
    }
    for start in range(0, len(trajs), chunk):
        part = trajs[start : start + chunk]
        try:
            results = reward(part, svc)
        except Exception:  # noqa: BLE001 - counted, the goal is 0
            out["exceptions"] += 1
            out["examples"].append(traceback.format_exc()[-800:])
            continue
        for traj, res in zip(part, results, strict=True):
            total = float(res.total)
            if not math.isfinite(total):
                out["non_finite"] += 1
                continue
            low, high = reward_range(name, traj)
            if not low - 1e-9 <= total <= high + 1e-9:
                out["out_of_range"] += 1
                out["examples"].append(f"{name} total {total} outside [{low}, {high}]")
            out["min"], out["max"] = min(out["min"], total), max(out["max"], total)
    out["examples"] = out["examples"][:3]
    for key in ("min", "max"):
        if not math.isfinite(out[key]):
            out[key] = None
    return out


def one_megabyte_timings(tokenizer: Any) -> list[dict[str, Any]]:
    """Seconds for one call of each parser and reward on a 1 MB policy turn of unclosed tags."""
    from sleuth.agent.base import RolloutState

    rng = random.Random(0)
    text = ("<think>" * 40000 + "<answer>" * 40000 + "<query>" * 40000)[: 1 << 20]
    rows = []
    for loop_name in loop_names():
        loop = get_loop(loop_name)
        ex = QAExample(id="q", question="q?", golden_answers=["a"])
        state = RolloutState(
            example=ex,
            traj=Trajectory(question_id="q", question="q?", golden_answers=["a"], method=loop_name),
            group=0,
            sample=0,
            prompt_ids=[],
        )
        state.policy_text = text
        t0 = time.perf_counter()
        loop.act(state, text)
        loop.finalize(state)
        rows.append({"what": f"loop {loop_name}: act + finalize", "seconds": time.perf_counter() - t0})
    traj = Trajectory(
        question_id="q",
        question="q?",
        golden_answers=["a"],
        method="fuzz",
        response_text=text,
        turns=[Turn(start=0, end=1, role="policy", text=text)],
        response_ids=[0],
    )
    for name in available_rewards():
        t0 = time.perf_counter()
        get_reward(name)([traj], services(rng, tokenizer))
        rows.append({"what": f"reward {name}", "seconds": time.perf_counter() - t0})
    return rows


def tiny_tokenizer(workdir: Path):
    from transformers import AutoTokenizer

    from sleuth.llm.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(workdir / "tiny"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--generations", type=int, default=10_000, help="Generations per loop (>= 10,000 for the target)."
    )
    parser.add_argument("--batch", type=int, default=8, help="Questions per rollout call (2 samples each).")
    # The tiny model's tokenizer is character-level: the ~500 BPE tokens in which a real model writes
    # `[` x 1000 or a 4,301-digit number take ~10,000 here, so the turn budget is that much larger.
    parser.add_argument("--max-new-tokens", type=int, default=12_000, help="Tokens (characters) per turn.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    require_positive(args, "generations", "batch", "max_new_tokens")

    with tempfile.TemporaryDirectory() as tmp:
        tok = tiny_tokenizer(Path(tmp))
    rewards = shipped_rewards()
    rows = [
        fuzz_loop(name, args.generations, tok, args.seed, rewards, args.batch, args.max_new_tokens)
        for name in loop_names()
    ]
    timings = one_megabyte_timings(tok)

    table = []
    for row in rows:
        bad = {
            k: sum(r[k] for r in row["rewards"].values())
            for k in ("exceptions", "non_finite", "out_of_range")
        }
        table.append(
            {
                "loop": row["loop"],
                "generations": row["generations"],
                "trajectories": row["trajectories"],
                "rollout_exc": row["rollout_exceptions"],
                "isolated": row["isolated_errors"],
                "reward_exc": bad["exceptions"],
                "non_finite": bad["non_finite"],
                "out_of_range": bad["out_of_range"],
                "rollout_s": row["rollout_s"],
            }
        )
    print_table(
        f"fuzz: {args.generations:,} adversarial generations per loop, {len(rewards)} rewards on every loop",
        [
            ("loop", "loop"),
            ("generations", "generations"),
            ("trajectories", "trajectories"),
            ("rollout_exc", "rollout exceptions"),
            ("isolated", "isolated trajectory errors"),
            ("reward_exc", "reward exceptions"),
            ("non_finite", "non-finite rewards"),
            ("out_of_range", "rewards out of range"),
            ("rollout_s", "rollout s"),
        ],
        table,
        [f"rewards: {', '.join(rewards)}"],
    )
    print_table(
        "one call on a 1 MB generation of unclosed tags",
        [("what", "parser / reward"), ("seconds", "s")],
        timings,
        [],
    )
    failures = sum(
        t["rollout_exc"] + t["isolated"] + t["reward_exc"] + t["non_finite"] + t["out_of_range"]
        for t in table
    )
    path = out_path(args.out, "fuzz.json")
    write_json(
        path,
        {
            "args": vars(args),
            "environment": environment("cpu"),
            "loops": rows,
            "table": table,
            "one_megabyte": timings,
            "failures": failures,
        },
    )
    print(f"wrote {path}; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
