"""HFGenerator against independent references: HF `generate`, a fresh full forward pass, hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from sleuth.errors import ConfigError
from sleuth.llm.base import Generator, SamplingParams
from sleuth.llm.decoding import left_pad, positions_from_mask, select_next_tokens, top_p_filter
from sleuth.llm.hf import (
    HFGenerator,
    first_stop_in,
    normalise_stops,
    stop_window,
)
from sleuth.llm.tiny import build_tiny_model

PROMPTS = [
    "The quick brown fox",
    "<answer> Quellstad </answer> and then the capital of Varonia is",
    "0 1",
]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model_and_tok(tiny_dir):
    """The tiny model with large random weights: its init weights make every prompt repeat one token,
    which would hide padding and position bugs; these weights give varied continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=rng) * 0.3)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module", params=["dynamic", "static"])
def gen(request, model_and_tok):
    model, tok = model_and_tok
    return HFGenerator(model, tokenizer=tok, cache=request.param)


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF's own generate on one unpadded prompt, no EOS stopping."""
    inp = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def full_forward_logprobs(
    model, prompt_ids: list[int], gen_ids: list[int], temperature: float = 1.0
) -> list[float]:
    seq = torch.tensor([prompt_ids + gen_ids])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logp[start + i, t].item() for i, t in enumerate(gen_ids)]


# -- pure helpers --------------------------------------------------------------------------------


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_top_p_filter_hand_computed():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0.5, 0.3} (mass before 0.3 is 0.5 <= 0.7; before 0.15 is 0.8)
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[False, True, False, True]]
    # the most likely token always survives
    assert torch.isfinite(top_p_filter(logits, 1e-9)).tolist() == [[False, True, False, False]]


def test_select_next_tokens_logprobs_are_temperature_scaled():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    tok, lp = select_next_tokens(logits, temperature=0.0, top_p=1.0, generator=None)
    expected = 2.0 - math.log(math.exp(1.0) + math.exp(2.0) + math.exp(0.5))
    assert tok.tolist() == [1] and lp.item() == pytest.approx(expected, abs=1e-6)
    rng = torch.Generator().manual_seed(3)
    tok, lp = select_next_tokens(logits, temperature=0.5, top_p=1.0, generator=rng)
    scaled = [2.0, 4.0, 1.0]
    lse = math.log(sum(math.exp(x) for x in scaled))
    assert lp.item() == pytest.approx(scaled[tok.item()] - lse, abs=1e-6)


def test_stop_helpers():
    assert first_stop_in("abc</search> x </answer>", ["</answer>", "</search>"]) == "</search>"
    assert first_stop_in("nothing", ["</answer>"]) is None
    assert stop_window(["é!"]) == 3 + 2
    assert normalise_stops(["a"], 2) == [["a"], ["a"]]
    assert normalise_stops([["a"], []], 2) == [["a"], []]
    with pytest.raises(ConfigError, match="2 prompts"):
        normalise_stops([["a"]], 2)


# -- generation ----------------------------------------------------------------------------------


def test_is_a_generator(gen):
    assert isinstance(gen, Generator)


def test_greedy_batch_matches_hf_generate_one_by_one(gen, model_and_tok):
    model, _ = model_and_tok
    outs = gen.generate(PROMPTS, params=GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = reference_greedy(model, gen.encode(prompt), GREEDY.max_new_tokens)
        assert out.token_ids == ref
        assert out.finish_reason == "length" and out.stop is None
        assert out.text == gen.decode(out.token_ids)


def test_batch_chunking_gives_same_result(model_and_tok, gen):
    model, tok = model_and_tok
    small = HFGenerator(model, tokenizer=tok, cache=gen.cache_kind, max_batch_size=2)
    assert [o.token_ids for o in small.generate(PROMPTS, params=GREEDY)] == [
        o.token_ids for o in gen.generate(PROMPTS, params=GREEDY)
    ]


def test_logprobs_equal_fresh_full_forward(gen, model_and_tok):
    model, _ = model_and_tok
    for params in (GREEDY, SamplingParams(max_new_tokens=12, temperature=0.7, seed=1)):
        outs = gen.generate(PROMPTS, params=params)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            ref = full_forward_logprobs(model, gen.encode(prompt), out.token_ids, params.temperature)
            assert out.logprobs == pytest.approx(ref, abs=1e-4)


def test_per_sequence_stop_string(gen):
    full = gen.generate(PROMPTS[:2], params=GREEDY)
    stop = gen.decode(full[0].token_ids[:3])
    assert stop.strip() and stop not in full[1].text, "precondition: only the first sequence hits the stop"
    outs = gen.generate(PROMPTS[:2], stop=[stop], params=GREEDY)
    # the first sequence ends at the token completing the stop string, the stop kept in text and ids
    assert outs[0].finish_reason == "stop" and outs[0].stop == stop
    assert outs[0].token_ids == full[0].token_ids[:3]
    assert outs[0].text.endswith(stop)
    # the other continues exactly as without stop strings (also covers dropping the finished row)
    assert outs[1].token_ids == full[1].token_ids and outs[1].finish_reason == "length"

    per_prompt = gen.generate(PROMPTS[:2], stop=[[], [gen.decode(full[1].token_ids[2:5])]], params=GREEDY)
    assert per_prompt[0].token_ids == full[0].token_ids
    assert per_prompt[1].finish_reason == "stop" and per_prompt[1].token_ids == full[1].token_ids[:5]


def test_eos_is_kept_in_ids_but_not_text(model_and_tok, gen):
    model, tok = model_and_tok
    full = gen.generate(PROMPTS, params=GREEDY)
    eos_like = full[2].token_ids[4]  # declare a token the third prompt emits to be EOS
    other = HFGenerator(model, tokenizer=tok, cache=gen.cache_kind)
    other.eos_token_ids = frozenset({eos_like})
    outs = other.generate(PROMPTS, params=GREEDY)
    cut = full[2].token_ids.index(eos_like) + 1
    assert outs[2].finish_reason == "eos" and outs[2].token_ids == full[2].token_ids[:cut]
    assert outs[2].text == gen.decode(full[2].token_ids[: cut - 1])
    for i in (0, 1):
        if eos_like not in full[i].token_ids:
            assert outs[i].token_ids == full[i].token_ids


def test_token_ids_in_token_ids_out(gen, model_and_tok):
    model, _ = model_and_tok
    # Ids one character at a time: not how the tokenizer would encode the text, so any re-tokenising shows.
    chars = [gen.encode(c)[0] for c in "The quick"]
    assert chars != gen.encode("The quick")
    out = gen.generate([chars], params=GREEDY)[0]
    assert out.token_ids == reference_greedy(model, chars, GREEDY.max_new_tokens)
    assert out.logprobs == pytest.approx(full_forward_logprobs(model, chars, out.token_ids), abs=1e-4)
    # a multi-turn continuation: prompt + previous ids + observation ids, fed back as is
    turn2 = chars + out.token_ids + gen.encode(" <information> x </information>")
    out2 = gen.generate([turn2], params=GREEDY)[0]
    assert out2.token_ids == reference_greedy(model, turn2, GREEDY.max_new_tokens)


def test_chat_messages_use_the_chat_template(gen):
    messages = [{"role": "user", "content": "capital of Varonia?"}]
    text = gen.apply_chat_template(messages)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\ncapital of Varonia?" in text
    assert gen.prompt_ids(messages)[0] == gen.tokenizer.convert_tokens_to_ids("<|im_start|>")
    from_messages, from_text = gen.generate([messages, text], params=GREEDY)
    assert from_messages.token_ids == from_text.token_ids


def test_sampling_seed_and_top_p(gen):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
    a = gen.generate(PROMPTS, params=params)
    b = gen.generate(PROMPTS, params=params)
    c = gen.generate(PROMPTS, params=SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    # a vanishing nucleus leaves only the argmax: sampling becomes greedy
    nucleus = gen.generate(
        PROMPTS, params=SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1e-9, seed=1)
    )
    greedy = gen.generate(PROMPTS, params=SamplingParams(max_new_tokens=10, temperature=0.0))
    assert [o.token_ids for o in nucleus] == [o.token_ids for o in greedy]


def test_live_model_uses_current_weights_and_restores_train_mode(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    gen = HFGenerator(model, tokenizer=AutoTokenizer.from_pretrained(tiny_dir))
    model.train()
    before = gen.generate(["The quick"], params=GREEDY)[0]
    assert model.training
    rng = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an in-place update, as an optimizer step does
        for param in model.parameters():
            if param.dim() >= 2:
                param.add_(torch.randn(param.shape, generator=rng) * 0.3)
    after = gen.generate(["The quick"], params=GREEDY)[0]
    assert after.token_ids != before.token_ids
    ids = gen.encode("The quick")
    assert after.token_ids == reference_greedy(model.eval(), ids, GREEDY.max_new_tokens)
    assert after.logprobs == pytest.approx(full_forward_logprobs(model, ids, after.token_ids), abs=1e-4)


def test_loads_from_directory_and_rejects_bad_input(tiny_dir):
    gen = HFGenerator(str(tiny_dir), cache="dynamic")
    assert gen.generate(["The quick"], params=SamplingParams(max_new_tokens=3, temperature=0))[0].token_ids
    with pytest.raises(ConfigError, match="no tokens"):
        gen.generate([""], params=GREEDY)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        gen.generate([[1, 10**6]], params=GREEDY)
    with pytest.raises(ConfigError, match="unsupported prompt"):
        gen.generate([3.5], params=GREEDY)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="compile=True needs cache='static'"):
        HFGenerator(gen.model, tokenizer=gen.tokenizer, cache="dynamic", compile=True)


def test_compiled_decoding_follows_lora_adapter_switching() -> None:
    """The trainer's frozen generator is the policy with adapters disabled, decoded through the
    same (compiled) step: the compiled graph must not replay the adapter-enabled path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.llm.registry import resolve_model_path

    torch.manual_seed(0)
    path = resolve_model_path("tiny")
    tok = AutoTokenizer.from_pretrained(path)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)  # nonzero B
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora).eval()
    prompts = [tok("hello world the").input_ids, tok("a b c d").input_ids]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    runs = {}
    for compiled in (False, True):
        gen = HFGenerator(model, tokenizer=tok, cache="static", compile=compiled)
        on = [g.token_ids for g in gen.generate(prompts, params=params)]
        with model.disable_adapter():
            off = [g.token_ids for g in gen.generate(prompts, params=params)]
        on_again = [g.token_ids for g in gen.generate(prompts, params=params)]
        runs[compiled] = (on, off, on_again)
    assert runs[False][0] != runs[False][1]  # the adapters change the greedy continuation
    assert runs[True] == runs[False]


def test_compiled_decoding_reuses_few_cache_shapes(model_and_tok) -> None:
    """Compiled decoding buckets shapes (batch padded to max_batch_size, length to a power of two) so a
    multi-turn rollout does not recompile for every live-batch size and context length."""
    model, tok = model_and_tok
    gen = HFGenerator(model, tokenizer=tok, cache="static", compile=True, max_batch_size=8)
    eager = HFGenerator(model, tokenizer=tok, cache="static", compile=False, max_batch_size=8)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    batches = [[[5, 6, 7]], [[5, 6, 7, 8], [9, 10]], [[5] * 40, [6] * 3, [7] * 9]]
    for batch in batches:
        got = [g.token_ids for g in gen.generate(batch, params=params)]
        assert got == [g.token_ids for g in eager.generate(batch, params=params)]
    # 1, 2 and 3 live rows all decode as 8 rows; lengths 7..44 share the 256 bucket: one graph
    assert sorted(gen._static_caches) == [(8, 256)]
    # each new shape's one-time compile is counted (a trainer logs it); known shapes add nothing
    compiled = gen.compile_seconds
    assert compiled > 0 and eager.compile_seconds == 0
    gen.generate(batches[1], params=params)
    assert gen.compile_seconds == compiled


def test_static_decoding_reads_tokens_in_chunks_without_changing_them(model_and_tok) -> None:
    """The static path reads sampled tokens back every `sync_every` steps instead of every step; rows
    that finish mid-chunk (stop string, EOS, budget) must end exactly where step-by-step decoding ends
    them, with the same tokens and log-probs, greedy and seeded sampling alike."""
    model, tok = model_and_tok
    step_by_step = HFGenerator(model, tokenizer=tok, cache="static", sync_every=1)
    plain = step_by_step.generate(PROMPTS, params=SamplingParams(max_new_tokens=20, temperature=0.0))
    # stops that end rows at different steps inside a chunk: after 2, 5 and never
    stops = [
        [step_by_step.decode(plain[0].token_ids[1:3])],
        [step_by_step.decode(plain[1].token_ids[3:6])],
        [],
    ]
    eos = {plain[2].token_ids[6]}  # and one row ends on an "EOS" mid-way
    cases = [
        (SamplingParams(max_new_tokens=20, temperature=0.0), stops),
        (SamplingParams(max_new_tokens=13, temperature=1.0, seed=3), None),
        (SamplingParams(max_new_tokens=13, temperature=0.8, top_p=0.9, seed=5), stops),
    ]
    for params, stop in cases:
        reference = None
        for sync_every in (1, 2, 3, 8, 64):
            gen = HFGenerator(model, tokenizer=tok, cache="static", sync_every=sync_every)
            gen.eos_token_ids = frozenset(eos)
            outs = [
                (o.token_ids, o.finish_reason, o.stop, o.text)
                for o in gen.generate(PROMPTS, stop=stop, params=params)
            ]
            logprobs = [o.logprobs for o in gen.generate(PROMPTS, stop=stop, params=params)]
            if reference is None:
                reference, reference_logprobs = outs, logprobs
                continue
            assert outs == reference, (params, sync_every)
            for a, b in zip(logprobs, reference_logprobs, strict=True):
                assert a == pytest.approx(b, abs=1e-6)
        if stop is stops and params.temperature == 0.0:
            assert [r[1] for r in reference] == ["stop", "stop", "eos"]
            assert [len(r[0]) for r in reference] == [3, 6, 7]
    with pytest.raises(ConfigError, match="sync_every"):
        HFGenerator(model, tokenizer=tok, sync_every=0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_grouped_decode_attention_changes_no_token(tmp_path, cache) -> None:
    """Decode steps that attend each key/value head once (GQA, sleuth.llm.attention) give the tokens and
    log-probs of transformers' own SDPA path, padded batch, stop strings and sampling included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from sleuth.llm.attention import GROUPED_DECODE

    tiny = build_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(tiny)
    config = Qwen2Config.from_pretrained(tiny)
    config.num_attention_heads, config.num_key_value_heads = 4, 2  # two query heads per key/value head
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "gqa")

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "gqa", attn_implementation="sdpa").eval()

    plain = HFGenerator(load(), tokenizer=tok, cache=cache)
    grouped = HFGenerator(load(), tokenizer=tok, cache=cache, grouped_decode_attention=True)
    assert grouped.grouped_decode_attention and grouped.model.config._attn_implementation == GROUPED_DECODE
    assert not plain.grouped_decode_attention
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    stop = [plain.decode(plain.generate(PROMPTS[:1], params=greedy)[0].token_ids[4:6])]
    for params, stops in (
        (greedy, None),
        (greedy, stop),
        (SamplingParams(max_new_tokens=12, temperature=1.0, seed=3), None),
    ):
        a = plain.generate(PROMPTS, stop=stops, params=params)
        b = grouped.generate(PROMPTS, stop=stops, params=params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    # a model without GQA is left as it is
    assert not HFGenerator(
        AutoModelForCausalLM.from_pretrained(tiny), tokenizer=tok, grouped_decode_attention=True
    ).grouped_decode_attention
