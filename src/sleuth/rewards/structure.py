"""Reading a trajectory's structure from what the *policy* wrote.

A response interleaves policy spans (generated, trained) and env spans (documents or feedback
the environment inserted). Rewards that check format or read the answer must only trust tags
the policy wrote: a retrieved document may contain "<answer>Paris</answer>", and a prompt's
few-shot example may too. Env spans are therefore kept opaque: each is one `env` segment,
classified only by the block it is wrapped in (`<information>...</information>` etc.).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sleuth import tags
from sleuth.agent.trajectory import Trajectory, Turn


@dataclass(frozen=True)
class Segment:
    """One piece of the response, in order.

    kind: "block" (a complete policy `<tag>...</tag>`; `content` is the inside),
          "text" (non-blank policy text outside any block),
          "env" (one inserted span; `tag` is its wrapper tag if it is a single recognised
          block such as information/observation, else None, e.g. an "invalid action" message),
          "unclosed" (a policy block that never closed; `content` is what followed the tag).
    """

    kind: str
    tag: str | None
    content: str


@dataclass
class ParsedResponse:
    segments: list[Segment] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # structural problems (nesting, stray closers...)

    @property
    def well_formed(self) -> bool:
        return not self.errors

    def blocks(self, tag: str) -> list[str]:
        return [s.content for s in self.segments if s.kind == "block" and s.tag == tag]


def response_turns(traj: Trajectory) -> list[Turn]:
    """The turns of a trajectory; a turn-less trajectory is accepted only if nothing was inserted."""
    if traj.turns:
        for t in traj.turns:
            if t.role not in ("policy", "env"):
                raise ValueError(
                    f"trajectory {traj.question_id!r}: turn role {t.role!r} is neither 'policy' nor 'env'"
                )
        return list(traj.turns)
    if not traj.response_text:
        return []
    if traj.retrieval_count or traj.retrieved or traj.num_env_tokens:
        raise ValueError(
            f"trajectory {traj.question_id!r} has inserted text but no turns; rewards need `turns` "
            "to tell policy text from environment text (fill them in the agent loop)"
        )
    return [Turn(start=0, end=len(traj.response_ids), role="policy", text=traj.response_text)]


def policy_spans(traj: Trajectory) -> list[str]:
    return [t.text for t in response_turns(traj) if t.role == "policy"]


def env_spans(traj: Trajectory) -> list[str]:
    return [t.text for t in response_turns(traj) if t.role == "env"]


def policy_tag_blocks(traj: Trajectory, tag: str) -> list[str]:
    """Every complete `<tag>...</tag>` the policy wrote, searched span by span so that a block can
    never be stitched together across an inserted document."""
    out: list[str] = []
    for text in policy_spans(traj):
        out.extend(tags.blocks(text, tag))
    return out


def policy_answer(traj: Trajectory) -> str | None:
    """The last `<answer>` the policy wrote, stripped; None if it wrote none."""
    blocks = policy_tag_blocks(traj, "answer")
    return blocks[-1].strip() if blocks else None


def env_wrapper_tag(text: str, names: Iterable[str]) -> str | None:
    """The tag wrapping an inserted span if the whole span (bar whitespace) is one such block."""
    stripped = text.strip()
    for tag in names:
        opener, closer = f"<{tag}>", f"</{tag}>"
        if (
            len(stripped) >= len(opener) + len(closer)
            and stripped.startswith(opener)
            and stripped.endswith(closer)
            and closer not in stripped[len(opener) : -len(closer)]
        ):
            return tag
    return None


def parse_response(
    traj: Trajectory,
    tags: Iterable[str],
    env_tags: Iterable[str] = ("information",),
    children: Mapping[str, Iterable[str]] | None = None,
) -> ParsedResponse:
    """Split the response into policy blocks, stray policy text and env segments.

    `tags` are the tag names recognised in policy text; `children[t]` names tags allowed nested
    inside a `t` block (kept verbatim in its content, e.g. QAgent's `<query>` in `<search>`).
    Any other nesting, a closer without an opener, an env span inside an open block or a block
    left open at the end is recorded in `errors`.
    """
    tag_list = list(tags)
    child_map = {k: set(v) for k, v in (children or {}).items()}
    all_names = set(tag_list) | {c for v in child_map.values() for c in v}
    # exact tags only, as the upstream format checks split on them (`<answer >` is plain text)
    tag_re = re.compile(
        r"<(/?)(" + "|".join(re.escape(t) for t in sorted(all_names, key=len, reverse=True)) + r")>"
    )
    env_tag_list = list(env_tags)

    parsed = ParsedResponse()
    open_tag: str | None = None
    buf: list[str] = []

    def close_unfinished(reason: str) -> None:
        nonlocal open_tag, buf
        parsed.errors.append(reason)
        parsed.segments.append(Segment("unclosed", open_tag, "".join(buf)))
        open_tag, buf = None, []

    for turn in response_turns(traj):
        if turn.role == "env":
            if open_tag is not None:
                close_unfinished(f"inserted text arrived while <{open_tag}> was still open")
            parsed.segments.append(Segment("env", env_wrapper_tag(turn.text, env_tag_list), turn.text))
            continue
        text = turn.text
        pos = 0
        for m in tag_re.finditer(text):
            between = text[pos : m.start()]
            is_close, name = m.group(1) == "/", m.group(2)
            pos = m.end()
            if open_tag is None:
                if between.strip():
                    parsed.segments.append(Segment("text", None, between))
                if is_close:
                    parsed.errors.append(f"</{name}> without a matching <{name}>")
                elif name not in tag_list:
                    parsed.errors.append(f"<{name}> outside the block it belongs in")
                else:
                    open_tag, buf = name, []
                continue
            buf.append(between)
            if is_close and name == open_tag:
                parsed.segments.append(Segment("block", open_tag, "".join(buf)))
                open_tag, buf = None, []
            elif name in child_map.get(open_tag, ()):
                buf.append(m.group(0))
            else:
                parsed.errors.append(f"{m.group(0)} inside <{open_tag}>")
                buf.append(m.group(0))
        rest = text[pos:]
        if open_tag is not None:
            buf.append(rest)
        elif rest.strip():
            parsed.segments.append(Segment("text", None, rest))
    if open_tag is not None:
        close_unfinished(f"<{open_tag}> never closed")
    return parsed


def symbol_string(parsed: ParsedResponse, symbols: Mapping[str, str], env_symbols: Mapping[str, str]) -> str:
    """Map segments to one letter each so a structure can be checked with a regex.

    Policy blocks map through `symbols` (tag -> letter), env segments through `env_symbols`
    (wrapper tag -> letter). Anything else -- stray text, unclosed blocks, unknown tags, an env
    span that is not a recognised block -- maps to "X", which no allowed structure contains.
    """
    out = []
    for s in parsed.segments:
        if s.kind == "block":
            out.append(symbols.get(s.tag or "", "X"))
        elif s.kind == "env":
            out.append(env_symbols.get(s.tag or "", "X"))
        else:
            out.append("X")
    return "".join(out)
