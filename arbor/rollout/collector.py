"""Multi-turn rollouts against the async engine, as trees, with token-budget partitioning.

An ``Episode`` is one path being grown: its environment, the ids of its context so far
(``prefix``), the model turn in progress (``partial``) and the tree node it hangs from.
``Collector.run_iteration(pool, budget)`` advances every episode of the pool concurrently
(each model turn is one streamed engine request) until the tokens of finished trajectories
reach ``budget`` (C3PO++'s Φ; ``None`` = until all finish, the synchronous baseline). Then the
requests still running are cancelled and their tokens so far kept in ``partial``: the next
iteration re-submits ``prefix + partial`` (exact; the prefix cache makes it a hit, not a
re-prefill) under the then-current weights. Every token records the policy version that
sampled it. Between iterations the pool is plain data, so it can be checkpointed.

Branching: at model turn t an episode forks into ``branch[t]`` children (1 past the list);
each child samples with its own seed, derived from (seed, group, path), so a run is
reproducible whatever else the engine is doing.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from arbor.rollout.chat import ChatLayout
from arbor.rollout.environment import maybe_await, observation_messages
from arbor.rollout.tree import Node, RolloutTree, Segment

if TYPE_CHECKING:
    from arbor.engine.client import EngineClient


def _resumed_routing(before, base: int, fresh):
    """A turn's expert ids [layers, base + n, k]: the ``base`` tokens generated before a C3PO++
    interruption (−1 where unknown), then this request's n."""
    if base == 0:
        return fresh
    if before is None:
        before = fresh.new_full((fresh.shape[0], base, fresh.shape[2]), -1)
    return torch.cat([before[:, :base], fresh], 1)


@dataclass
class RolloutConfig:
    max_turn_tokens: int = 64
    max_context: int = 640
    max_turns: int = 6               # model turns of an episode with tools (the last one is scored)
    tool_timeout_s: float = 10.0     # bound on one tool call; a timeout is an "error: …" tool message
    temperature: float = 1.0
    top_p: float = 1.0
    branch: list[int] = field(default_factory=lambda: [4])
    seed: int = 0
    end_on_truncation: bool = True   # a model turn cut at max_turn_tokens (no end-of-turn) ends the episode

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.max_turn_tokens >= 1, "max_turn_tokens", "must be ≥ 1"),
              (self.max_context >= 2, "max_context", "must be ≥ 2"), (self.temperature >= 0, "temperature", "must be ≥ 0"),
              (self.max_turns >= 1, "max_turns", "must be ≥ 1"), (self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0"),
              (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
              (len(self.branch) >= 1 and all(b >= 1 for b in self.branch), "branch", "must be a non-empty list of counts ≥ 1"))


@dataclass
class Episode:
    tree: RolloutTree
    env: object
    node: Node                     # the node the next model turn hangs from
    prefix: list[int]
    messages: list[dict]           # the chat so far, as the template renders it (model turns as sampled text)
    turn: int
    path: tuple[int, ...]
    born: int                      # iteration the group started
    partial: Segment | None = None
    done: bool = False


class Collector:
    def __init__(self, engine: EngineClient, tokenizer, cfg: RolloutConfig, sampling_factory, template_kwargs=None):
        """``engine``: any streaming front end (``arbor.engine.client.EngineClient``: its ``generate``);
        sampling_factory(max_tokens, temperature, top_p, seed, ignore_eos) → the engine's SamplingParams;
        ``template_kwargs``: extra chat-template variables (``data.template_kwargs``)."""
        from arbor.models.tool_calls import parser_for_template
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.sampling = sampling_factory
        self.template_kwargs = dict(template_kwargs or {})
        self.parser, self.parser_error = None, None
        try:                          # only an environment that offers tools needs it (``start``)
            self.parser = parser_for_template(tokenizer.chat_template) if tokenizer.supports_tools else None
        except ValueError as e:
            self.parser_error = str(e)
        self.version = 0

    async def start(self, env, row, group: int, task, iteration: int) -> list[Episode]:
        """The episodes of a new group: ``env.reset(row)``'s prompt, forked per ``branch[0]``."""
        messages = await maybe_await(env.reset(row))
        tools = getattr(env, "tools", None)
        if tools and self.parser is None:
            raise ValueError(self.parser_error or "the environment offers tools but the model's chat template does "
                             "not render them (it never reads a `tools` variable); use a model whose template does")
        ids = self.layout(env).prompt_ids(messages)
        tree = RolloutTree(Node(Segment(ids, is_model=False)), group, task)
        return self._fork(Episode(tree, env, tree.root, ids, messages, 0, (), iteration))

    def layout(self, env) -> ChatLayout:
        return ChatLayout(self.tok, getattr(env, "tools", None), self.template_kwargs)

    def _fork(self, ep: Episode) -> list[Episode]:
        k = self.cfg.branch[ep.turn] if ep.turn < len(self.cfg.branch) else 1
        if k == 1:
            return [ep]
        return [Episode(ep.tree, ep.env.fork(), ep.node, ep.prefix, ep.messages, ep.turn, ep.path + (j,),
                        ep.born) for j in range(k)]

    def _seed(self, ep: Episode) -> int:
        key = f"{self.cfg.seed}/{ep.tree.group}/{ep.path}/{ep.turn}".encode()
        return zlib.crc32(key)

    def assistant_message(self, text: str) -> dict:
        """The model's turn as an OpenAI assistant message (``arbor.rollout.environment``)."""
        if self.parser is None:
            return {"role": "assistant", "content": text}
        turn = self.parser.parse(text)
        msg = {"role": "assistant", "content": turn.content,
               "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in turn.calls]}
        if turn.errors:
            msg["tool_call_errors"] = list(turn.errors)
        return msg

    async def _model_turn(self, ep: Episode, stop: asyncio.Event, interruptible: bool = True) -> list[Episode]:
        """Generate (the rest of) one model turn, then step the env; → the episodes that follow
        (``[ep]`` itself, with ``partial`` kept, when ``stop`` interrupts the generation). Not
        ``interruptible`` (no token budget: ``stop`` is never set), the request is ``final_only``:
        the engine hands over the finished turn alone, not a snapshot per token."""
        part = ep.partial or Segment([], True)
        ep.partial = part
        room = self.cfg.max_context - len(ep.prefix) - len(part.tokens)
        max_new = min(getattr(ep.env, "max_turn_tokens", self.cfg.max_turn_tokens) - len(part.tokens), room)
        finish = "length"
        if max_new > 0:
            base = len(part.tokens)
            params = self.sampling(max_new, self.cfg.temperature, self.cfg.top_p, self._seed(ep) + base,
                                   getattr(ep.env, "ignore_eos", False))
            if not interruptible:
                params.final_only = True
            stream = self.engine.generate(ep.prefix + part.tokens, params)
            try:
                async for out in stream:
                    fresh = out.token_ids[len(part.tokens) - base:]
                    part.tokens += fresh
                    part.logprobs += out.logprobs[len(part.logprobs) - base:len(out.token_ids)]
                    part.versions += [self.version] * len(fresh)
                    if getattr(out, "routed_experts", None) is not None:   # this request's tokens only
                        part.routed_experts = _resumed_routing(part.routed_experts, base, out.routed_experts)
                    if out.finish_reason is not None:
                        finish = out.finish_reason
                    elif stop.is_set():
                        return [ep]
            finally:
                await stream.aclose()
        ep.partial = None
        text = self.tok.decode([t for t in part.tokens if t != self.tok.eos_token_id])
        node = Node(part, text=text)
        ep.node.children.append(node)
        message = self.assistant_message(text)
        obs, reward, done = await maybe_await(ep.env.step(message))
        truncated = (self.cfg.end_on_truncation and finish == "length"
                     and part.tokens[-1:] != [self.tok.eos_token_id])
        history = ep.messages + [{"role": "assistant", "content": text}]
        obs = [] if done else observation_messages(obs)
        env_ids = [] if done or truncated else self.layout(ep.env).env_turn_ids(history, obs)
        if done or truncated or len(ep.prefix) + len(part.tokens) + len(env_ids) >= self.cfg.max_context:
            score = getattr(ep.env, "score", None)
            node.reward = reward if done else (float(await maybe_await(score(message))) if score else 0.0)
            ep.done = True
            return []
        env_node = Node(Segment(env_ids, is_model=False))
        node.children.append(env_node)
        nxt = Episode(ep.tree, ep.env, env_node, ep.prefix + part.tokens + env_ids, history + obs,
                      ep.turn + 1, ep.path, ep.born)
        return self._fork(nxt)

    async def run_iteration(self, pool: list[Episode], iteration: int, budget: int | None = None,
                            new_group=None, capacity: int = 0, max_age: int | None = None, on_finished=None):
        """Advance ``pool`` until finished groups hold ``budget`` model tokens (None: until every
        group finishes). ``new_group()`` → (env, row, task, group) refills the pool to ``capacity`` groups.
        ``on_finished(tree)`` is called as each group finishes (progress reporting).
        Groups started more than ``max_age`` iterations ago (C3PO++'s σ) are dropped first.
        → (finished trees, episodes left for the next iteration, stats)."""
        dropped = 0
        if max_age is not None:
            keep = [ep for ep in pool if iteration - ep.born <= max_age]
            dropped = len({id(ep.tree) for ep in pool}) - len({id(ep.tree) for ep in keep})
            pool = keep
        stop = asyncio.Event()
        tasks: dict[asyncio.Task, Episode] = {}
        open_eps: dict[int, int] = {}
        trees: dict[int, RolloutTree] = {}
        finished, done_tokens = [], 0

        def launch(ep: Episode):
            tasks[asyncio.ensure_future(self._model_turn(ep, stop, budget is not None))] = ep

        def track(ep: Episode):
            trees[id(ep.tree)] = ep.tree
            open_eps[id(ep.tree)] = open_eps.get(id(ep.tree), 0) + 1

        async def refill():
            while new_group is not None and len(open_eps) < capacity and not stop.is_set():
                env, row, task, group = new_group()
                for ep in await self.start(env, row, group, task, iteration):
                    track(ep)
                    launch(ep)

        for ep in pool:
            track(ep)
            launch(ep)
        await refill()
        left = []
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in [t for t in tasks if t in done]:     # in launch order: a set's order is by address
                ep = tasks.pop(t)
                follow = t.result()
                key = id(ep.tree)
                if stop.is_set() and follow == [ep] and ep.partial is not None:
                    left.append(ep)
                    continue
                open_eps[key] += len(follow) - 1
                if stop.is_set():
                    left.extend(follow)
                else:
                    for f in follow:
                        launch(f)
                if open_eps[key] == 0:
                    del open_eps[key]
                    tree = trees.pop(key)
                    finished.append(tree)
                    if on_finished is not None:
                        on_finished(tree)
                    done_tokens += sum(t.num_model_tokens for t in tree.trajectories())
            if budget is not None and done_tokens >= budget:
                stop.set()
            await refill()
        stats = {"finished_groups": len(finished), "carried_episodes": len(left), "dropped_groups": dropped,
                 "finished_tokens": done_tokens}
        return finished, left, stats
