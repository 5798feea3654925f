"""Reward interface, the services rewards may call, and the name registry.

A reward is an object called on a *batch* of trajectories (so every frozen-model call for the
batch goes out as one batched request) that returns one `RewardResult` per trajectory. Each
result carries the scalar the trainer optimises (`total`) and every component separately, so
they can be logged. Config values are constructor keyword arguments whose defaults are the
papers' values; `get_reward(name, **config)` builds one by registry name.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.llm.base import Generator
from sleuth.retrieval.base import Retriever


@dataclass
class RewardResult:
    total: float
    components: dict[str, float] = field(default_factory=dict)


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


@dataclass
class RewardServices:
    """Frozen models and resources a reward may need; each is None when not configured.

    generator: answers from documents/evidence (s3, R-Search cross-family model, QAgent stage 2).
    judge: yes/no correctness judge (s3 judge_check, staged reward B.4 judge).
    encoder: sentence encoder, `encode(list[str]) -> np.ndarray` (staged query diversity).
    retriever: used for s3's naive-RAG baseline (top-k for the question itself).
    baseline_cache: persistent per-question baseline accuracy (s3 GBR).
    """

    generator: Generator | None = None
    judge: Generator | None = None
    encoder: Encoder | None = None
    retriever: Retriever | None = None
    baseline_cache: ScoreCacheLike | None = None

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

    @abstractmethod
    def __call__(
        self, trajs: Sequence[Trajectory], services: RewardServices | None = None
    ) -> list[RewardResult]:
        """Score a batch; one result per trajectory, in order."""

    def set_step(self, step: int) -> None:
        """Told the current trainer step before each batch; rewards with a schedule override it."""
        if step < 0:
            raise ValueError(f"trainer step must be >= 0, got {step}")

    def config(self) -> dict[str, Any]:
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {}


_REGISTRY: dict[str, type[Reward]] = {}
R = TypeVar("R", bound=type[Reward])


def register_reward(name: str) -> Callable[[R], R]:
    def deco(cls: R) -> R:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"reward name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str, **config: Any) -> Reward:
    """Build a registered reward; unknown names or config keys raise ConfigError naming them."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    cls = _REGISTRY[name]
    if dataclasses.is_dataclass(cls):
        allowed = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise ConfigError(
                f"reward {name!r} has no option(s) {', '.join(unknown)}; valid options: {', '.join(sorted(allowed))}"
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
    return results


def check_choice(field_name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(f"reward option {field_name}={value!r} is invalid; choose one of {list(choices)}")
