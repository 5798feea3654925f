"""Cold-start trajectories (oracle, teacher, chat messages) and SFT on them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sleuth.agent.coldstart import (
    RejectionSampling,
    SFTRecord,
    collect_oracle,
    collect_teacher,
    read_records,
    records_from_messages,
    write_records,
)
from sleuth.agent.engine import RolloutBudget, rollout
from sleuth.agent.oracle import OracleGenerator, oracle_check, question_facts
from sleuth.agent.registry import get_loop
from sleuth.data.formats import read_qa_jsonl
from sleuth.errors import DataFormatError
from sleuth.retrieval import load_retriever
from sleuth.rewards.base import RewardServices, get_reward

LOOPS = ("search_r1", "s3", "r_search", "staged", "qagent")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sleuth.llm.registry import tiny_model_dir

    return AutoTokenizer.from_pretrained(tiny_model_dir())


@pytest.fixture(scope="module")
def world(small_world: Path):
    retriever = load_retriever(small_world / "bm25", corpus=small_world / "corpus.jsonl")
    return retriever, read_qa_jsonl(small_world / "train.jsonl")[:24]


def _oracle_rollout(name, world, tokenizer, seed=0):
    retriever, examples = world
    loop = get_loop(name)
    oracle = OracleGenerator(loop, retriever, tokenizer, examples, seed=seed)
    trajs = rollout(
        loop,
        oracle,
        retriever,
        examples,
        n=1,
        budget=RolloutBudget(max_obs_tokens=512, max_response_tokens=4096),
    )
    return loop, trajs, examples


@pytest.mark.parametrize("name", LOOPS)
def test_oracle_trajectories_pass_the_loops_own_parser_and_format_check(name, world, tokenizer):
    _, trajs, examples = _oracle_rollout(name, world, tokenizer)
    kept = [(t, ex) for t, ex in zip(trajs, examples, strict=True) if oracle_check(t, ex)]
    assert len(kept) >= len(examples) // 2  # top-1 retrieval (qagent) misses some passages
    for traj, ex in kept:
        assert traj.invalid_actions == 0, traj.response_text
        assert not traj.forced_final
        assert traj.retrieval_count >= len({f.doc_id for f in question_facts(ex)}) - (
            1 if name == "s3" else 0
        )
        if name == "s3":
            assert traj.finish_reason == "search_complete" and traj.extra["search_complete"]
            assert (
                traj.response_text.count("<query>") >= 1
            )  # it searches, even when the initial window sufficed
            assert not traj.extra.get("invalid_selection_ids") and not traj.extra.get("query_not_json")
        else:
            assert traj.finish_reason == "answer"
        if name in ("staged", "qagent"):
            assert traj.extra["format_ok"], traj.response_text
        if name == "r_search":
            assert traj.extra["evidence_ok"] and traj.extra["answer_ok"]
            assert traj.evidence and all(s in traj.response_text for s in traj.evidence.splitlines())


@pytest.mark.parametrize(
    ("name", "reward", "options", "expected"),
    [
        ("search_r1", "search_r1_em", {}, 1.0),
        ("search_r1", "search_r1_format_em", {}, 1.0),
        ("qagent", "qagent_stage1", {}, 1.0),
        ("staged", "staged", {"correctness": "em"}, None),
    ],
)
def test_kept_oracle_trajectories_earn_the_methods_reward(name, reward, options, expected, world, tokenizer):
    _, trajs, examples = _oracle_rollout(name, world, tokenizer)
    kept = [t for t, ex in zip(trajs, examples, strict=True) if oracle_check(t, ex)]
    fn = get_reward(reward, **options)
    services = RewardServices(encoder=_BagOfWords(), retriever=world[0])
    results = fn(kept, services)
    if expected is not None:
        assert all(r.total == pytest.approx(expected) for r in results), [r.total for r in results]
    else:  # staged: format +1 and a correct answer always beat a wrong/ill-formed trajectory's reward
        assert all(r.components.get("format", 1.0) > 0 for r in results)
        assert min(r.total for r in results) > 0


class _BagOfWords:
    def encode(self, texts):
        import numpy as np

        vocab = sorted({w for t in texts for w in t.lower().split()})
        m = np.array([[t.lower().split().count(w) for w in vocab] for t in texts], dtype=float)
        return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-9)


def test_oracle_wordings_vary_with_the_seed(world, tokenizer):
    _, a, _ = _oracle_rollout("search_r1", world, tokenizer, seed=0)
    _, b, _ = _oracle_rollout("search_r1", world, tokenizer, seed=1)
    assert sum(x.queries != y.queries for x, y in zip(a, b, strict=True)) >= len(a) // 3


def test_sft_targets_equal_the_rl_action_mask_of_the_same_tokens(world, tokenizer):
    from sleuth.rl.batch import collate
    from sleuth.rl.sft import sft_batch

    retriever, examples = world
    records, stats = collect_oracle(
        get_loop("search_r1"), retriever, tokenizer, examples[:6], budget=RolloutBudget(max_obs_tokens=256)
    )
    assert stats["kept"] == len(records) > 0
    for rec in records:
        assert 0 in rec.loss_mask and 1 in rec.loss_mask  # documents are inserted and masked
        ids, target = sft_batch([rec], pad_id=0, max_length=10**6)
        batch = collate([_as_traj(rec)], pad_id=0)
        n = len(rec.response_ids)
        assert target[0, len(rec.prompt_ids) : len(rec.prompt_ids) + n].tolist() == rec.loss_mask
        assert batch.action_mask[0, :n].long().tolist() == rec.loss_mask
        assert target[0, : len(rec.prompt_ids)].sum() == 0
        assert ids[0, : len(rec.prompt_ids) + n].tolist() == rec.prompt_ids + rec.response_ids


def _as_traj(rec: SFTRecord):
    from sleuth.agent.trajectory import Trajectory

    return Trajectory(
        rec.question_id,
        rec.question,
        rec.golden_answers,
        rec.loop,
        prompt_ids=rec.prompt_ids,
        response_ids=rec.response_ids,
        loss_mask=rec.loss_mask,
    )


def test_records_round_trip_and_bad_lines_name_file_and_line(tmp_path, world, tokenizer):
    records, _ = collect_oracle(get_loop("search_r1"), world[0], tokenizer, world[1][:3])
    path = tmp_path / "t.jsonl"
    assert write_records(path, records) == len(records)
    assert [r.response_ids for r in read_records(path)] == [r.response_ids for r in records]
    good = path.read_text().splitlines()
    cases = {
        "{not json": "not valid JSON",
        json.dumps({**json.loads(good[0]), "loss_mask": [1]}): "loss_mask has 1 entries",
        json.dumps({**json.loads(good[0]), "loop": "nope"}): "unknown loop 'nope'",
        json.dumps({**json.loads(good[0]), "response_ids": "abc"}): "response_ids must be a list",
        json.dumps({"loop": "s3"}): "missing field",
    }
    for bad, message in cases.items():
        broken = tmp_path / "broken.jsonl"
        broken.write_text("\n".join([good[0], bad, *good[1:]]) + "\n")
        with pytest.raises(DataFormatError) as err:
            read_records(broken)
        assert f"{broken}:2" in str(err.value) and message in str(err.value)


def test_chat_messages_import_masks_everything_but_assistant_text(tmp_path, tokenizer):
    path = tmp_path / "m.jsonl"
    conv = {
        "messages": [
            {"role": "user", "content": "Who directed Zvork?"},
            {"role": "assistant", "content": "<search> Zvork director </search>"},
            {"role": "tool", "content": "<information>Doc 1 Zvork was directed by Kvala.</information>"},
            {"role": "assistant", "content": "<answer> Kvala </answer>"},
        ]
    }
    path.write_text(
        json.dumps(conv) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
    )
    with pytest.raises(DataFormatError, match=r"m\.jsonl:2"):
        records_from_messages(path, tokenizer, "search_r1")
    path.write_text(json.dumps(conv) + "\n")
    (rec,) = records_from_messages(path, tokenizer, "search_r1")
    policy = [i for i, m in zip(rec.response_ids, rec.loss_mask, strict=True) if m]
    inserted = [i for i, m in zip(rec.response_ids, rec.loss_mask, strict=True) if not m]
    assert tokenizer.decode(inserted) == conv["messages"][2]["content"]
    assert "<search> Zvork director </search>" in tokenizer.decode(policy)
    assert "Who directed Zvork?" in rec.prompt_text
    with pytest.raises(DataFormatError, match="unknown loop"):
        records_from_messages(path, tokenizer, "nope")


def test_teacher_rejection_sampling_keeps_only_rewarded_trajectories(world, tokenizer):
    from sleuth.llm.scripted import ScriptedGenerator

    retriever, examples = world
    examples = examples[:4]
    right, wrong = examples[0].golden_answers[0], "nobody"

    def script(call) -> str:
        hit = examples[0].question in call.prompt_text
        return f"<answer> {right if hit else wrong} </answer>"

    teacher = ScriptedGenerator(tokenizer, script)
    sampling = RejectionSampling(get_reward("search_r1_em"), RewardServices(), threshold=1.0, n=2)
    kept, stats = collect_teacher(
        get_loop("search_r1"), teacher, retriever, examples, sampling, tokenizer=tokenizer
    )
    assert stats == {"played": 8, "kept": 2}
    assert {r.question_id for r in kept} == {str(examples[0].id)} and all(r.reward == 1.0 for r in kept)


def _sft_recipe(tmp_path: Path, world_dir: Path, data: Path, **sft) -> dict:
    return {
        "name": "sft-test",
        "model": {"policy": "tiny", "lora": {"enabled": False}},
        "data": {"train": str(world_dir / "train.jsonl")},
        "retriever": {"index": str(world_dir / "bm25")},
        "agent": {
            "loop": "s3",
            "top_k": 3,
            "max_new_tokens_per_turn": 48,
            "max_obs_tokens": 128,
            "max_response_tokens": 512,
        },
        "reward": {"name": "search_r1_em"},  # not s3's default (it needs a frozen generator)
        "algorithm": {
            "name": "grpo",
            "n": 4,
            "prompts_per_step": 2,
            "minibatch_size": 8,
            "micro_batch_size": 4,
            "kl": {"coef": 0.0},
        },
        "optim": {"lr": 1e-4},
        "trainer": {"total_steps": 1, "out_dir": str(tmp_path / "run"), "save_every": 1},
        "sft": {"data": str(data), "held_out": 0.25, "micro_batch_size": 8, **sft},
    }


def _format_adherence(generator, world, tokenizer, examples) -> float:
    """Share of greedy rollouts whose first turn is a valid s3 action (complete, or a query to run)."""
    from sleuth.llm.base import SamplingParams

    trajs = rollout(
        get_loop("s3", top_k=3, max_turns=1),
        generator,
        world[0],
        examples,
        SamplingParams(max_new_tokens=48, temperature=0.0),
        budget=RolloutBudget(max_obs_tokens=64, max_response_tokens=256),
    )
    return sum(t.invalid_actions == 0 for t in trajs) / len(trajs)


def test_sft_lowers_heldout_loss_raises_format_adherence_and_resumes(
    tmp_path, small_world, world, tokenizer, monkeypatch
):
    from sleuth.agent import s3 as s3_method
    from sleuth.llm.hf import HFGenerator
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.models import load_policy
    from sleuth.rl.sft import heldout_loss, load_sft_data, run_sft

    retriever, _ = world
    train_q = read_qa_jsonl(small_world / "train.jsonl")
    # the oracle that may stop after the initial search: a format the tiny model learns from 30 examples
    monkeypatch.setattr(s3_method, "S3_FULL_ORACLE", False)
    records, _ = collect_oracle(
        get_loop("s3", top_k=3),
        retriever,
        tokenizer,
        train_q[:40],
        budget=RolloutBudget(max_obs_tokens=128, max_response_tokens=512),
    )
    data = tmp_path / "traj.jsonl"
    write_records(data, records)
    recipe = recipe_from_dict(_sft_recipe(tmp_path, small_world, data, epochs=20, lr=1e-2, batch_size=8))
    import torch

    _, base, _ = load_policy(recipe, torch.device("cpu"))
    train, held = load_sft_data(recipe, base.get_input_embeddings().num_embeddings)
    assert held and not {r.question_id for r in held} & {r.question_id for r in train}
    before = heldout_loss(base, held, tokenizer.pad_token_id, 8, 4096, torch.device("cpu"))
    probe = read_qa_jsonl(small_world / "test.jsonl")[:8]
    adherence_before = _format_adherence(
        HFGenerator(base.eval(), tokenizer=tokenizer), world, tokenizer, probe
    )

    # interrupted after 5 epochs, then resumed to 20 from the checkpoint
    short = recipe_from_dict(_sft_recipe(tmp_path, small_world, data, epochs=5, lr=1e-2, batch_size=8))
    run_sft(short)
    result = run_sft(recipe)
    assert result["metrics"]["sft/heldout_loss"] < 0.6 * before
    from sleuth.agent.searcher import load_searcher

    searcher = load_searcher(result["checkpoint"], device="cpu")
    assert searcher.loop.name == "s3"
    adherence_after = _format_adherence(searcher.generator, world, tokenizer, probe)
    assert adherence_after >= 0.75 > adherence_before
    lines = [json.loads(x) for x in (tmp_path / "run" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))  # every step logged once


def test_sft_refuses_bad_data_before_writing_anything(tmp_path, small_world):
    from sleuth.errors import ConfigError
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.sft import run_sft

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"loop": "qagent", "prompt_ids": [1], "response_ids": [2], "loss_mask": [1]}) + "\n"
    )
    recipe = recipe_from_dict(_sft_recipe(tmp_path, small_world, bad))
    with pytest.raises(ConfigError, match="loop"):
        run_sft(recipe)
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"loop": "s3", "prompt_ids": [1], "response_ids": [10**6], "loss_mask": [1]}))
    with pytest.raises(DataFormatError, match="outside the model's vocabulary"):
        run_sft(recipe_from_dict(_sft_recipe(tmp_path, small_world, huge)))
    assert not (tmp_path / "run").exists()


def _cli(*args: str) -> SimpleNamespace:
    """`sleuth ARGS` in this process (Typer's runner: the command, its messages and exit codes, without a
    fresh interpreter importing torch for each call); returncode/stdout/stderr as subprocess.run gives them."""
    from typer.testing import CliRunner

    from sleuth.cli import app

    result = CliRunner().invoke(app, list(args), terminal_width=300)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def test_trajectories_cli_oracle_teacher_and_messages(tmp_path, small_world):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "model": {"policy": "tiny"},
                "data": {"train": str(small_world / "train.jsonl")},
                "retriever": {"index": str(small_world / "bm25")},
                "agent": {
                    "loop": "search_r1",
                    "max_obs_tokens": 128,
                    "max_response_tokens": 4096,
                    "max_new_tokens_per_turn": 8,
                },
            }
        )
    )
    out = tmp_path / "oracle.jsonl"
    proc = _cli("trajectories", str(recipe), "--out", str(out), "--limit", "6", "--variants", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_records(out)
    assert len(records) == 12 and len({r.question_id for r in records}) == 6

    # a random tiny teacher earns no reward: nothing passes, nothing is written, the message says so
    teacher_out = tmp_path / "teacher.jsonl"
    proc = _cli(
        "trajectories",
        str(recipe),
        "--out",
        str(teacher_out),
        "--source",
        "teacher",
        "--teacher",
        "tiny",
        "--limit",
        "2",
        "--n",
        "2",
    )
    assert proc.returncode == 2 and "no trajectory passed" in proc.stdout and not teacher_out.exists()

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q?"},
                    {"role": "assistant", "content": "<answer> a </answer>"},
                ]
            }
        )
        + "\n"
    )
    proc = _cli(
        "trajectories",
        str(recipe),
        "--out",
        str(tmp_path / "m.jsonl"),
        "--source",
        "messages",
        "--messages",
        str(chats),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_records(tmp_path / "m.jsonl")[0].source == "messages"

    proc = _cli("trajectories", str(recipe), "agent.loop=nope", "--out", str(tmp_path / "x.jsonl"))
    assert proc.returncode == 2 and "agent.loop" in proc.stdout and not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("lora", [False, True])
def test_masked_nll_equals_cross_entropy_over_full_logits(tmp_path, lora):
    """The SFT loss runs the LM head only at target positions; it must equal the textbook loss over
    full (B, L, V) logits, gradients included (LoRA-wrapped too)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sleuth.llm.tiny import build_tiny_model
    from sleuth.rl.sft import masked_nll

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "tiny"), dtype=torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (3, 17))
    target = (torch.rand(3, 17) < 0.4).long()
    target[:, 0] = 0
    nll, n = masked_nll(model, ids, target)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    nll.backward()
    fast_grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()

    logits = model(input_ids=ids).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    reference = -(logp * target[:, 1:]).sum()
    reference.backward()
    assert n == int(target[:, 1:].sum()) and grads
    torch.testing.assert_close(nll, reference, rtol=1e-10, atol=1e-10)
    for fast, ref in zip(fast_grads, [p.grad for p in model.parameters() if p.requires_grad], strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-8, atol=1e-10)


def test_sft_update_does_not_depend_on_the_micro_batch_size(
    tmp_path, small_world, world, tokenizer, monkeypatch
):
    """The GPU profiles run whole SFT batches in one pass (DemoSize.sft_micro): the summed micro-batch losses are
    normalised by the whole batch's target tokens, so 1, 2 or 4 trajectories a pass give the same weights."""
    import torch

    from sleuth.agent import s3 as s3_method

    # the short oracle's trajectories, which the 1e-5 tolerance below was set on (float32 sums over the full
    # oracle's longer ones, with Adam at lr 1e-2, differed by 1.7e-5)
    monkeypatch.setattr(s3_method, "S3_FULL_ORACLE", False)
    from sleuth.rl.config import recipe_from_dict
    from sleuth.rl.models import load_policy
    from sleuth.rl.sft import run_sft

    retriever, _ = world
    records, _ = collect_oracle(
        get_loop("s3", top_k=3),
        retriever,
        tokenizer,
        read_qa_jsonl(small_world / "train.jsonl")[:8],
        budget=RolloutBudget(max_obs_tokens=128, max_response_tokens=512),
    )
    data = tmp_path / "traj.jsonl"
    write_records(data, records)
    weights = {}
    for micro in (1, 2, 4):
        recipe = _sft_recipe(
            tmp_path / f"m{micro}", small_world, data, epochs=2, lr=1e-2, batch_size=4, held_out=0.0
        )
        recipe["sft"]["micro_batch_size"] = micro
        result = run_sft(recipe_from_dict(recipe))
        _, policy, _ = load_policy(
            recipe_from_dict(recipe), torch.device("cpu"), Path(result["checkpoint"]) / "policy"
        )
        weights[micro] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        assert result["metrics"]["sft/tokens"] > 0
    base_recipe = recipe_from_dict(_sft_recipe(tmp_path / "base", small_world, data, batch_size=4))
    _, base, _ = load_policy(base_recipe, torch.device("cpu"))
    moved = max((weights[1][k] - v).abs().max().item() for k, v in base.state_dict().items())
    assert moved > 1e-3  # the runs trained: the weights left the base
    for micro in (2, 4):
        diff = max((weights[micro][k] - weights[1][k]).abs().max().item() for k in weights[1])
        assert diff < 1e-5 * max(1.0, moved), (micro, diff)


@pytest.fixture(scope="module")
def boundary_world(tmp_path_factory: pytest.TempPathFactory):
    """A knowledge-boundary world (`synth --known-fraction 0.5`): all-known, mixed and all-unknown questions."""
    from sleuth.data.synth import generate_world, write_world
    from sleuth.retrieval import build_index

    out = tmp_path_factory.mktemp("boundary")
    write_world(generate_world(300, 80, hops=(1, 3), seed=0, known_fraction=0.5), out, splits=(1.0, 0.0, 0.0))
    build_index(out / "corpus.jsonl", "bm25", out / "bm25")
    return load_retriever(out / "bm25", corpus=out / "corpus.jsonl"), read_qa_jsonl(out / "train.jsonl")


@pytest.mark.parametrize("name", ["staged", "search_r1"])
def test_oracle_answers_all_known_questions_from_memory_and_searches_the_rest(
    name, boundary_world, tokenizer
):
    """On a knowledge-boundary world the staged and Search-R1 oracles do what their prompts say: an all-known question
    is answered without a search (the facts stated from memory, then the gold answer), every other question searches
    each fact; both kinds pass `oracle_check`, a direct answer only when it is right."""
    import dataclasses

    _, trajs, examples = _oracle_rollout(name, boundary_world, tokenizer)
    kinds = {ex.metadata["knowledge"] for ex in examples}
    assert kinds == {"all-known", "mixed", "all-unknown"}
    for traj, ex in zip(trajs, examples, strict=True):
        facts = question_facts(ex)
        if ex.metadata["knowledge"] == "all-known":
            assert traj.retrieval_count == 0 and "<search>" not in traj.response_text, traj.response_text
            assert facts[-1].statement().lower() in traj.response_text.lower()  # it states what it knows
            assert traj.finish_reason == "answer" and traj.invalid_actions == 0
            assert oracle_check(traj, ex)
            wrong = dataclasses.replace(traj, answer="not the answer")
            assert not oracle_check(wrong, ex)
        else:
            assert traj.retrieval_count >= len({f.doc_id for f in facts}) - 1, traj.response_text
        if name == "staged":
            assert traj.extra["format_ok"], traj.response_text
    direct = [t for t, ex in zip(trajs, examples, strict=True) if ex.metadata["knowledge"] == "all-known"]
    searched = [t for t, ex in zip(trajs, examples, strict=True) if ex.metadata["knowledge"] != "all-known"]
    assert len(direct) >= 5 and len(searched) >= 5
