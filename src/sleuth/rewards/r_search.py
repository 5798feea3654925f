"""R-Search reward (paper 001, Sec. 3.2.2): r = r_answer + r_evidence + r_format.

- answer_f1: token F1 of the last `<answer>` the policy wrote (0 without one).
- evidence_f1: token F1 of a frozen cross-family model's answer to the question given only the
  policy's `<original_evidence>` (last block; template Table 5). 0 when there is no evidence.
- format (Eq. 5): (1 - I_S)(γe + γa·I_A) + I_S(γe·I_E + γa·I_A), γe = γa = 0.2, where
  I_S = retrieval was triggered (an `<observation>` was inserted / the loop counted a search),
  I_A = exactly one `<answer>` block, non-empty; I_E = exactly one `<original_evidence>` block,
  non-empty. Blocks are counted in policy text only.

Without a search the paper's formula grants γe whatever the response does with evidence (the
template tells the model to omit it). The public code (qa_f1.py) instead gives a no-search
response that writes evidence anyway neither γe nor an evidence reward; set
`strict_no_search_evidence=True` for that behaviour.

`rules: upstream` scores as the public code does (docs/compatibility.md): F1 rounded to two decimals
and without FlashRAG's yes/no rule (qa_f1.py's `F1_check`: "yes it is" vs "yes" is 0.5, 2/3 is
0.67), an answer "and" earns no format score (the code skips it: the prompt's own
`<answer> and </answer>` reads as that answer), and `strict_no_search_evidence` is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.trajectory import Trajectory
from sleuth.llm.base import SamplingParams
from sleuth.rewards.answerer import answer_from_evidence
from sleuth.rewards.base import Reward, RewardResult, RewardServices, check_choice, register_reward
from sleuth.rewards.metrics import f1_score
from sleuth.rewards.structure import env_spans, env_wrapper_tag, policy_tag_blocks


def rsearch_format_reward(
    searched: bool, answer_ok: bool, evidence_ok: bool, gamma_e: float, gamma_a: float
) -> float:
    """Eq. 5 of the R-Search paper."""
    i_s, i_a, i_e = float(searched), float(answer_ok), float(evidence_ok)
    return (1 - i_s) * (gamma_e + gamma_a * i_a) + i_s * (gamma_e * i_e + gamma_a * i_a)


def retrieval_triggered(traj: Trajectory) -> bool:
    if traj.retrieval_count > 0:
        return True
    return any(env_wrapper_tag(t, ("observation",)) == "observation" for t in env_spans(traj))


@register_reward("r_search")
@dataclass
class RSearchReward(Reward):
    components: ClassVar[tuple[str, ...] | None] = (
        "answer_f1",
        "evidence_f1",
        "format",
        "searched",
        "answer_format_ok",
        "evidence_format_ok",
    )
    gamma_e: float = 0.2
    gamma_a: float = 0.2
    use_evidence_reward: bool = True  # False: the "w/o evidence" ablation's evidence term
    # False: the evidence parts of the format reward off too (the paper's "w/o Evidence" disables the evidence-related
    # rewards "in both the evidence and format reward"): format = gamma_a * I_answer
    use_evidence_format: bool = True
    strict_no_search_evidence: bool = False
    evidence_max_new_tokens: int = 512
    evidence_temperature: float = 0.1
    evidence_top_p: float = 0.9
    rules: str = "sleuth"  # "upstream": R-Search's qa_f1.py (see the module docstring)

    def __post_init__(self) -> None:
        check_choice("rules", self.rules, ("sleuth", "upstream"))

    def _f1(self, pred: str | None, golds: Sequence[str]) -> float:
        if self.rules == "upstream":
            return f1_score(pred, golds, yes_no_rule=False, digits=2)
        return f1_score(pred, golds)

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        services = services or RewardServices()
        rows = []
        for traj in trajs:
            answers = [a.strip() for a in policy_tag_blocks(traj, "answer")]
            evidences = [e.strip() for e in policy_tag_blocks(traj, "original_evidence")]
            searched = retrieval_triggered(traj)
            answer_ok = len(answers) == 1 and bool(answers[0])
            if self.rules == "upstream":
                answer_ok = answer_ok and answers[0] != "and"
            evidence_ok = len(evidences) == 1 and bool(evidences[0])
            evidence = evidences[-1] if evidences and evidences[-1] else None
            strict_no_search = self.strict_no_search_evidence or self.rules == "upstream"
            if not self.use_evidence_format:
                fmt = self.gamma_a * float(answer_ok)
            elif strict_no_search and not searched and evidences:
                # the code scores this as a malformed no-search response: evidence format and reward lost
                fmt = self.gamma_a * float(answer_ok)
                evidence = None
            else:
                fmt = rsearch_format_reward(searched, answer_ok, evidence_ok, self.gamma_e, self.gamma_a)
            answer_f1 = self._f1(answers[-1], traj.golden_answers) if answers else 0.0
            rows.append((traj, answer_f1, evidence, fmt, searched, answer_ok, evidence_ok))

        evidence_f1 = [0.0] * len(rows)
        if self.use_evidence_reward:
            todo = [i for i, r in enumerate(rows) if r[2] is not None]
            if todo:
                generator = services.need("generator", self.name)
                params = SamplingParams(
                    max_new_tokens=self.evidence_max_new_tokens,
                    temperature=self.evidence_temperature,
                    top_p=self.evidence_top_p,
                )
                cf_answers = answer_from_evidence(
                    generator, [rows[i][0].question for i in todo], [rows[i][2] for i in todo], params
                )
                for i, ans in zip(todo, cf_answers, strict=True):
                    evidence_f1[i] = self._f1(ans, rows[i][0].golden_answers)

        results = []
        for (_, answer_f1, _, fmt, searched, answer_ok, evidence_ok), ev_f1 in zip(
            rows, evidence_f1, strict=True
        ):
            results.append(
                RewardResult(
                    answer_f1 + ev_f1 + fmt,
                    {
                        "answer_f1": answer_f1,
                        "evidence_f1": ev_f1,
                        "format": fmt,
                        "searched": float(searched),
                        "answer_format_ok": float(answer_ok),
                        "evidence_format_ok": float(evidence_ok),
                    },
                )
            )
        return results
