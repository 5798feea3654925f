"""The sizes a claim runs at: `cpu` (the tiny model, minutes on 2 cores) and `gpu` (the measured runs).

The staged claim's profiles (a knowledge-boundary world and an injection) live in its own module; the plain-world
claims (r_search, qagent, s3) share `PLAIN_PROFILES`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sleuth.claims.reader import ReaderSettings
from sleuth.demo import GPU, DemoSize


@dataclass(frozen=True)
class ClaimProfile:
    pipeline: DemoSize  # model, world size, SFT and RL sizes (the demo's sizing record)
    splits: tuple[float, float, float]
    lora: bool
    test_questions: int
    accuracy_margin: float  # the EM loss (fraction) still called "not lower"
    known_fraction: float | None = None  # a knowledge-boundary world (staged) or a plain one (None)
    reader: ReaderSettings | None = None  # the trained reader of qagent and s3
    sizes: tuple[int, ...] = ()  # s3: numbers of RL training questions
    seeds: int = 1  # training seeds when --seeds is not given (every arm trained once per seed)
    # an unmet premise stops the run before its arms (unless --force); the cpu profiles rehearse the pipeline with a
    # tiny model that cannot meet a premise, so there it is measured and reported, not enforced
    enforce_premise: bool = True
    min_rl_steps: int = 1  # s3: at least this many GRPO steps at every data size (the paper: 20 steps)


@dataclass(frozen=True)
class StagedProfile(ClaimProfile):
    inject_epochs: int = 3
    inject_lr: float = 3e-4
    inject_batch: int = 16
    # "known" as the injected model answers closed-book (the paper's labels), not as the world marked the facts
    label_by_model: bool = True
    premise_samples: int = 4  # closed-book samples a known question in the premise probe


# the tiny random model on a 40-passage world: every stage runs on 2 CPU cores in a few minutes
CPU_PIPELINE = DemoSize(
    model="tiny",
    passages=40,
    questions=100,
    hops=(1, 2),
    committed_questions=0,
    sft_questions=12,
    sft_epochs=2,
    train_steps=2,
    prompts_per_step=2,
    n=4,
    max_new_tokens=16,
    lr=1e-3,
    eval_questions=30,
)
# sized like bench/learning.py's GPU runs, with 30 RL steps and no committed-searcher check
GPU_PIPELINE = replace(GPU, committed_questions=0, train_steps=30)

# r_search, qagent and s3: LoRA (r_search's evidence model and s3's naive-RAG baseline default to the policy's base,
# which needs adapters) and a trained reader. Three seeds on the GPU: the verdict pools them and needs a noise floor.
PLAIN_PROFILES = {
    "cpu": ClaimProfile(
        pipeline=CPU_PIPELINE,
        splits=(0.6, 0.1, 0.3),
        lora=True,
        test_questions=30,
        accuracy_margin=0.02,
        sizes=(2, 4),
        enforce_premise=False,
        reader=ReaderSettings(model="tiny", distractors=1, epochs=2, lr=3e-3, batch_size=8, lora=False),
    ),
    "gpu": ClaimProfile(
        pipeline=replace(GPU_PIPELINE, questions=8000),
        splits=(0.8, 0.1, 0.1),
        lora=True,
        test_questions=500,
        accuracy_margin=0.02,
        sizes=(25, 100, 400, 1600),
        seeds=3,
        min_rl_steps=20,
        reader=ReaderSettings(model="smollm2-135m-instruct", distractors=2, epochs=2, lr=3e-4, batch_size=16),
    ),
}
