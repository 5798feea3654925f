"""QAgent rewards (paper 003).

"qagent_stage1" (Eq. 7): R = I{format ok} · EM_s(A*, Â), EM_s the strict exact match of
Search-R1 applied to the agent's own last `<answer>`.
Format ok (the paper: "supports pre-retrieval planning, post-retrieval reflection, and final
answer tags"; the prompt, Table 5: plan before every search, reflect after every information,
1-3 `<query>` per search, answer directly when no more knowledge is needed) means:
  - every policy tag is closed and not nested (only `<query>` may sit inside `<search>`);
  - segments follow `(plan, search, information, reflection)* plan? answer` (regex
    `(?:PSIR)*P?A`, overridable) with nothing but whitespace outside blocks and nothing after
    the answer; `<reflect>` is accepted for `<reflection>`, since the prompt uses both;
  - each search holds 1..`max_queries` non-empty `<query>` blocks and nothing else;
  - every inserted span is an `<information>` block (a "rethink" message means the policy
    produced no valid action, which fails the format).

"qagent_stage2" (Eq. 10): R = EM(A*, Ã) + 0.5 · Hit(τ, A*), where Ã is a frozen generator's
answer from the passages the agent collected (`traj.served_context`) and EM is "relaxed to
non-strict EM": the paper's evaluation defines non-strict EM as "correct if it contains the
gold answer" (Sec. 4.1), so it is cover EM (normalised gold substring of normalised
prediction). Hit = some normalised gold answer is a substring of some normalised passage the
trajectory retrieved (`traj.retrieved`, plus `served_context`). `hit_scope="response"` also
searches the policy's own text, a literal reading of "the entire trajectory contains the gold
answer" that the policy can game by writing candidate answers, hence not the default.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sleuth import tags
from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.llm.base import SamplingParams
from sleuth.retrieval.base import Hit
from sleuth.rewards.answerer import answer_from_documents, check_reader
from sleuth.rewards.base import Reward, RewardResult, RewardServices, check_choice, register_reward
from sleuth.rewards.metrics import cover_exact_match, exact_match, normalize_answer
from sleuth.rewards.structure import parse_response, policy_answer, policy_spans, symbol_string

_QAGENT_SYMBOLS = {"plan": "P", "search": "S", "reflection": "R", "reflect": "R", "answer": "A"}


def search_block_queries(content: str) -> list[str] | None:
    """The queries of one `<search>` block, or None if it holds anything besides `<query>` blocks."""
    queries: list[str] = []
    pos = 0
    for block in tags.iter_blocks(content, "query"):
        if content[pos : block.start].strip():
            return None
        queries.append(block.content.strip())
        pos = block.end
    if content[pos:].strip():
        return None
    return queries


def qagent_format_ok(traj: Trajectory, max_queries: int = 3, pattern: str = r"(?:PSIR)*P?A") -> bool:
    parsed = parse_response(
        traj,
        tags=("plan", "search", "information", "reflection", "reflect", "answer"),
        env_tags=("information",),
        children={"search": ("query",)},
    )
    if not parsed.well_formed:
        return False
    if re.fullmatch(pattern, symbol_string(parsed, _QAGENT_SYMBOLS, {"information": "I"})) is None:
        return False
    for content in parsed.blocks("search"):
        queries = search_block_queries(content)
        if queries is None or not (1 <= len(queries) <= max_queries) or not all(queries):
            return False
    return True


def trajectory_hit(traj: Trajectory, scope: str = "retrieved") -> bool:
    """Some gold answer (normalised) occurs in a retrieved passage (or, scope="response", also in
    the policy's own text)."""
    texts = [Hit.from_dict(h).contents for hits in traj.retrieved for h in hits]
    texts += [Hit.from_dict(h).contents for h in traj.served_context]
    if scope == "response":
        texts += policy_spans(traj)
    golds = [g for g in (normalize_answer(a) for a in traj.golden_answers) if g]
    norm_texts = [normalize_answer(t) for t in texts]
    return any(g in t for t in norm_texts for g in golds)


@register_reward("qagent_stage1")
@dataclass
class QAgentStage1(Reward):
    components: ClassVar[tuple[str, ...] | None] = ("format_ok", "em")
    max_queries: int = 3
    format_pattern: str = r"(?:PSIR)*P?A"

    def __post_init__(self) -> None:
        if self.max_queries < 1:
            raise ConfigError(f"reward option max_queries must be >= 1, got {self.max_queries}")

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        results = []
        for traj in trajs:
            fmt = qagent_format_ok(traj, self.max_queries, self.format_pattern)
            em = exact_match(policy_answer(traj), traj.golden_answers)
            results.append(RewardResult(float(fmt) * em, {"format_ok": float(fmt), "em": em}))
        return results


@register_reward("qagent_stage2")
@dataclass
class QAgentStage2(Reward):
    components: ClassVar[tuple[str, ...] | None] = ("generator_cover_em", "hit")
    hit_weight: float = 0.5
    hit_scope: str = "retrieved"  # "retrieved" | "response"
    template: str = "qagent"
    generator_max_new_tokens: int = 128
    generator_temperature: float = 0.0

    def __post_init__(self) -> None:
        check_choice("hit_scope", self.hit_scope, ("retrieved", "response"))
        check_reader("template", self.template)

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        services = services or RewardServices()
        if not trajs:
            return []
        generator = services.need("generator", self.name)
        answers = answer_from_documents(
            generator,
            [t.question for t in trajs],
            [t.served_context for t in trajs],
            self.template,
            SamplingParams(
                max_new_tokens=self.generator_max_new_tokens, temperature=self.generator_temperature
            ),
        )
        results = []
        for traj, ans in zip(trajs, answers, strict=True):
            em = cover_exact_match(ans, traj.golden_answers)
            hit = float(trajectory_hit(traj, self.hit_scope))
            results.append(RewardResult(em + self.hit_weight * hit, {"generator_cover_em": em, "hit": hit}))
        return results
