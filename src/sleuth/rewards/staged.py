"""Staged reward, "learning when to search" (paper 002, Sec. 3.3): r = r_a + r_s + r_f.

r_f (Eq. 6): +1 if the response has one of the two allowed structures, else -1:
  think, reflect, answer                          (no retrieval)
  think, (search, information, reflect)+, answer  (retrieval)
Checked as a regex over one letter per segment (T think, R reflect, S search, A answer written
by the policy; I an inserted `<information>` block). Text outside blocks, a policy-written
`<information>`, an unclosed or nested tag, or an inserted span that is not an information
block (e.g. an error message) makes it -1. `format_pattern` overrides the regex.

r_s (Eq. 9), RC = number of searches (`traj.retrieval_count`; the number of queries if unset):
  RC <= 1: 0 if the query is concise, -1 if not (RC = 0 has no query, so it counts as concise);
  RC > 1: -avg_sim, the mean pairwise cosine similarity of the query embeddings. The paper's
  text says "mean of pairwise cosine similarities" but its Eq. 8 divides the sum over i<j by
  N(N-1), i.e. half that mean; `avg_sim="mean"` (default) follows the text, "eq8" the equation.

"Concise" (Sec. 3.3 / prompt B.4: "a brief keyword-based search query ... instead of a natural
language question"; rules "avoid redundant question words, prepositions, and irrelevant
modifiers") is implemented as `ConcisenessRule`: no question word, no filler word (auxiliary
verbs, pronouns, politeness, vague modifiers), no trailing "?", at most `max_prepositions`
prepositions (1 by default, so names like "Frederick of Liège" pass) and at most
`max_query_words` words. The word lists and limits are our reading of the paper; all configurable.

r_a, β = 0.3 (Eqs. 10-11): stage 1: correct -> 1, wrong -> -1 + β·RC;
                           stage 2: correct -> 1 - β·RC, wrong -> -1.
Stage: `stage` (fixed), or with `switch_step` set, stage 1 before that trainer step and stage 2
from it on; the trainer calls `reward.set_step(step)` before scoring each batch.
Correctness: the B.4 LLM judge (`correctness="judge"`, default), or "em", "cover_em", or
"f1" (F1 >= `f1_threshold`). No `<answer>` is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.rewards.answerer import judge_semantic_match
from sleuth.rewards.base import Reward, RewardResult, RewardServices, check_choice, register_reward
from sleuth.rewards.metrics import cover_exact_match, exact_match, f1_score
from sleuth.rewards.structure import parse_response, policy_answer, policy_tag_blocks, symbol_string

QUESTION_WORDS = ("what", "who", "whom", "whose", "when", "where", "why", "how", "which")
FILLER_WORDS = (
    # auxiliaries and modals: the marks of a natural-language question
    "is", "are", "was", "were", "be", "been", "do", "does", "did", "can", "could", "would", "should", "will",
    # pronouns and politeness
    "i", "me", "my", "you", "your", "we", "it", "please",
    # request verbs and vague modifiers that add no retrieval signal
    "find", "tell", "know", "search", "information", "some", "any", "very", "really", "exactly",
    "actually", "specific", "particular", "certain",
)  # fmt: skip
PREPOSITIONS = (
    "of", "in", "on", "at", "for", "to", "from", "with", "by", "about", "into", "during", "before", "after",
    "between", "through", "over", "under", "regarding", "within", "without", "upon", "than",
)  # fmt: skip
_WORD_RE = re.compile(r"\w+(?:['’]\w+)?")


@dataclass(frozen=True)
class ConcisenessRule:
    max_words: int = 10
    max_prepositions: int = 1
    question_words: frozenset[str] = frozenset(QUESTION_WORDS)
    filler_words: frozenset[str] = frozenset(FILLER_WORDS)
    prepositions: frozenset[str] = frozenset(PREPOSITIONS)

    def violations(self, query: str) -> list[str]:
        """Why `query` is not concise (empty list: it is)."""
        words = _WORD_RE.findall(query.lower())
        reasons = []
        if not words:
            reasons.append("empty query")
        if query.strip().endswith("?"):
            reasons.append("ends with '?'")
        reasons += [f"question word {w!r}" for w in words if w in self.question_words]
        reasons += [f"filler word {w!r}" for w in words if w in self.filler_words]
        n_prep = sum(w in self.prepositions for w in words)
        if n_prep > self.max_prepositions:
            reasons.append(f"{n_prep} prepositions (max {self.max_prepositions})")
        if len(words) > self.max_words:
            reasons.append(f"{len(words)} words (max {self.max_words})")
        return reasons

    def is_concise(self, query: str) -> bool:
        return not self.violations(query)


def average_pairwise_similarity(embeddings: np.ndarray, form: str = "mean") -> float:
    """Mean cosine similarity over pairs i < j ("mean"), or Eq. 8's sum / (N(N-1)) ("eq8")."""
    emb = np.asarray(embeddings, dtype=np.float64)
    n = emb.shape[0]
    if n < 2:
        return 0.0
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    unit = np.divide(emb, norms, out=np.zeros_like(emb), where=norms > 0)
    sims = unit @ unit.T
    pair_sum = float(sims[np.triu_indices(n, k=1)].sum())
    return pair_sum / (n * (n - 1) / 2) if form == "mean" else pair_sum / (n * (n - 1))


def staged_answer_reward(correct: bool, rc: int, stage: int, beta: float) -> float:
    """Eqs. 10 (stage 1) and 11 (stage 2)."""
    if stage == 1:
        return 1.0 if correct else -1.0 + beta * rc
    return 1.0 - beta * rc if correct else -1.0


def staged_search_reward(rc: int, concise: bool, avg_sim: float) -> float:
    """Eq. 9."""
    if rc > 1:
        return -avg_sim
    return 0.0 if concise else -1.0


_STAGED_SYMBOLS = {"think": "T", "search": "S", "reflect": "R", "answer": "A"}


@register_reward("staged")
@dataclass
class StagedReward(Reward):
    components: ClassVar[tuple[str, ...] | None] = (
        "r_a",
        "r_s",
        "r_f",
        "correct",
        "rc",
        "stage",
        "concise",
        "avg_sim",
    )
    stage: int = 1
    switch_step: int | None = None
    beta: float = 0.3
    correctness: str = "judge"  # "judge" | "f1" | "em" | "cover_em"
    f1_threshold: float = 0.5
    avg_sim: str = "mean"  # "mean" | "eq8"
    format_pattern: str = r"T(?:R|(?:SIR)+)A"
    max_query_words: int = 10
    max_prepositions: int = 1
    question_words: Sequence[str] | None = None  # None: QUESTION_WORDS
    filler_words: Sequence[str] | None = None  # None: FILLER_WORDS
    prepositions: Sequence[str] | None = None  # None: PREPOSITIONS
    judge_max_new_tokens: int = 16
    _step: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_choice("stage", self.stage, (1, 2))
        check_choice("correctness", self.correctness, ("judge", "f1", "em", "cover_em"))
        check_choice("avg_sim", self.avg_sim, ("mean", "eq8"))
        if self.switch_step is not None and self.switch_step < 0:
            raise ConfigError(f"reward option switch_step must be >= 0, got {self.switch_step}")
        try:
            self._format_re = re.compile(self.format_pattern)
        except re.error as err:
            raise ConfigError(
                f"reward option format_pattern {self.format_pattern!r} is not a regex: {err}"
            ) from err
        self.rule = ConcisenessRule(
            max_words=self.max_query_words,
            max_prepositions=self.max_prepositions,
            question_words=frozenset(w.lower() for w in (self.question_words or QUESTION_WORDS)),
            filler_words=frozenset(w.lower() for w in (self.filler_words or FILLER_WORDS)),
            prepositions=frozenset(w.lower() for w in (self.prepositions or PREPOSITIONS)),
        )

    def set_step(self, step: int) -> None:
        super().set_step(step)
        self._step = step

    @property
    def current_stage(self) -> int:
        if self.switch_step is None or self._step is None:
            return self.stage
        return 1 if self._step < self.switch_step else 2

    def format_ok(self, traj: Trajectory) -> bool:
        parsed = parse_response(traj, tags=("think", "search", "information", "reflect", "answer"))
        if not parsed.well_formed:
            return False
        return (
            self._format_re.fullmatch(symbol_string(parsed, _STAGED_SYMBOLS, {"information": "I"}))
            is not None
        )

    @staticmethod
    def queries_and_rc(traj: Trajectory) -> tuple[list[str], int]:
        queries = list(traj.queries) or [q.strip() for q in policy_tag_blocks(traj, "search")]
        rc = traj.retrieval_count if traj.retrieval_count else len(queries)
        return queries, rc

    def _correct(
        self, trajs: Sequence[Trajectory], answers: list[str | None], services: RewardServices
    ) -> list[bool]:
        if self.correctness != "judge":
            metric = {"em": exact_match, "cover_em": cover_exact_match}.get(self.correctness)
            if metric is not None:
                return [bool(metric(a, t.golden_answers)) for a, t in zip(answers, trajs, strict=True)]
            return [
                a is not None and f1_score(a, t.golden_answers) >= self.f1_threshold
                for a, t in zip(answers, trajs, strict=True)
            ]
        correct = [False] * len(trajs)
        ask = [i for i, a in enumerate(answers) if a is not None]
        if ask:
            judge = services.need("judge", self.name)
            verdicts = judge_semantic_match(
                judge,
                [answers[i] or "" for i in ask],
                [list(trajs[i].golden_answers) for i in ask],
                SamplingParams(max_new_tokens=self.judge_max_new_tokens, temperature=0.0),
            )
            for i, v in zip(ask, verdicts, strict=True):
                correct[i] = v
        return correct

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        services = services or RewardServices()
        stage = self.current_stage
        answers = [policy_answer(t) for t in trajs]
        correct = self._correct(trajs, answers, services)
        qrc = [self.queries_and_rc(t) for t in trajs]

        # one encoder call for every multi-search trajectory in the batch
        sims = [0.0] * len(trajs)
        multi = [i for i, (qs, rc) in enumerate(qrc) if rc > 1 and len(qs) >= 2]
        if multi:
            encoder = services.need("encoder", self.name)
            flat = [q for i in multi for q in qrc[i][0]]
            emb = np.asarray(encoder.encode(flat))
            if emb.shape[0] != len(flat):
                raise RuntimeError(f"encoder returned {emb.shape[0]} embeddings for {len(flat)} queries")
            offset = 0
            for i in multi:
                n = len(qrc[i][0])
                sims[i] = average_pairwise_similarity(emb[offset : offset + n], self.avg_sim)
                offset += n

        results = []
        for i, traj in enumerate(trajs):
            queries, rc = qrc[i]
            concise = all(self.rule.is_concise(q) for q in queries) if rc <= 1 else True
            r_f = 1.0 if self.format_ok(traj) else -1.0
            r_s = staged_search_reward(rc, concise, sims[i])
            r_a = staged_answer_reward(correct[i], rc, stage, self.beta)
            comps = {
                "r_a": r_a,
                "r_s": r_s,
                "r_f": r_f,
                "correct": float(correct[i]),
                "rc": float(rc),
                "stage": float(stage),
            }
            if rc <= 1:
                comps["concise"] = float(concise)
            else:
                comps["avg_sim"] = sims[i]
            results.append(RewardResult(r_a + r_s + r_f, comps))
        return results
