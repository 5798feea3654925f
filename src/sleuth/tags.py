"""Linear-time reading of the `<tag>...</tag>` protocol the agents and rewards share.

Every loop, reward and format check reads tags through these functions. They give the same
answers as the regexes the upstream projects use (`<tag>(.*?)</tag>`, exact tags only: no
attributes, no whitespace inside the brackets), but scan with `str.find`, so a generation full
of unclosed tags costs O(length) instead of O(length^2) (a backtracking regex restarts its lazy
scan at every unclosed opener).

`neutralise_tags` is the other half of the protocol: text the environment inserts (documents)
must never open, close or fake a tag, so every tag-like `<` in it becomes `&lt;`.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TagBlock:
    """One complete block: `text[start:end]` is `<tag>content</tag>`."""

    tag: str
    start: int
    end: int
    content: str


def _check_tag(tag: str) -> None:
    if not tag or "<" in tag or ">" in tag or "/" in tag:
        raise ValueError(f"tag name {tag!r} must be a plain name such as 'answer'")


def iter_blocks(text: str, tag: str) -> Iterator[TagBlock]:
    """Blocks as `re.finditer(r"<tag>(.*?)</tag>", text, re.DOTALL)` finds them: each opener is
    closed by the first closer after it, and scanning resumes after that closer."""
    _check_tag(tag)
    opener, closer = f"<{tag}>", f"</{tag}>"
    pos = 0
    while True:
        start = text.find(opener, pos)
        if start < 0:
            return
        close = text.find(closer, start + len(opener))
        if close < 0:
            return  # no later opener can find a closer either
        end = close + len(closer)
        yield TagBlock(tag, start, end, text[start + len(opener) : close])
        pos = end


def iter_innermost_blocks(text: str, tag: str) -> Iterator[TagBlock]:
    """Blocks whose content holds no opener of the same tag (`<a><a>x</a>` gives `x`), as
    `re.finditer(r"<tag>((?:(?!<tag>).)*?)</tag>", text, re.DOTALL)` finds them."""
    _check_tag(tag)
    opener, closer = f"<{tag}>", f"</{tag}>"
    pos = 0
    while True:
        start = text.find(opener, pos)
        if start < 0:
            return
        close = text.find(closer, start + len(opener))
        if close < 0:
            return
        # the regex fails at every opener that has another opener before the closer; the last one wins
        start = text.rfind(opener, start, close)
        end = close + len(closer)
        yield TagBlock(tag, start, end, text[start + len(opener) : close])
        pos = end


def blocks(text: str, tag: str) -> list[str]:
    """Contents of every complete `<tag>...</tag>` block, in order (upstream's non-greedy regex)."""
    return [b.content for b in iter_blocks(text, tag)]


def innermost_blocks(text: str, tag: str) -> list[str]:
    return [b.content for b in iter_innermost_blocks(text, tag)]


def first_innermost(text: str, tags: Iterable[str]) -> TagBlock | None:
    """The earliest-starting innermost block among `tags`."""
    best: TagBlock | None = None
    for tag in tags:
        found = next(iter_innermost_blocks(text, tag), None)
        if found is not None and (best is None or found.start < best.start):
            best = found
    return best


def tag_sequence(text: str, tags: Iterable[str]) -> list[str]:
    """Names of the complete blocks among `tags` in order, as
    `re.finditer(r"<(a|b)>.*?</\\1>", text, re.DOTALL)` names them."""
    names = list(tags)
    for tag in names:
        _check_tag(tag)
    openers: list[tuple[int, str]] = []
    closers: dict[str, list[int]] = {}
    for tag in names:
        opener, closer = f"<{tag}>", f"</{tag}>"
        openers.extend((m, tag) for m in _find_all(text, opener))
        closers[tag] = list(_find_all(text, closer))
    # two exact openers never start at one position (the ">" ends the name), so the order is total
    openers.sort()
    out: list[str] = []
    pos = 0
    for start, tag in openers:
        if start < pos:
            continue
        ends = closers[tag]
        i = bisect.bisect_left(ends, start + len(tag) + 2)
        if i == len(ends):
            continue  # this opener never closes; the regex moves on to the next opener
        out.append(tag)
        pos = ends[i] + len(tag) + 3
    return out


def _find_all(text: str, needle: str) -> Iterator[int]:
    i = text.find(needle)
    while i >= 0:
        yield i
        i = text.find(needle, i + 1)


# A "<" that starts something a parser could read as a tag: an optional "/", then a name.
_TAG_LIKE = re.compile(r"<(?=/?[A-Za-z_])")


def neutralise_tags(text: str) -> str:
    """Escape every tag-like `<` (`<answer>`, `</information>`, `<query x=1>`) as `&lt;`, so inserted
    text can never open, close or fake a block; other text, such as `a < b`, is kept."""
    return _TAG_LIKE.sub("&lt;", text)
