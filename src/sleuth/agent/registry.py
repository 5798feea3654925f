"""The method registry: one `Method` per paper, registered once in its own module.

A method is what training, evaluation, serving, the demo and the report ask about an agent: its
names, its loop (prompt and protocol), whether its loop answers and whether its documents are handed
to a frozen generator (and which ones), its reader prompt, its default reward and its oracle planner.
The built-in methods register themselves in sleuth.agent.{search_r1,s3,r_search,staged,qagent}; a
plugin module (`plugins:` in a recipe, `--plugin` on the command line) registers more with
`register_method` and is then trained, evaluated and served like a built-in one.

A `Reader` is a prompt that asks a frozen generator to answer a question from documents. A method
names its own (`Method.reader`: registered with the method, by the reader's name); `register_reader`
adds one on its own. Rewards and evaluation options that name a reader (`template`, `EvalConfig.answer_template`)
look it up with `get_reader`.

    get_loop("s3", top_k=5)   # a loop with the paper's defaults overridden by config
    get_method("search-r1")   # the Method (any alias)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.agent.base import AgentLoop
from sleuth.agent.oracle_plan import OraclePlanner
from sleuth.agent.trajectory import Trajectory
from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit

# Imported on first use, in this order (the order evaluation lists methods in): each module
# registers its method, and importing them here at the top would be circular.
BUILTIN_MODULES = (
    "sleuth.agent.search_r1",
    "sleuth.agent.s3",
    "sleuth.agent.r_search",
    "sleuth.agent.staged",
    "sleuth.agent.qagent",
)


@dataclass(frozen=True)
class RunShape:
    """What a method's `recipe_sections` may size its sections by: the policy's model spec, the run's RL steps,
    its questions per step and the samples per question of its GRPO runs (a method may match their trajectories)."""

    model: str
    total_steps: int
    prompts_per_step: int
    n: int


def served_context(traj: Trajectory) -> list[dict]:
    """The default hand-over: the documents the loop put in `served_context` (hit dicts)."""
    return list(traj.served_context)


@dataclass(frozen=True)
class Reader:
    """A reader prompt: `prompt(question, hits)` -> the chat messages a frozen generator answers."""

    name: str  # how recipes (`reward.options.template`) and `EvalConfig.answer_template` name it
    prompt: Callable[[str, Sequence[Hit]], list[dict]]


@dataclass(frozen=True)
class Method:
    """Everything outside a method's own modules may ask about it."""

    loop: type[AgentLoop]  # the loop class; `loop.name` is the method's name (recipe `agent.loop`)
    title: str  # one line: what the method trains (the demo's report)
    eval_name: str = ""  # the name `sleuth eval --method` and reports use; default: name with '-'
    aliases: tuple[str, ...] = ()
    # the loop ends with an answer of its own (training logs its exact match); s3 only searches
    answers: bool = True
    # the prompt a frozen generator reads this method's handed-over documents with (evaluation of a
    # searcher, the service's /answer); None: the default reader (sleuth.rewards.answerer.DEFAULT_READER)
    reader: Reader | None = None
    # evaluated as a searcher: evaluation scores the reader's answer from its documents, not its own
    evaluated_by_reader: bool = False
    # its trajectory's `evidence` can be answered from by the frozen generator (R-Search's RSTool)
    reads_evidence: bool = False
    # the documents a downstream LLM is handed when the searcher is served (hit dicts)
    hand_over: Callable[[Trajectory], list[dict]] = served_context
    # the reward a recipe for this method names by default (the `reward:` section of a recipe)
    default_reward: Mapping[str, Any] = field(default_factory=lambda: {"name": "search_r1_em"})
    new_tokens_factor: int = 1  # loops that reason before acting write more per turn than s3's queries
    # its oracle planner for cold-start trajectories (sleuth.agent.oracle_plan), None: no oracle
    oracle_planner: OraclePlanner | None = None
    # a registered method whose oracle writes this method's cold start, used when `oracle_planner` is None: a
    # loop with the same protocol (a plugin's Search-R1-shaped loop names "search_r1"); "": no such method
    oracle_format: str = ""
    # the recipe sections a run of this method needs beyond `agent.loop` and `default_reward`, given the run's
    # shape (`RunShape`: a simulated retriever or a tree's batch is sized by it) and merged over a generated recipe
    # (bench/learning.py): e.g. `algorithm.advantage`, `agent.options`, a training `retriever`. None: nothing more
    recipe_sections: Callable[[RunShape], dict[str, Any]] | None = None
    # the demo's changes to `default_reward` for a run directory and a number of steps (sleuth.demo)
    demo_reward: Callable[[Mapping[str, Any], Path, int], dict[str, Any]] | None = None
    # its own training rollout, called by the trainer instead of `sleuth.agent.engine.rollout` with the same
    # arguments (loop, generator, retriever, examples, params, n, *, budget): e.g. tree rollouts that fork
    # trajectories (`engine.rollout_tree`), any number of trajectories per question, adjacent, `group` = the
    # question's index. None: `engine.rollout` (evaluation and serving always roll out with it)
    rollout: Callable[..., list[Trajectory]] | None = None

    @property
    def name(self) -> str:
        return self.loop.name

    @property
    def display_name(self) -> str:
        return self.eval_name or self.name.replace("_", "-")

    def oracle(self) -> OraclePlanner | None:
        """The planner of this method's cold-start oracle: its own, else that of the method `oracle_format` names."""
        if self.oracle_planner is not None or not self.oracle_format:
            return self.oracle_planner
        return get_method(self.oracle_format).oracle_planner

    def build_loop(self, **cfg: Any) -> AgentLoop:
        allowed = self.loop.config_fields()
        unknown = sorted(set(cfg) - set(allowed))
        if unknown:
            raise ConfigError(
                f"loop {self.name!r} has no option(s) {', '.join(unknown)}; its options are: {', '.join(allowed)}"
            )
        return self.loop(**cfg)


_METHODS: dict[str, Method] = {}
_READERS: dict[str, Reader] = {}
_builtins_loaded = False


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register_method(method: Method) -> Method:
    """Register `method` under its name, eval name and aliases; a clash with another method is an error."""
    if not method.name:
        raise ConfigError(
            f"{method.loop.__name__} has no `name`; set `name: ClassVar[str]` on the loop class"
        )
    for key in {method.name, method.display_name, *method.aliases}:
        owner = _METHODS.get(_key(key))
        if owner is not None and owner.loop is not method.loop:
            raise ConfigError(f"method name {key!r} is already taken by {owner.name!r}")
    if method.evaluated_by_reader and method.reader is None:
        raise ConfigError(
            f"method {method.name!r} is evaluated by a reader (evaluated_by_reader) but names none; "
            "set Method.reader"
        )
    if method.reader is not None:
        register_reader(method.reader)
    for key in {method.name, method.display_name, *method.aliases}:
        _METHODS[_key(key)] = method
    return method


def register_reader(reader: Reader) -> Reader:
    """Register a reader prompt under its name; another reader of that name is an error."""
    owner = _READERS.get(reader.name)
    if owner is not None and owner is not reader:
        raise ConfigError(f"reader name {reader.name!r} is already taken by another reader prompt")
    _READERS[reader.name] = reader
    return reader


def get_reader(name: str) -> Reader:
    """A registered reader prompt by name (the methods' readers and any `register_reader` added)."""
    _ensure_builtins()
    reader = _READERS.get(name)
    if reader is None:
        raise ConfigError(
            f"unknown reader prompt {name!r}; choose one of: {', '.join(reader_names())} (a reader "
            "from a plugin module needs it loaded: --plugin MODULE or the recipe's plugins)"
        )
    return reader


def reader_names() -> list[str]:
    _ensure_builtins()
    return sorted(_READERS)


def _ensure_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def load_plugins(modules: Iterable[str]) -> None:
    """Import each plugin module, so the methods and rewards it registers can be named."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(
                f"plugin module {module!r} could not be imported ({err}); put its directory on PYTHONPATH"
            ) from err


def method_plugins(loop: str, plugins: Iterable[str] = ()) -> list[str]:
    """The plugin modules a checkpoint of `loop` needs: `plugins` (the recipe's `plugins:`) and the
    module defining the loop when it is not built in."""
    module = get_method(loop).loop.__module__
    extra = [] if module in BUILTIN_MODULES or module.startswith("sleuth.") else [module]
    return list(dict.fromkeys([*plugins, *extra]))


def load_checkpoint_plugins(plugins: Iterable[str], loop: str, where: str) -> None:
    """Import the plugin modules a checkpoint recorded and check its loop is registered; the error
    names the modules and `--plugin` (a checkpoint from before plugins were recorded names none)."""
    plugins = list(plugins)
    try:
        load_plugins(plugins)
        get_method(loop)
    except ConfigError as err:
        needs = f"plugin module(s) {', '.join(plugins)}" if plugins else "a plugin module"
        raise ConfigError(
            f"{where}: its method {loop!r} comes from {needs}: put the module on PYTHONPATH or pass "
            f"--plugin MODULE ({err})"
        ) from err


def methods() -> list[Method]:
    """Every registered method, built-in ones first in their order, then plugins in registration order."""
    _ensure_builtins()
    unique = list({id(m): m for m in _METHODS.values()}.values())
    builtin_rank = {module: i for i, module in enumerate(BUILTIN_MODULES)}
    return sorted(unique, key=lambda m: builtin_rank.get(m.loop.__module__, len(BUILTIN_MODULES)))


def get_method(name: str) -> Method:
    _ensure_builtins()
    method = _METHODS.get(_key(name))
    if method is None:
        raise ConfigError(
            f"unknown agent loop {name!r}; choose one of: {', '.join(loop_names())} (a method from a plugin "
            "module needs it loaded: pass --plugin MODULE, or name it in the recipe's plugins)"
        )
    return method


def find_method(name: str) -> Method | None:
    """The registered method of that name, or None (a loop built outside the registry)."""
    _ensure_builtins()
    return _METHODS.get(_key(name))


def loop_names() -> list[str]:
    return sorted(m.name for m in methods())


def get_loop(name: str, **cfg: Any) -> AgentLoop:
    return get_method(name).build_loop(**cfg)
