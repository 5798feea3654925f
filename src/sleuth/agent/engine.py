"""The shared multi-turn, batched, token-in/token-out rollout engine.

Every turn, all active trajectories generate together in one `generate` call;
every trajectory that searched this turn is served by one batched
`retriever.search` call per distinct k. Token ids are kept exactly as generated;
inserted text (documents, feedback) is tokenised once and appended as ids, and
the loss mask is written at the same moment (1 policy, 0 inserted), so it never
depends on re-tokenising decoded text.
"""

from __future__ import annotations

import copy
import random
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sleuth.agent.base import AgentLoop, Observation, RolloutState, StepOutcome, fair_shares
from sleuth.agent.trajectory import Trajectory, Turn
from sleuth.data.formats import QAExample
from sleuth.errors import ConfigError
from sleuth.llm.base import Generation, Generator, SamplingParams, shared_prefixes
from sleuth.retrieval.base import Hit, RetrievalContext, Retriever, wants_context
from sleuth.tags import neutralise_tags

# How much of an unexpected error's traceback a trajectory keeps for debugging.
_MAX_TRACEBACK_CHARS = 4000


@dataclass(frozen=True)
class RolloutBudget:
    """Limits of one rollout: an inserted observation is cut to `max_obs_tokens`, a trajectory's
    response to `max_response_tokens`; `max_turns` overrides the loop's own turn limit (None keeps it).
    `deadline_s`: wall-clock seconds from the rollout's start; a trajectory still running at a turn boundary
    past it ends with finish_reason "time_limit" (a turn itself is bounded by its max_new_tokens), so one
    trajectory that keeps searching cannot hold the others of its batch for long (the searcher service)."""

    max_obs_tokens: int = 512
    max_response_tokens: int = 4096
    max_turns: int | None = None
    deadline_s: float | None = None


TIME_LIMIT = "time_limit"  # finish_reason of a trajectory stopped by RolloutBudget.deadline_s


def _tokenizer_of(generator: Generator, tokenizer):
    tok = tokenizer if tokenizer is not None else getattr(generator, "tokenizer", None)
    if tok is None:
        raise ConfigError(
            "rollout needs a tokenizer: pass tokenizer=... or use a generator with a `.tokenizer` attribute "
            "(`sleuth eval --tokenizer DIR` for an openai: model)"
        )
    return tok


def encode_prompt(tokenizer, messages: list[dict]) -> tuple[list[int], str]:
    """Chat-template the initial messages and encode them once; returns (ids, text)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False)), text


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _append(state: RolloutState, ids: list[int], logprobs: list[float], role: str, text: str) -> None:
    traj = state.traj
    if not ids:
        return
    start = len(traj.response_ids)
    traj.response_ids.extend(ids)
    traj.loss_mask.extend([1 if role == "policy" else 0] * len(ids))
    traj.logprobs.extend(logprobs if role == "policy" else [0.0] * len(ids))
    traj.turns.append(Turn(start=start, end=start + len(ids), role=role, text=text))


def _context(ex: QAExample, turn: int) -> RetrievalContext:
    return RetrievalContext(str(ex.id), ex.question, tuple(ex.golden_answers), turn)


def _search_batched(
    retriever: Retriever,
    requests: list[tuple[int, list[str], int]],
    contexts: dict[int, RetrievalContext] | None = None,
) -> dict[int, list[list[Hit]]]:
    """Serve (request id, queries, k) requests with one `search` call per distinct k; identical queries once.
    A retriever that wants context (`RetrievalContext`) gets `contexts[request id]` with each of its queries,
    and identical queries of different requests are asked apart (their contexts differ)."""
    by_k: dict[int, list[tuple[int, list[str]]]] = {}
    for rid, queries, k in requests:
        by_k.setdefault(k, []).append((rid, queries))
    with_context = contexts is not None and wants_context(retriever)
    out: dict[int, list[list[Hit]]] = {}
    for k, reqs in by_k.items():
        if with_context:
            assert contexts is not None
            flat = [(rid, q) for rid, queries in reqs for q in queries]
            results = retriever.search([q for _, q in flat], k, contexts=[contexts[rid] for rid, _ in flat])
            if len(results) != len(flat):
                raise ConfigError(
                    f"retriever returned {len(results)} result lists for {len(flat)} queries; "
                    "Retriever.search must return one list per query"
                )
            it = iter(results)
            for rid, queries in reqs:
                out[rid] = [list(next(it))[:k] for _ in queries]
            continue
        unique: list[str] = []
        index: dict[str, int] = {}
        for _, queries in reqs:
            for q in queries:
                if q not in index:
                    index[q] = len(unique)
                    unique.append(q)
        results = retriever.search(unique, k)
        if len(results) != len(unique):
            raise ConfigError(
                f"retriever returned {len(results)} result lists for {len(unique)} queries; "
                "Retriever.search must return one list per query"
            )
        for rid, queries in reqs:
            out[rid] = [list(results[index[q]])[:k] for q in queries]
    return out


class _Engine:
    def __init__(
        self,
        loop: AgentLoop,
        generator: Generator,
        retriever: Retriever,
        tokenizer,
        params: SamplingParams,
        max_obs_tokens: int,
        max_response_tokens: int,
    ):
        self.loop = loop
        self.generator = generator
        self.retriever = retriever
        self.tok = tokenizer
        self.params = params
        self.max_obs_tokens = max_obs_tokens
        self.max_response_tokens = max_response_tokens
        # turn boundaries a tree rollout may fork at (None: not kept); see rollout_tree
        self.fork_points: list[RolloutState] | None = None

    # -- setup ---------------------------------------------------------------------------------
    def start(self, examples: Sequence[QAExample], n: int) -> list[RolloutState]:
        loop = self.loop
        initial = [loop.initial_queries(ex) for ex in examples]
        initial_hits: dict[int, list[list[Hit]]] = {}
        requests = [(i, qs, loop.top_k) for i, qs in enumerate(initial) if qs]
        if requests:
            contexts = {i: _context(ex, -1) for i, ex in enumerate(examples)}  # before the first generation
            initial_hits = _search_batched(self.retriever, requests, contexts)
        states: list[RolloutState] = []
        for i, ex in enumerate(examples):
            hits = initial_hits.get(i, [])
            messages = loop.build_messages(ex, hits)
            prompt_ids, prompt_text = encode_prompt(self.tok, messages)
            for s in range(n):
                traj = Trajectory(
                    question_id=str(ex.id),
                    question=ex.question,
                    golden_answers=list(ex.golden_answers),
                    method=loop.name,
                    prompt_ids=list(prompt_ids),
                    prompt_text=prompt_text,
                    group=i,
                    sample=s,
                )
                state = RolloutState(example=ex, traj=traj, group=i, sample=s, prompt_ids=list(prompt_ids))
                for q, per_query in zip(initial[i], hits, strict=True):
                    traj.queries.append(q)
                    traj.retrieved.append([h.to_dict() for h in per_query])
                    traj.retrieval_count += 1
                    state.windows.append(list(per_query))
                traj.initial_search = bool(initial[i])
                traj.initial_queries = len(initial[i])
                states.append(state)
        return states

    # -- one turn --------------------------------------------------------------------------------
    def response_left(self, state: RolloutState) -> int:
        return self.max_response_tokens - len(state.traj.response_ids)

    def generate(self, active: list[RolloutState]) -> list[Generation]:
        budget = max(self.response_left(s) for s in active)
        params = replace(self.params, max_new_tokens=max(1, min(self.params.max_new_tokens, budget)))
        batch = [s.prompt_ids + s.traj.response_ids for s in active]
        stops = [self.loop.stop_strings(s) for s in active]
        gens = self.generator.generate(batch, stops, params)
        if len(gens) != len(active):
            raise ConfigError(f"generator returned {len(gens)} generations for a batch of {len(active)}")
        return gens

    def take_generation(self, state: RolloutState, gen: Generation) -> tuple[str, bool]:
        """Append the sampled ids as a policy span; returns (turn text, hit the response budget)."""
        ids = list(gen.token_ids)
        if not ids and gen.text:
            # A backend without token ids (HTTP) cannot be used for training; encode once to keep going.
            ids = encode_text(self.tok, gen.text)
            state.traj.extra["ids_from_text"] = True
        logprobs = list(gen.logprobs)
        if len(logprobs) != len(ids):
            state.traj.logprobs_missing = True
            logprobs = [0.0] * len(ids)
        left = self.response_left(state)
        over_budget = len(ids) > left or (len(ids) == left and gen.finish_reason == "length")
        if len(ids) > left:
            ids, logprobs = ids[: max(left, 0)], logprobs[: max(left, 0)]
            text = self.tok.decode(ids)
        else:
            text = gen.text
        state.traj.generation_finish_reasons.append(gen.finish_reason)
        span_text = self.tok.decode(ids)
        traj = state.traj
        if traj.turns and traj.turns[-1].role == "policy":
            # a continuation of the same turn: one span, so a policy Turn is one action round
            last = traj.turns[-1]
            traj.response_ids.extend(ids)
            traj.loss_mask.extend([1] * len(ids))
            traj.logprobs.extend(logprobs)
            last.end = len(traj.response_ids)
            last.text = self.tok.decode(traj.response_ids[last.start : last.end])
        else:
            _append(state, ids, logprobs, "policy", span_text)
        state.policy_text += text
        return text, over_budget

    def insert(self, state: RolloutState, obs: Observation) -> bool:
        """Tokenise and append an observation (body truncated to max_obs_tokens); False if the budget ran out.

        An untrusted body (documents) has its tag-like text neutralised first, so a passage can never
        open, close or fake a block of the policy's protocol (e.g. close `<information>` early)."""
        pre, suf = encode_text(self.tok, obs.prefix), encode_text(self.tok, obs.suffix)
        room = max(0, self.max_obs_tokens - len(pre) - len(suf))
        if obs.parts:
            body = self._fair_parts(state, obs, room)
        else:
            body = encode_text(self.tok, obs.body if obs.trusted else neutralise_tags(obs.body))
            if len(body) > room:
                state.traj.obs_truncated_tokens += len(body) - room
                body = body[:room]
        ids = pre + body + suf
        left = self.response_left(state)
        fits = len(ids) < left
        ids = ids[: max(left, 0)]
        if ids:
            _append(state, ids, [], "env", self.tok.decode(ids))
        return fits

    def _fair_parts(self, state: RolloutState, obs: Observation, room: int) -> list[int]:
        """A multi-query observation's body within `room` tokens: every header whole, the documents cut by
        `fair_shares` (each query's documents keep an equal share, a shorter one all of it); if the headers
        alone do not fit, everything in order cut at `room`."""

        def enc(text: str) -> list[int]:
            return encode_text(self.tok, text if obs.trusted else neutralise_tags(text))

        heads = [enc(h) for h, _ in obs.parts]
        docs = [enc(d) for _, d in obs.parts]
        total = sum(map(len, heads)) + sum(map(len, docs))
        head_room = room - sum(map(len, heads))
        if head_room < 0:
            body = [t for h, d in zip(heads, docs, strict=True) for t in h + d][:room]
        else:
            shares = fair_shares([len(d) for d in docs], head_room)
            body = [t for h, d, n in zip(heads, docs, shares, strict=True) for t in h + d[:n]]
        state.traj.obs_truncated_tokens += total - len(body)
        return body

    def finish(self, state: RolloutState, reason: str) -> None:
        state.done = True
        state.traj.finish_reason = reason

    def fail(self, state: RolloutState, err: BaseException) -> None:
        """End one trajectory on an unexpected error in its own processing; the others go on.
        The trainer scores it 0 and counts it (`finish_reason == "error"`)."""
        self.finish(state, "error")
        state.traj.extra["rollout_error"] = f"{type(err).__name__}: {err}"[:500]
        state.traj.extra["rollout_traceback"] = traceback.format_exc()[-_MAX_TRACEBACK_CHARS:]

    def step_one(self, state: RolloutState, gen: Generation) -> StepOutcome | None:
        """Take one generation and decide what it asks for; None when the trajectory is finished or
        continues without the environment."""
        loop = self.loop
        text, over_budget = self.take_generation(state, gen)
        outcome = loop.act(state, text)
        if over_budget:
            self.finish(state, "length")
            return None
        if outcome.continue_generation and not outcome.done:
            state.data["continuations"] = state.data.get("continuations", 0) + 1
            if state.data["continuations"] <= loop.max_continuations:
                return None
            outcome = StepOutcome(feedback=loop.invalid_action_message, invalid=True)
        state.data["continuations"] = 0
        if outcome.invalid:
            state.traj.invalid_actions += 1
        if state.final:
            # the forced last generation: nothing more is executed, whatever it asked for
            if outcome.queries:
                state.traj.search_after_limit = True
            state.turns_taken += 1
            self.finish(state, outcome.finish_reason if outcome.done else "max_turns")
            return None
        if outcome.done:
            state.turns_taken += 1
            self.finish(state, outcome.finish_reason or "answer")
            return None
        return outcome

    def answer_one(self, state: RolloutState, outcome: StepOutcome, hits: list[list[Hit]] | None) -> None:
        """Insert the environment's answer (documents or feedback) and apply the turn limit."""
        loop = self.loop
        state.turns_taken += 1
        if hits is not None:
            for q, per_query in zip(outcome.queries, hits, strict=True):
                state.traj.queries.append(q)
                state.traj.retrieved.append([h.to_dict() for h in per_query])
                state.traj.retrieval_count += 1
            state.windows.append([h for per_query in hits for h in per_query])
            obs = loop.observe(state, outcome, hits)
        else:
            obs = loop.feedback(state, outcome.feedback or "")
        if not self.insert(state, obs):
            self.finish(state, "length")
            return
        if state.turns_taken >= loop.max_turns:
            if loop.forced_final_answer:
                state.final = True
                state.traj.forced_final = True
            else:
                self.finish(state, "max_turns")
        if self.fork_points is not None and not state.done:
            # a turn boundary: everything the next generation depends on is in the state, so a copy
            # continued later generates what this one would (`fork`)
            self.fork_points.append(copy.deepcopy(state))

    def run(
        self,
        states: list[RolloutState],
        deadline_s: float | None = None,
        on_done: Callable[[int, Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Turns until every trajectory is done (or past `deadline_s`); `on_done(index, traj)` is told of each
        trajectory as soon as it is finished, before the others are."""
        loop = self.loop
        started = time.monotonic()
        released: set[int] = set()
        while True:
            self._release(states, released, on_done)
            active = [s for s in states if not s.done]
            if not active:
                break
            if deadline_s is not None and time.monotonic() - started >= deadline_s:
                for state in active:
                    self.finish(state, TIME_LIMIT)
                break
            gens = self.generate(active)
            pending: list[tuple[RolloutState, StepOutcome]] = []
            for state, gen in zip(active, gens, strict=True):
                try:
                    outcome = self.step_one(state, gen)
                except Exception as err:  # one trajectory's bug must not end the batch
                    self.fail(state, err)
                    continue
                if outcome is not None:
                    pending.append((state, outcome))

            # service failures (the retriever past its retry budget) are not one trajectory's fault
            requests = [(i, o.queries, o.k or loop.top_k) for i, (_, o) in enumerate(pending) if o.queries]
            contexts = {i: _context(state.example, state.turns_taken) for i, (state, _) in enumerate(pending)}
            results = _search_batched(self.retriever, requests, contexts) if requests else {}
            for i, (state, outcome) in enumerate(pending):
                try:
                    self.answer_one(state, outcome, results[i] if outcome.queries else None)
                except Exception as err:
                    self.fail(state, err)
        self._release(states, released, on_done)
        return [s.traj for s in states]

    def _release(
        self,
        states: list[RolloutState],
        released: set[int],
        on_done: Callable[[int, Trajectory], None] | None,
    ) -> None:
        """Summarise each newly finished trajectory (and tell `on_done`); it is not touched again."""
        for i, state in enumerate(states):
            if not state.done or i in released:
                continue
            released.add(i)
            try:
                self.summarise(state)
            except Exception as err:
                self.fail(state, err)
            if on_done is not None:
                on_done(i, state.traj)

    def summarise(self, state: RolloutState) -> None:
        traj = state.traj
        traj.num_turns = state.turns_taken
        traj.response_text = self.tok.decode(traj.response_ids)
        self.loop.finalize(state)


def rollout(
    loop: AgentLoop,
    generator: Generator,
    retriever: Retriever,
    examples: Sequence[QAExample],
    params: SamplingParams | None = None,
    n: int = 1,
    *,
    budget: RolloutBudget | None = None,
    tokenizer=None,
) -> list[Trajectory]:
    """Run `loop` on every example `n` times; the n samples of an example are adjacent.

    `traj.group` is the example's index and `traj.sample` the sample's index
    (GRPO groups). `budget` bounds observations, responses, turns and time (default: RolloutBudget()).
    `tokenizer` defaults to `generator.tokenizer`. Malformed generations never raise: they end
    as scored trajectories (answer None or the loop's fallback).
    """
    budget = budget or RolloutBudget()
    engine, states = _prepared(loop, generator, retriever, examples, params, n, budget, tokenizer)
    return engine.run(states, budget.deadline_s)


def rollout_each(
    loop: AgentLoop,
    generator: Generator,
    retriever: Retriever,
    examples: Sequence[QAExample],
    params: SamplingParams,
    on_done: Callable[[int, Trajectory], None],
    *,
    budget: RolloutBudget | None = None,
    tokenizer=None,
) -> list[Trajectory]:
    """`rollout` with one sample per example, calling `on_done(i, traj)` (in this thread) as soon as the i-th
    trajectory is finished: a server hands each search on before the slowest one of its batch is done."""
    budget = budget or RolloutBudget()
    engine, states = _prepared(loop, generator, retriever, examples, params, 1, budget, tokenizer)
    return engine.run(states, budget.deadline_s, on_done)


@dataclass(frozen=True)
class TreeSpec:
    """Tree-GRPO's sampling (2509.21240): `trees` independent chains per question, then `expansions` rounds in
    each of which `branches` nodes (turn boundaries: after an inserted observation) of every tree are drawn at
    random (`seed`) and continued to the end as new trajectories sharing that prefix."""

    trees: int = 2
    expansions: int = 1
    branches: int = 2
    seed: int = 0


def fork(state: RolloutState, k: int, first_sample: int) -> list[RolloutState]:
    """The fork hook: `k` independent copies of a trajectory's state at a turn boundary (after an inserted
    observation: everything its next generation reads is in the state), numbered `first_sample`, ...; each
    continues on its own when given to the engine. The state itself is left as it was (a node a later round may
    fork again). `extra` records the boundary: `forked_at_turn`, and what the copy shares with its parent rather
    than generating or executing again, `shared_policy_tokens` and `shared_retrievals` (bench/tree_grpo_budget.py
    counts a tree's cost with them)."""
    if k < 0:
        raise ConfigError(f"fork needs k >= 0 copies, got {k}")
    if state.done:
        raise ConfigError("fork: the trajectory is finished; fork it at a turn boundary before it ends")
    copies = []
    for i in range(k):
        branch = copy.deepcopy(state)
        branch.sample = branch.traj.sample = first_sample + i
        branch.traj.extra["forked_at_turn"] = branch.turns_taken
        branch.traj.extra["shared_policy_tokens"] = sum(branch.traj.loss_mask)
        branch.traj.extra["shared_retrievals"] = branch.traj.retrieval_count
        copies.append(branch)
    return copies


def rollout_tree(loop: AgentLoop, generator: Generator, retriever: Retriever, examples: Sequence[QAExample],
                 params: SamplingParams | None, tree: TreeSpec, *, budget: RolloutBudget | None = None,
                 tokenizer=None) -> list[Trajectory]:  # fmt: skip
    """Tree rollouts: every trajectory of a question, chain or branch, in order of (group, sample); each has
    `extra["tree"]` (its tree within the question) and a branch `extra["forked_at_turn"]`. A branch is a
    `fork` of the trajectory state at a turn boundary continued by the same engine. On the decode engine the
    branches reuse their parent's keys/values (`llm.base.shared_prefixes`: every row is held until the
    tree is done, and a branch's prompt prefills only what it does not share); elsewhere (HF dynamic/static
    cache, CPU, vLLM) its prefix is prefilled again. Either way, with greedy decoding a branch equals the chain
    it forked from, token for token."""
    if min(tree.trees, tree.branches) < 1 or tree.expansions < 0:
        raise ConfigError(f"TreeSpec needs trees >= 1, branches >= 1, expansions >= 0; got {tree}")
    budget = budget or RolloutBudget()
    with shared_prefixes(generator):
        engine, states = _prepared(
            loop, generator, retriever, examples, params, tree.trees, budget, tokenizer
        )
        for state in states:
            state.traj.extra["tree"] = state.sample
        engine.fork_points = []
        engine.run(states, budget.deadline_s)
        rng = random.Random(tree.seed)
        next_sample = {g: tree.trees for g in range(len(examples))}
        every = list(states)
        for _ in range(tree.expansions):
            nodes: dict[tuple[int, int], list[RolloutState]] = {}
            for point in engine.fork_points:
                nodes.setdefault((point.group, point.traj.extra["tree"]), []).append(point)
            branches = []
            for (group, _), points in sorted(nodes.items()):
                for point in rng.sample(points, min(tree.branches, len(points))):
                    branches += fork(point, 1, next_sample[group])
                    next_sample[group] += 1
            engine.run(branches, budget.deadline_s)
            every += branches
    return [s.traj for s in sorted(every, key=lambda s: (s.group, s.sample))]


def _prepared(loop: AgentLoop, generator: Generator, retriever: Retriever, examples: Sequence[QAExample],
              params: SamplingParams | None, n: int, budget: RolloutBudget,
              tokenizer) -> tuple[_Engine, list[RolloutState]]:  # fmt: skip
    """The engine of a rollout (its budget checked) and its started trajectories (initial searches done)."""
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    if budget.max_obs_tokens < 1 or budget.max_response_tokens < 1:
        raise ConfigError("max_obs_tokens and max_response_tokens must be >= 1")
    if budget.deadline_s is not None and not budget.deadline_s > 0:
        raise ConfigError(f"deadline_s must be > 0, got {budget.deadline_s}")
    if budget.max_turns is not None:
        if budget.max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {budget.max_turns}")
        loop = replace(loop, max_turns=budget.max_turns)
    tok = _tokenizer_of(generator, tokenizer)
    engine = _Engine(
        loop,
        generator,
        retriever,
        tok,
        params or SamplingParams(),
        budget.max_obs_tokens,
        budget.max_response_tokens,
    )
    return engine, engine.start(list(examples), n)
