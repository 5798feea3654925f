"""A method plugin: a new loop, a new reward and its own reader prompt, registered from outside sleuth.

Named in a recipe (`plugins: [sleuth_test_method]`) it trains; passed as `--plugin
sleuth_test_method` to `sleuth eval` / `sleuth serve-searcher` it evaluates and serves, with no
edit to sleuth itself (tests/test_method_plugin.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sleuth.agent.base import AgentLoop, RolloutState, StepOutcome, first_action, last_block
from sleuth.agent.registry import Method, Reader, register_method
from sleuth.agent.trajectory import Trajectory
from sleuth.retrieval.base import Hit
from sleuth.rewards.base import Reward, RewardResult, RewardServices, register_reward

PROMPT = (
    "Answer the question. Look things up with <lookup> query </lookup>; the results come back in "
    "<found> ... </found>. Give the final answer as <final> answer </final>."
)


@dataclass
class LookupLoop(AgentLoop):
    """Search-R1's protocol with other tags: <lookup> to search, <final> to answer."""

    name: ClassVar[str] = "test_lookup"
    system_template: str | None = PROMPT
    invalid_action_message: str = "\nUse <lookup> query </lookup> or <final> answer </final>.\n"

    def stop_strings(self, state: RolloutState) -> list[str]:
        return ["</lookup>", "</final>"]

    def act(self, state: RolloutState, text: str) -> StepOutcome:
        action = first_action(text, ("lookup", "final"))
        if action is None:
            return StepOutcome(feedback=self.invalid_action_message, invalid=True)
        tag, content = action
        if tag == "final":
            return StepOutcome(done=True, finish_reason="answer")
        return (
            StepOutcome(queries=[content.strip()])
            if content.strip()
            else StepOutcome(feedback=self.invalid_action_message, invalid=True)
        )

    def finalize(self, state: RolloutState) -> None:
        super().finalize(state)
        final = last_block(state.policy_text, "final")
        state.traj.answer = final.strip() if final is not None else None


@register_reward("test_lookup_reward")
@dataclass
class LookupReward(Reward):
    """Half for each search made (at most one), half for the share of even token ids (a signal from step one)."""

    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        out = []
        for t in trajs:
            ids = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
            even = sum(1 for i in ids if i % 2 == 0) / max(1, len(ids))
            searched = float(t.retrieval_count > 0)
            out.append(
                RewardResult(
                    total=0.5 * searched + 0.5 * even, components={"searched": searched, "even": even}
                )
            )
        return out


def notes_prompt(question: str, hits: Sequence[Hit]) -> list[dict]:
    """The plugin's reader prompt: how a frozen generator reads the documents this method hands over."""
    notes = "\n".join(f"[{i}] {h.title}: {h.text}" for i, h in enumerate(hits, 1))
    return [{"role": "user", "content": f"Notes:\n{notes}\n\nFrom the notes only, answer: {question}"}]


NOTES_READER = Reader("test-lookup-notes", notes_prompt)


register_method(
    Method(
        loop=LookupLoop,
        title="a test agent with its own tags and reward",
        eval_name="test-lookup",
        default_reward={"name": "test_lookup_reward"},
        reader=NOTES_READER,  # the service's /answer reads its documents with it; it answers itself in eval
    )
)
