"""The rollout engine through the real HF backend with the tiny random model: structural checks only."""

from __future__ import annotations

import math

import pytest

from sleuth.agent import get_loop
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.agent.trajectory import read_trajectories, write_trajectories
from sleuth.data.formats import QAExample
from sleuth.llm.base import SamplingParams
from sleuth.retrieval.base import Hit

hf = pytest.importorskip("sleuth.llm.hf")

DOCS = [Hit(f"d{i}", f"Title {i}", f"passage number {i} about Varonia and Quellstad", 0.0) for i in range(4)]


class FixedRetriever:
    def __init__(self):
        self.calls = 0

    def search(self, queries, k):
        self.calls += 1
        return [DOCS[:k] for _ in queries]


class Recorder:
    """Wraps a generator and keeps every (input, output) pair."""

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.pairs: list[tuple[list[int], list[int]]] = []
        self.batch_sizes: list[int] = []

    def generate(self, batch, stop=None, params=None):
        outs = self.inner.generate(batch, stop, params)
        self.batch_sizes.append(len(batch))
        self.pairs.extend((list(b), list(o.token_ids)) for b, o in zip(batch, outs, strict=True))
        return outs


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    from sleuth.llm.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny_hf"))
    return hf.HFGenerator(str(path), device="cpu")


@pytest.mark.parametrize("name", ["search_r1", "s3", "r_search", "staged", "qagent"])
def test_rollout_with_the_real_hf_backend(generator, tmp_path, name):
    gen = Recorder(generator)
    ret = FixedRetriever()
    examples = [
        QAExample("a", "What is the capital of Varonia?", ["Quellstad"]),
        QAExample("b", "Who directed Blue Harbor?", ["Mara Ilves"]),
    ]
    trajs = rollout(
        get_loop(name, max_turns=2),
        gen,
        ret,
        examples,
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=0),
        n=2,
        budget=RolloutBudget(max_obs_tokens=40, max_response_tokens=200),
    )
    assert len(trajs) == 4 and [t.group for t in trajs] == [0, 0, 1, 1]
    assert gen.batch_sizes[0] == 4  # all trajectories generate together
    for t in trajs:
        n = len(t.response_ids)
        assert 0 < n <= 200 and len(t.loss_mask) == n == len(t.logprobs)
        pos = 0
        for turn in t.turns:
            assert turn.start == pos
            pos = turn.end
            lps = t.logprobs[turn.start : turn.end]
            if turn.role == "env":
                assert set(t.loss_mask[turn.start : turn.end]) == {0} and set(lps) == {0.0}
                assert turn.end - turn.start <= 40
            else:
                assert set(t.loss_mask[turn.start : turn.end]) == {1}
                assert all(math.isfinite(x) and x <= 0.0 for x in lps)
        assert pos == n
        # the masked-in ids are exactly the ids the backend sampled for this trajectory, in order
        full = t.prompt_ids + t.response_ids
        chain = sorted({len(i): o for i, o in gen.pairs if full[: len(i) + len(o)] == i + o}.items())
        assert [tok for _, o in chain for tok in o] == [
            x for x, m in zip(t.response_ids, t.loss_mask, strict=True) if m
        ]
        assert t.finish_reason in {"answer", "max_turns", "length", "search_complete"}
    path = tmp_path / "t.jsonl"
    write_trajectories(path, trajs)
    assert [x.to_dict() for x in read_trajectories(path)] == [x.to_dict() for x in trajs]
