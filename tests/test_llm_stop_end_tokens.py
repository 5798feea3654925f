"""StopEndTokens: searching for stop strings only after tokens that may complete one finds the same first
stop, at the same token, as searching after every token (the reference: decode the tail after each token).
Checked on tokenizers of the three decoder families sleuth meets (byte-level BPE, SentencePiece-style
Metaspace with byte fallback, WordPiece), on text around stop strings and on random token ids."""

from __future__ import annotations

import random

import pytest

from sleuth.llm.stops import StopEndTokens, first_stop_in, stop_tails, stop_window
from sleuth.llm.tiny import build_tiny_model

TEXTS = [
    "I should look this up. <search> capital of Varonia </search>",
    "<answer> Quellstad </answer> done",
    "x</answer>y</search>",
    "café</search> naïve — 東京。</answer>",
    "a > b >> c </ search> </search",
    "<<<>>> </answer></answer>",
]
STOP_SETS = [["</search>", "</answer>"], ["</answer>"], ["。"], [">>"], ["end\n"], ["</search>", "search>"]]


def _corpus() -> list[str]:
    return (
        TEXTS
        + ["the capital of Varonia is Quellstad", "ab cd ef gh ij kl mn op qr st uv wx yz 0123456789"] * 3
    )


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny"), extra_text=TEXTS))


@pytest.fixture(scope="module")
def metaspace_byte_fallback():
    """Llama-style: BPE with byte fallback, Metaspace pre-tokenizer, Replace/ByteFallback/Fuse/Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        _corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_], show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def wordpiece():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        _corpus(), trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def first_stop_every_token(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """The reference: decode the tail after every token."""
    window = stop_window(stops)
    for n in range(1, len(ids) + 1):
        hit = first_stop_in(tokenizer.decode(ids[max(0, n - window) : n], skip_special_tokens=False), stops)
        if hit is not None:
            return n, hit
    return None


def first_stop_filtered(
    tokenizer, ends: StopEndTokens, ids: list[int], stops: list[str]
) -> tuple[int, str] | None:
    window = stop_window(stops)
    for n, check in enumerate(ends.checks(stops, ids), start=1):
        if check:
            hit = first_stop_in(
                tokenizer.decode(ids[max(0, n - window) : n], skip_special_tokens=False), stops
            )
            if hit is not None:
                return n, hit
    return None


def _sequences(tokenizer, rng: random.Random) -> list[list[int]]:
    size = len(tokenizer)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    for _ in range(60):  # text around stops with random tokens spliced in, and plain random ids
        base = list(rng.choice(seqs))
        for _ in range(rng.randrange(4)):
            base.insert(rng.randrange(len(base) + 1), rng.randrange(size))
        seqs.append(base)
        seqs.append([rng.randrange(size) for _ in range(rng.randrange(1, 40))])
    return seqs


@pytest.mark.parametrize("family", ["byte_level", "metaspace_byte_fallback", "wordpiece"])
def test_filtered_search_finds_the_same_first_stop_as_searching_after_every_token(family, request) -> None:
    tokenizer = request.getfixturevalue(family)
    ends = StopEndTokens(tokenizer)
    rng = random.Random(0)
    found = skipped = 0
    for stops in STOP_SETS:
        for ids in _sequences(tokenizer, rng):
            expected = first_stop_every_token(tokenizer, ids, stops)
            assert first_stop_filtered(tokenizer, ends, ids, stops) == expected, (family, stops, ids)
            found += expected is not None
        if ends.for_stops(stops) is not None:
            skipped += ends.checks(stops, list(range(len(tokenizer)))).count(False)
    # the comparison met real stops, and the filter did skip tokens (else it would test nothing)
    assert found >= 5 and skipped > 0


def test_which_tokens_are_checked(byte_level) -> None:
    ends = StopEndTokens(byte_level)
    stops = ["</search>", "</answer>"]
    (gt,) = byte_level.encode(">", add_special_tokens=False)
    plain = byte_level.encode("the", add_special_tokens=False)
    assert ends.checks(stops, [gt, *plain]) == [True] + [False] * len(plain)
    assert ends.checks(stops, [len(byte_level) + 5, -1]) == [True, True]  # ids the tokenizer does not know
    # a stop ending in whitespace: decoders add and strip spaces around a lone token, so every token is checked
    assert ends.for_stops(["end\n"]) is None and ends.checks(["end\n"], plain) == [True] * len(plain)
    assert ends.for_stops([]) is None


def test_the_filter_can_be_turned_off_for_a_comparison(byte_level, monkeypatch) -> None:
    """SLEUTH_STOP_FILTER=0 (read at import; patched here) checks after every token, the behaviour before."""
    from sleuth.llm import stops as stops_module

    monkeypatch.setattr(stops_module, "FILTER", False)
    plain = byte_level.encode("the", add_special_tokens=False)
    assert StopEndTokens(byte_level).checks(["</search>"], plain) == [True] * len(plain)


def test_stop_tails_are_the_windows_ending_at_the_checked_tokens() -> None:
    """Against slicing the whole sequence, for short and long histories and windows."""
    rng = random.Random(1)
    for _ in range(200):
        generated = [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        new = [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        window = rng.randrange(1, 12)
        checks = [rng.random() < 0.5 for _ in new]
        whole = generated + new
        want = [
            whole[max(0, len(generated) + k + 1 - window) : len(generated) + k + 1]
            for k, c in enumerate(checks)
            if c
        ]
        assert stop_tails(generated, new, window, checks) == want
