"""Reward interface, the services rewards may call, and the name registry.

A reward is an object called on a *batch* of trajectories (so every frozen-model call for the
batch goes out as one batched request) that returns one `RewardResult` per trajectory. Each
result carries the scalar the trainer optimises (`total`) and every component separately, so
they can be logged. Config values are constructor keyword arguments whose defaults are the
papers' values; `get_reward(name, **config)` builds one by registry name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError, SleuthError
from sleuth.llm.base import Generator
from sleuth.retrieval.base import Retriever


@dataclass
class RewardResult:
    """`total`: the outcome, put on the trajectory's last policy token. `turn_rewards`: optional per-turn
    rewards, one per policy turn (`Trajectory.turns` with role "policy", in order), each put on the last
    token of its turn in addition to `total` (sleuth.rl.advantages.turn_token_rewards); empty: outcome only."""

    total: float
    components: dict[str, float] = field(default_factory=dict)
    turn_rewards: list[float] = field(default_factory=list)


@runtime_checkable
class Encoder(Protocol):
    def encode(self, texts: list[str]) -> Any:  # np.ndarray of shape (len(texts), dim), L2-normalised
        ...


@runtime_checkable
class ScoreCacheLike(Protocol):
    """What `sleuth.data.score_cache.ScoreCache` offers: a persistent qid -> float map."""

    def get(self, qid: str) -> float | None: ...

    def set(self, qid: str, value: float) -> None: ...

    def save(self) -> None: ...


@runtime_checkable
class PolicyScorer(Protocol):
    """Teacher-forced scoring with the policy being trained (IGPO's information gain: the policy's probability
    of the gold answer after each turn). `sleuth.rl.batch.PolicyScorer` is the trainer's."""

    def logprobs(self, prefixes: Sequence[Sequence[int]], continuations: Sequence[str]) -> list[list[float]]:
        """Per-token log-probs of each continuation (tokenised alone, no special tokens) given its prefix token ids
        (a trajectory's `prompt_ids + response_ids[:end]`), one batched no-grad pass; temperature 1."""
        ...


@dataclass
class RewardServices:
    """Frozen models and resources a reward may need; each is None when not configured.

    generator: answers from documents/evidence (s3, R-Search cross-family model, QAgent stage 2).
    judge: yes/no correctness judge (s3 judge_check, staged reward B.4 judge).
    encoder: sentence encoder, `encode(list[str]) -> np.ndarray` (staged query diversity).
    retriever: used for s3's naive-RAG baseline (top-k for the question itself).
    baseline_cache: persistent per-question baseline accuracy (s3 GBR).
    policy: the policy itself, scoring strings teacher-forced (`PolicyScorer`); None outside training.
    """

    generator: Generator | None = None
    judge: Generator | None = None
    encoder: Encoder | None = None
    retriever: Retriever | None = None
    baseline_cache: ScoreCacheLike | None = None
    policy: PolicyScorer | None = None

    def need(self, what: str, reward_name: str) -> Any:
        value = getattr(self, what)
        if value is None:
            raise ConfigError(
                f"reward {reward_name!r} needs a {what} (RewardServices.{what} is None); "
                f"configure reward.{what} in the recipe or pick a reward option that does not use it"
            )
        return value


class Reward(ABC):
    """Base class. Subclasses are dataclasses whose fields are their config."""

    name: ClassVar[str] = ""
    # The component names its results may carry, logged as `reward/<name>`: a guard on `reward/x` is checked
    # against them when the recipe loads (sleuth.rl.guard_metrics). None: not declared, any `reward/...` passes.
    components: ClassVar[tuple[str, ...] | None] = None

    @abstractmethod
    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        """Score a batch; one result per trajectory, in order."""

    def set_step(self, step: int) -> None:
        """Told the current trainer step before each batch; rewards with a schedule override it (calling
        `super().set_step(step)`, which tells the listeners added with `on_step`)."""
        if step < 0:
            raise ValueError(f"trainer step must be >= 0, got {step}")
        for listener in getattr(self, "_step_listeners", ()):
            listener(step)

    def on_step(self, listener: Callable[[int], None]) -> None:
        """Call `listener(step)` whenever the trainer sets the step: the one step signal a training step
        sends, which a retriever that wants context hears this way (sleuth.retrieval.base.StepStamped)."""
        # not a dataclass field: it is wiring, not config (config() and get_reward never see it)
        self.__dict__.setdefault("_step_listeners", []).append(listener)

    @property
    def current_stage(self) -> int:
        """The reward stage at the step last set: what the trainer logs (`stage`, `val/stage`), checkpoints
        and compares guard windows within. One stage here; a reward with a schedule (the staged reward)
        overrides it."""
        return 1

    def config(self) -> dict[str, Any]:
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {}


_REGISTRY: dict[str, type[Reward]] = {}
R = TypeVar("R", bound=type[Reward])


def register_reward(name: str) -> Callable[[R], R]:
    def deco(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, Reward)):
            # the trainer calls the declared interface (set_step, current_stage) with no fallback
            raise TypeError(f"reward {name!r}: {cls!r} must subclass sleuth.rewards.base.Reward")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"reward name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def reward_class(name: str) -> type[Reward] | None:
    """The class registered under `name` (None: not registered, e.g. its plugin is not imported)."""
    return _REGISTRY.get(name)


def get_reward(name: str, **config: Any) -> Reward:
    """Build a registered reward; unknown names or config keys raise ConfigError naming them."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    cls = _REGISTRY[name]
    if dataclasses.is_dataclass(cls):
        allowed = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(config) - allowed)
        if unknown:
            close = [
                m for u in unknown for m in difflib.get_close_matches(u, sorted(allowed), n=1, cutoff=0.6)
            ]
            guess = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"reward {name!r} has no option(s) {', '.join(unknown)}; {guess}valid options: {', '.join(sorted(allowed))}"
            )
    return cls(**config)


def score_batch(
    reward: Reward, trajs: Sequence[Trajectory], services: RewardServices | None = None
) -> list[RewardResult]:
    """Run `reward` and record each result in `traj.rewards` ("total" plus every component)."""
    results = reward(trajs, services)
    if len(results) != len(trajs):
        raise RuntimeError(
            f"reward {reward.name!r} returned {len(results)} results for {len(trajs)} trajectories"
        )
    for traj, res in zip(trajs, results, strict=True):
        traj.rewards = {"total": float(res.total), **{k: float(v) for k, v in res.components.items()}}
        traj.turn_rewards = [float(v) for v in res.turn_rewards]
    return results


def guarded_rewards(
    reward: Reward, trajs: Sequence[Trajectory], services: RewardServices | None = None
) -> list[RewardResult]:
    """Score a batch so that one bad trajectory loses only its own reward.

    A trajectory the rollout ended on an error (`finish_reason == "error"`) scores 0 without being
    scored. If the batch call raises anything but a `SleuthError` (a service past its retries, a
    config mistake: those concern every trajectory and propagate), each trajectory is scored alone,
    and one that still raises, or any non-finite total, scores 0 with `extra["reward_error"]` set.
    """
    results: list[RewardResult | None] = [None] * len(trajs)
    todo = [i for i, t in enumerate(trajs) if t.finish_reason != "error"]
    for i in set(range(len(trajs))) - set(todo):
        results[i] = RewardResult(0.0)
    if todo:
        try:
            scored = reward([trajs[i] for i in todo], services)
            if len(scored) != len(todo):
                raise RuntimeError(
                    f"reward {reward.name!r} returned {len(scored)} results for {len(todo)} trajectories"
                )
            pairs = list(zip(todo, scored, strict=True))
        except SleuthError:
            raise
        except Exception:  # noqa: BLE001 - isolate the trajectory at fault below
            pairs = []
            for i in todo:
                try:
                    pairs.append((i, reward([trajs[i]], services)[0]))
                except SleuthError:
                    raise
                except Exception as err:  # noqa: BLE001 - this trajectory's reward is lost, not the batch's
                    trajs[i].extra["reward_error"] = f"{type(err).__name__}: {err}"[:500]
                    pairs.append((i, RewardResult(0.0)))
        for i, res in pairs:
            if not all(math.isfinite(float(v)) for v in [res.total, *res.turn_rewards]):
                trajs[i].extra["reward_error"] = (
                    f"non-finite reward {res.total!r} (turns {res.turn_rewards!r})"
                )
                res = RewardResult(0.0)
            results[i] = res
            # the trainer places them at the turns' ends (sleuth.rl.batch.token_rewards)
            trajs[i].turn_rewards = [float(v) for v in res.turn_rewards]
    return [r if r is not None else RewardResult(0.0) for r in results]


def failed_trajectories(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """Trajectories that lost their rollout or their reward to an unexpected error."""
    return [t for t in trajs if t.finish_reason == "error" or "reward_error" in t.extra]


def check_choice(field_name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"reward option {field_name}={value!r} is invalid; {guess}choose one of {list(choices)}"
        )
