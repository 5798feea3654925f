"""StepSearch (Wang et al. 2025, arXiv 2505.15107) as a sleuth plugin: per search step, a reward for the
information the step's documents add about the gold supporting documents, minus a penalty for documents
already retrieved, on the last token of the step's `<search>` turn; trained with PPO and GAE (its StePPO).

One module, outside sleuth (docs/architecture.md "How to add a method"); it uses sleuth's per-turn rewards
(`RewardResult.turn_rewards`, put on the last policy token of each turn).

Behaviour matched to the public code (StepSearch's verl/utils/reward_score/qa_step.py and main_ppo.py):
- outcome: if the response ends with its last `<answer>...</answer>` block, F1(answer) (normalised tokens,
  rounded to 4 places) + 0.618 x search-key score; otherwise -1 and no step rewards;
- step t (a search whose documents came back): gain_t = mean over gold documents g of
  max(0, c_{t,g} - m_{t-1,g}), c_{t,g} = max over the step's documents of TF-IDF cosine(document, g) (the
  document and every gold document fitted together, scikit-learn's TfidfVectorizer defaults), m the running
  maximum of c over earlier steps; redundancy_t = (documents of step t seen before, in this or an earlier
  step) / (documents of step t); step reward = scale x (gain_t - redundancy_t);
- search-key score: each query is matched to the key group it has the highest F1 with (a later query
  matched to the same group replaces the earlier score); the sum over groups / the number of groups.
- the published code scales step rewards by 0.6 but adds them to a tensor that already holds them, so their
  effective factor is 1.6; `step_reward_scale=1.6` reproduces that, the default is the stated 0.6.
Gold documents: `metadata["support_docs"]` (texts, or dicts with `paragraph_text`) or `metadata["supporting_ids"]`
(sleuth's synthetic world) fetched from the run's retriever; search keys: `metadata["search_keys"]`.
Cold start: Search-R1's oracle (`oracle_format`; the loop is Search-R1's). A generated run (bench/learning.py) takes
its algorithm from `run_sections`. Not GPU-measured yet (docs/results.md has no StepSearch run).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sleuth.agent.base import RolloutState, StepOutcome
from sleuth.agent.registry import Method, RunShape, register_method
from sleuth.agent.search_r1 import SearchR1Loop
from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.retrieval.docstore import passages_by_id
from sleuth.rewards.base import Reward, RewardResult, RewardServices, register_reward
from sleuth.text import normalize_answer

_WORD = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's default token pattern: words of 2+ characters
_SPECIAL = re.compile(r"<\|[^|>]*\|>|</s>")  # chat end-of-turn tokens decoded into the response text


def tfidf_cosines(text: str, golds: Sequence[str]) -> list[float]:
    """Cosine of `text` with each of `golds` in TF-IDF space fitted on [text, *golds], as scikit-learn's
    TfidfVectorizer() (lowercase, 2+ character words, idf = ln((1 + n) / (1 + df)) + 1, l2 norm); 0 for ''."""
    if not text:
        return [0.0] * len(golds)
    docs = [Counter(_WORD.findall(d.lower())) for d in [text, *golds]]
    n = len(docs)
    df = Counter(w for d in docs for w in d)
    idf = {w: math.log((1 + n) / (1 + c)) + 1 for w, c in df.items()}
    vecs = []
    for d in docs:
        v = {w: tf * idf[w] for w, tf in d.items()}
        norm = math.sqrt(sum(x * x for x in v.values()))
        vecs.append({w: x / norm for w, x in v.items()} if norm else {})
    first = vecs[0]
    return [max(0.0, sum(x * g.get(w, 0.0) for w, x in first.items())) for g in vecs[1:]]


def token_f1(prediction: str | None, golds: Sequence[str]) -> float:
    """Max token F1 of the normalised prediction over `golds`, rounded to 4 places (0 for None)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ans = normalize_answer(gold).split()
        overlap = sum((Counter(pred) & Counter(ans)).values())
        if overlap:
            p, r = overlap / len(pred), overlap / len(ans)
            best = max(best, 2 * p * r / (p + r))
    return round(best, 4)


def information_gain_and_redundancy(
    steps: Sequence[Sequence[str]], golds: Sequence[str]
) -> tuple[list[float], list[float]]:
    """Per search step: (gain, redundancy) as described in the module docstring. No gold documents: ([], [])."""
    if not golds:
        return [], []
    gold_norm = [normalize_answer(g) for g in golds]
    best_before = [0.0] * len(golds)
    gains = []
    for docs in steps:
        current = [0.0] * len(golds)
        for doc in docs:
            current = [
                max(c, s)
                for c, s in zip(current, tfidf_cosines(normalize_answer(doc), gold_norm), strict=True)
            ]
        gains.append(sum(max(c - b, 0.0) for c, b in zip(current, best_before, strict=True)) / len(golds))
        best_before = [max(c, b) for c, b in zip(current, best_before, strict=True)]
    redundancy = [0.0] * len(steps)
    seen: set[str] = set()
    for i, docs in enumerate(steps):
        for doc in docs:
            if doc in seen:
                redundancy[i] += 1 / len(docs)
            else:
                seen.add(doc)
    return gains, redundancy


def search_key_score(queries: Sequence[str], keys: Sequence[Sequence[str]]) -> float:
    """The share of key groups the queries match (F1 with the group's best expression)."""
    if not queries or not keys:
        return 0.0
    matched: dict[int, float] = {}
    for query in queries:
        best, group = 0.0, -1
        for g, expressions in enumerate(keys):
            score = token_f1(query, list(expressions))
            if score > best:
                best, group = score, g
        if group >= 0:  # a later query matched to the same group replaces the earlier score, as published
            matched[group] = best
    return sum(matched.values()) / len(keys)


def ends_with_answer(response: str) -> bool:
    """The response's last `<answer>...</answer>` block is its end (whitespace and chat end tokens aside)."""
    blocks = list(re.finditer(r"<answer>.*?</answer>", response, re.DOTALL))
    return bool(blocks) and not _SPECIAL.sub("", response[blocks[-1].end() :]).strip()


@dataclass
class StepSearchLoop(SearchR1Loop):
    """Search-R1's protocol; it records which policy turn asked each search (`extra["search_turns"]`) and the
    example's gold documents and search keys, for the step rewards."""

    name: ClassVar[str] = "stepsearch"

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        outcome = super().act(state, text)
        if outcome.queries and not state.final:  # the forced last turn's searches are never run
            turn = sum(1 for t in state.traj.turns if t.role == "policy") - 1
            state.traj.extra.setdefault("search_turns", []).append(turn)
        return outcome

    def finalize(self, state: RolloutState) -> None:
        super().finalize(state)
        meta = state.example.metadata
        for key in ("support_docs", "supporting_ids", "search_keys"):
            if key in meta:
                state.traj.extra[key] = meta[key]


def _gold_documents(traj: Trajectory, services: RewardServices | None) -> list[str]:
    docs = traj.extra.get("support_docs")
    if docs is not None:
        return [d["paragraph_text"] if isinstance(d, dict) else str(d) for d in docs]
    ids = traj.extra.get("supporting_ids")
    if not ids:
        return []
    retriever = services.need("retriever", "stepsearch") if services is not None else None
    if retriever is None:
        raise ValueError("stepsearch: supporting_ids need the run's retriever (an index) to read them")
    try:  # the retriever's own store: a `sleuth index` directory's, behind the trainer's wrappers
        return [h.text for h in passages_by_id(retriever, list(ids)) if h is not None]
    except ConfigError as err:
        raise ValueError(
            f"stepsearch: supporting_ids need a retriever that reads passages by id ({err})"
        ) from None


@register_reward("stepsearch")
@dataclass
class StepSearchReward(Reward):
    """Outcome F1 (+ search keys) at the end, gain - redundancy on each search turn (module docstring)."""

    step_reward_scale: float = 0.6
    search_key_weight: float = 0.618
    information_gain: bool = True
    redundancy_penalty: bool = True

    components: ClassVar[tuple[str, ...]] = (
        "f1",
        "search_key",
        "information_gain",
        "redundancy",
        "answer_last",
    )

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        return [self.score(t, services) for t in trajs]

    def score(self, traj: Trajectory, services: RewardServices | None) -> RewardResult:
        f1 = token_f1(traj.answer, traj.golden_answers)
        if not ends_with_answer(traj.response_text):
            return RewardResult(
                -1.0,
                {"f1": f1, "search_key": 0.0, "information_gain": 0.0, "redundancy": 0.0, "answer_last": 0.0},
            )
        search_turns = traj.extra.get("search_turns", [])
        steps = [[h["text"] for h in hits] for hits in traj.retrieved[traj.initial_queries :]]
        gains, redundancy = information_gain_and_redundancy(steps, _gold_documents(traj, services))
        keys = search_key_score(traj.queries[traj.initial_queries :], traj.extra.get("search_keys") or [])
        policy_turns = sum(1 for t in traj.turns if t.role == "policy" and t.end > t.start)
        turn_rewards = [0.0] * policy_turns
        # searches pair with their turns in order; a search cut off by the length budget has no documents (zip stops)
        for turn, gain, penalty in zip(search_turns, gains, redundancy, strict=False):
            step = (gain if self.information_gain else 0.0) - (penalty if self.redundancy_penalty else 0.0)
            turn_rewards[turn] += self.step_reward_scale * step
        total = f1 + self.search_key_weight * keys
        return RewardResult(
            total,
            {
                "f1": f1,
                "search_key": keys,
                "information_gain": sum(gains),
                "redundancy": sum(redundancy),
                "answer_last": 1.0,
            },
            turn_rewards,
        )


# StePPO: PPO with a critic, GAE over the token rewards (gamma = lam = 1): the step rewards need it
ALGORITHM: dict[str, Any] = {"name": "ppo", "advantage": "gae", "gamma": 1.0, "lam": 1.0}


def run_sections(shape: RunShape) -> dict[str, Any]:
    """A generated run's StepSearch sections (`Method.recipe_sections`, bench/learning.py): StePPO with one sample
    per question (PPO needs no group) on n times the questions, as many trajectories a step as the GRPO runs."""
    trajectories = shape.prompts_per_step * shape.n
    return {
        "algorithm": {**ALGORITHM, "n": 1, "prompts_per_step": trajectories, "minibatch_size": trajectories}
    }


register_method(
    Method(
        loop=StepSearchLoop,
        title="a Search-R1 agent with per-step information-gain and redundancy "
        "rewards (StepSearch), PPO with GAE",
        eval_name="stepsearch",
        default_reward={"name": "stepsearch"},
        new_tokens_factor=2,
        oracle_format="search_r1",
        recipe_sections=run_sections,
    )
)


def recipe(train: str, **overrides: Any) -> dict[str, Any]:
    """StepSearch's StePPO as a sleuth recipe: PPO with a critic, GAE over the token rewards (gamma = lam = 1)."""
    base: dict[str, Any] = {
        "name": "stepsearch",
        "plugins": ["sleuth_stepsearch"],
        "data": {"train": train},
        "agent": {"loop": "stepsearch", "max_turns": 4, "top_k": 3},
        "reward": {"name": "stepsearch"},
        "algorithm": dict(ALGORITHM),
    }
    return {**base, **overrides}
