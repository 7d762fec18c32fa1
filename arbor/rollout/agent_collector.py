"""Rollouts of an agent written against the OpenAI API (``agent=my_agent.py:run``), with the
collector's interface (``start``, ``run_iteration``, ``version``), so the RL loop runs them as it runs a
built-in environment's.

A group is ``rollout.branch[0]`` episodes of one row; an episode is one call of the agent's
``run(client, row)`` against the trainer's endpoint (``arbor.rollout.agent_server``), whose recorded
calls become its trajectories (``arbor.rollout.agent_record``). Its reward is the number ``run``
returns; or, when it returns None, the one it set with ``client.episode.reward(x)``, else the reward
functions' (``reward.fns``) score of its last completion. Per-call rewards
(``client.episode.reward_call(x, call)``) replace it on the trajectory ending at that call.

An episode is dropped — counted in the step's row (``agent_dropped`` and one ``agent_<reason>``
count) and written with its row to ``OUT/agent_errors.jsonl`` — when ``run`` raises (``raised``), runs
longer than ``agent.timeout_s`` (``timeout``), never calls the endpoint (``no_calls``), or ends with no
reward (a non-number, NaN, ±inf: ``bad_reward``). A group trains on the episodes that were kept; a
group whose episodes were all dropped is not trained (``agent_dropped_groups``). Nothing raised by an
agent reaches the trainer. Under C3PO++, once the last ``capacity`` groups to end were all dropped, the
iteration admits no more groups (``agent_stalled``: 1) and ends with what it has, so an agent that
always fails cannot keep an iteration from reaching its budget forever.

C3PO++ (``run_iteration`` with a ``budget``): groups start while fewer than ``capacity`` are open,
until finished groups hold ``budget`` model tokens; the episodes already running then finish in the
same iteration (an agent's coroutine cannot be carried to the next), so every request in flight
finishes on the weights it started on, and each token records the policy version that sampled it. No
episode runs while the trainer moves weights: the trainer syncs after ``run_iteration`` returns.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

from arbor.rollout.agent_record import EpisodeTrees, episode_trees

REASONS = ("raised", "timeout", "no_calls", "bad_reward")


@dataclass
class AgentSample:
    """One episode waiting to run (plain data: it may sit in a checkpointed pool)."""
    row: dict
    group: int
    sample: int
    task: object
    born: int
    env: object = None


class AgentCollector:
    def __init__(self, endpoint, agent, cfg, timeout_s: float, rewards=None, prompt_key: str = "prompt",
                 log_path: Path | None = None):
        """``endpoint``: the ``AgentEndpoint``; ``agent``: the async ``run(client, row)``; ``cfg``: the
        rollout section (``branch[0]`` episodes per row, temperature, top_p, seed, max_turn_tokens,
        max_context); ``rewards``: the ``reward.fns`` (``arbor.data.rewards.Rewards``) or None."""
        self.endpoint, self.agent, self.cfg, self.timeout_s = endpoint, agent, cfg, timeout_s
        self.rewards, self.prompt_key, self.log_path = rewards, prompt_key, log_path
        self.episodes_run = 0

    @property
    def version(self) -> int:
        return self.endpoint.recorder.version

    @version.setter
    def version(self, v: int) -> None:
        self.endpoint.recorder.version = v

    def for_eval(self, cfg) -> "AgentCollector":
        """The same agent and endpoint sampling with the rollout section ``cfg`` (evaluation)."""
        return AgentCollector(self.endpoint, self.agent, cfg, self.timeout_s, self.rewards, self.prompt_key,
                              self.log_path)

    async def start(self, env, row, group: int, task, iteration: int) -> list[AgentSample]:
        return [AgentSample(row, group, j, task, iteration) for j in range(self.cfg.branch[0])]

    def _settings(self) -> dict:
        c = self.cfg
        return {"temperature": c.temperature, "top_p": c.top_p, "seed": c.seed, "max_turn_tokens": c.max_turn_tokens,
                "max_context": c.max_context, "timeout_s": self.timeout_s}

    async def _reward(self, ep, value):
        """The episode's reward (module docstring) → (float, None), or (None, why not)."""
        if value is None:
            value = ep.episode_reward
        if value is None and self.rewards is not None and ep.calls:
            prompt = ep.row.get(self.prompt_key, "") if isinstance(ep.row, dict) else ""
            value = await self.rewards.score(prompt, ep.calls[-1].text, ep.row)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, f"run returned {value!r}, not a finite number (return the reward, or set it with " \
                         "client.episode.reward(x))"
        return float(value), None

    async def _episode(self, s: AgentSample):
        """Run one episode → (trees, None) or (None, (reason, detail))."""
        self.episodes_run += 1
        eid = f"g{s.group}-s{s.sample}-{self.episodes_run}"
        ep, client = self.endpoint.open(eid, s.row, s.group, s.sample, self._settings())
        try:
            value = await asyncio.wait_for(self.agent(client, copy.deepcopy(s.row)), self.timeout_s)
        except asyncio.TimeoutError:
            return None, ("timeout", f"the episode ran longer than agent.timeout_s={self.timeout_s}")
        except Exception as e:           # the agent's own error (its HTTP errors included): this episode only
            return None, ("raised", f"{type(e).__name__}: {e}")
        finally:
            self.endpoint.close(ep)
        calls = [c for c in ep.calls if c.done]
        if not calls:
            return None, ("no_calls", "run ended without a finished call to its client's endpoint")
        reward, why = await self._reward(ep, value)
        if why is not None:
            return None, ("bad_reward", why)
        trees = episode_trees(calls, reward, {str(i): r for i, r in ep.call_rewards.items()}, s.group, s.task)
        return (trees, len(calls)), None

    def _log(self, s: AgentSample, iteration: int, reason: str, detail: str) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"iteration": iteration, "group": s.group, "sample": s.sample, "reason": reason,
                                "error": detail, "row": s.row}, default=str) + "\n")

    async def run_iteration(self, pool: list[AgentSample], iteration: int, budget: int | None = None,
                            new_group=None, capacity: int = 0, max_age: int | None = None, on_finished=None):
        """Run ``pool``'s episodes (and new groups, to ``capacity`` open, until finished groups hold
        ``budget`` model tokens) to their end → (finished groups, [], stats) (module docstring)."""
        await self.endpoint.ensure()
        dropped_old = 0
        if max_age is not None:
            keep = [s for s in pool if iteration - s.born <= max_age]
            dropped_old = len({s.group for s in pool}) - len({s.group for s in keep})
            pool = keep
        stats = {"finished_groups": 0, "carried_episodes": 0, "dropped_groups": dropped_old, "finished_tokens": 0,
                 "agent_episodes": 0, "agent_calls": 0, "agent_dropped": 0, "agent_dropped_groups": 0,
                 **{f"agent_{r}": 0 for r in REASONS}}
        tasks: dict[asyncio.Task, AgentSample] = {}
        open_groups: dict[int, list] = {}           # group → [episodes left, trees so far, its task]
        finished, stopped, stalled, lost = [], False, False, 0

        def launch(s: AgentSample):
            entry = open_groups.setdefault(s.group, [0, [], s.task])
            entry[0] += 1
            tasks[asyncio.ensure_future(self._episode(s))] = s

        async def refill():
            while new_group is not None and not (stopped or stalled) and len(open_groups) < capacity:
                env, row, task, group = new_group()
                for s in await self.start(env, row, group, task, iteration):
                    launch(s)

        for s in pool:
            launch(s)
        await refill()
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in [t for t in tasks if t in done]:      # in launch order
                s = tasks.pop(t)
                trees, failure = t.result()
                entry = open_groups[s.group]
                entry[0] -= 1
                stats["agent_episodes"] += 1
                if failure is None:
                    entry[1].append((s.sample, trees[0]))
                    stats["agent_calls"] += trees[1]
                else:
                    stats["agent_dropped"] += 1
                    stats[f"agent_{failure[0]}"] += 1
                    self._log(s, iteration, *failure)
                if entry[0] == 0:
                    del open_groups[s.group]
                    lost = lost + 1 if not entry[1] else 0
                    if lost >= max(1, capacity):      # every episode of the last Ω groups failed: stop admitting
                        stalled = True
                    if not entry[1]:
                        stats["agent_dropped_groups"] += 1
                        continue
                    group = EpisodeTrees([t for _, ts in sorted(entry[1], key=lambda x: x[0]) for t in ts], s.group,
                                         entry[2])         # in sample order, however the episodes ended
                    finished.append(group)
                    stats["finished_tokens"] += sum(tr.num_model_tokens for tr in group.trajectories())
                    if on_finished is not None:
                        on_finished(group)
            if budget is not None and stats["finished_tokens"] >= budget:
                stopped = True
            await refill()
        stats["finished_groups"], stats["agent_stalled"] = len(finished), int(stalled)
        return finished, [], stats
