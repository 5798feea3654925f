"""s3 rewards (paper 000): generation accuracy of a frozen generator fed the searcher's documents.

"s3_genacc": GenAcc(G(Q, D_s3)), with D_s3 = `traj.served_context` (the selected documents,
deduplicated, in order, as the loop serves them) and GenAcc = span_check OR judge_check.

"s3_gbr": Gain Beyond RAG = Acc(G(Q, D_s3)) - Acc(G(Q, D_RAG)), D_RAG = top-`rag_k` documents
retrieved for the question itself (paper: k = 3). The baseline term is computed once per
question and stored in `services.baseline_cache` (or, without one, in this reward object), so
the n rollouts of a question and later epochs reuse it. `form="paper"` gives GBR (Eq. 1);
`form="code"` gives GBR + Acc_s3, what the public code optimises (`utility_score +
generation_score` in verl/utils/reward_score/rag_2.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.rewards.answerer import JUDGE_RULES, answer_from_documents, check_reader, gen_acc_batch
from sleuth.rewards.base import Reward, RewardResult, RewardServices, check_choice, register_reward


def _cache_key(traj: Trajectory) -> str:
    return traj.question_id or traj.question


@dataclass
class _S3Base(Reward):
    template: str = "s3"
    use_judge: bool = True  # False: GenAcc is span_check alone (no judge model needed)
    generator_max_new_tokens: int = 128
    generator_temperature: float = 0.0
    judge_max_new_tokens: int | None = None  # None: 16, or s3's 10 under judge_rule: upstream
    # "strict" (sleuth): yes only when the reply clearly says yes; "upstream": s3's code, "yes"
    # anywhere in the reply (docs/compatibility.md)
    judge_rule: str = "strict"

    def __post_init__(self) -> None:
        check_reader("template", self.template)
        check_choice("judge_rule", self.judge_rule, JUDGE_RULES)

    def _judge(self, services: RewardServices) -> Generator | None:
        return services.need("judge", self.name) if self.use_judge else None

    def _gen_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.generator_max_new_tokens, temperature=self.generator_temperature
        )

    def _judge_params(self) -> SamplingParams | None:
        """None: the rule's own (`answerer.judge_contains`)."""
        if self.judge_max_new_tokens is None:
            return None
        return SamplingParams(max_new_tokens=self.judge_max_new_tokens, temperature=0.0)

    def _accuracy(
        self, questions: list[str], golds: list[list[str]], docs: Sequence[Sequence], services: RewardServices
    ) -> tuple[list[float], list[float], list[float | None]]:
        generator = services.need("generator", self.name)
        answers = answer_from_documents(generator, questions, docs, self.template, self._gen_params())
        return gen_acc_batch(
            self._judge(services), questions, golds, answers, self._judge_params(), self.judge_rule
        )

    def _s3_accuracy(self, trajs: Sequence[Trajectory], services: RewardServices):
        return self._accuracy(
            [t.question for t in trajs],
            [list(t.golden_answers) for t in trajs],
            [t.served_context for t in trajs],
            services,
        )


@register_reward("s3_genacc")
@dataclass
class S3GenAcc(_S3Base):
    components: ClassVar[tuple[str, ...] | None] = ("acc_s3", "span_s3", "judge_s3")

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        services = services or RewardServices()
        if not trajs:
            return []
        accs, spans, verdicts = self._s3_accuracy(trajs, services)
        return [
            RewardResult(a, {"acc_s3": a, "span_s3": s, **({} if v is None else {"judge_s3": v})})
            for a, s, v in zip(accs, spans, verdicts, strict=True)
        ]


@register_reward("s3_gbr")
@dataclass
class S3GBR(_S3Base):
    components: ClassVar[tuple[str, ...] | None] = ("acc_s3", "acc_rag", "gbr", "span_s3", "judge_s3")
    form: str = "paper"  # "paper": GBR; "code": GBR + Acc_s3
    rag_k: int = 3
    _memo: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("form", self.form, ("paper", "code"))
        if self.rag_k < 1:
            raise ConfigError(f"reward option rag_k must be >= 1, got {self.rag_k}")

    def baseline_accuracy(self, trajs: Sequence[Trajectory], services: RewardServices) -> dict[str, float]:
        """Acc(G(Q, D_RAG)) per question, computing (in one batch) only those not cached yet."""
        cache = services.baseline_cache
        known: dict[str, float] = {}
        missing: dict[str, Trajectory] = {}
        for t in trajs:
            key = _cache_key(t)
            if key in known or key in missing:
                continue
            value = cache.get(key) if cache is not None else self._memo.get(key)
            if value is None:
                missing[key] = t
            else:
                known[key] = float(value)
        if missing:
            retriever = services.need("retriever", self.name)
            questions = [t.question for t in missing.values()]
            hits = retriever.search(questions, self.rag_k)
            if len(hits) != len(questions):
                raise RuntimeError(f"retriever returned {len(hits)} hit lists for {len(questions)} queries")
            accs, _, _ = self._accuracy(
                questions, [list(t.golden_answers) for t in missing.values()], hits, services
            )
            for key, acc in zip(missing, accs, strict=True):
                known[key] = acc
                if cache is not None:
                    cache.set(key, acc)
                else:
                    self._memo[key] = acc
            if cache is not None:
                cache.save()
        return known

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        services = services or RewardServices()
        if not trajs:
            return []
        baseline = self.baseline_accuracy(trajs, services)
        accs, spans, verdicts = self._s3_accuracy(trajs, services)
        results = []
        for t, a, s, v in zip(trajs, accs, spans, verdicts, strict=True):
            rag = baseline[_cache_key(t)]
            gbr = a - rag
            total = gbr if self.form == "paper" else gbr + a
            comps = {"acc_s3": a, "acc_rag": rag, "gbr": gbr, "span_s3": s}
            if v is not None:
                comps["judge_s3"] = v
            results.append(RewardResult(total, comps))
        return results
