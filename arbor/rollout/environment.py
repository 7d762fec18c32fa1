"""The environment protocol, and ``ChatEnvironment``: the environment of a dataset row with tools
and reward functions (what ``arbor train data.train=… tools=[…] reward.fns=[…]`` runs).

An environment (``env=my_env.py:MyEnv``: a class the trainer instantiates with no arguments, or a
factory function) implements::

    async def reset(self, row: dict) -> list[dict]          # the prompt's messages (OpenAI format)
    async def step(self, message: dict) -> StepResult        # (observation, reward, done)
    def fork(self) -> "Environment"                          # an independent copy (tree branching)

and may have ``tools`` (OpenAI function schemas rendered into the prompt by the chat template),
``score(message) -> float`` (the reward of an episode the trainer cuts at the context limit;
without it such an episode scores 0), ``max_turn_tokens`` and ``ignore_eos``. ``reset``/``step``/
``score`` may be plain or async functions.

``message`` is the model's turn as an OpenAI assistant message: ``content`` (the text without
tool-call markup), ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments": dict}}]``; a JSON string is accepted too),
parsed by the parser the chat template calls for) and, when some call could not be parsed,
``tool_call_errors`` (strings). ``observation``: the messages that answer the turn (``[{"role":
"tool", …}]``; a dict is one message, a string one user message); ignored when ``done``.

``ChatEnvironment``: ``reset(row)`` → the row's prompt (``arbor.data.prompts``); a turn with tool
calls gets one "tool" message per call (the tool's result, or ``error: …`` for an unknown tool, bad
arguments, an exception, a timeout or a malformed call — never an exception); a turn without calls,
or the ``max_turns``-th turn, ends the episode with the reward functions' weighted sum on that
turn's text.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass


@dataclass
class StepResult:
    observation: list[dict] | dict | str | None
    reward: float
    done: bool

    def __iter__(self):
        return iter((self.observation, self.reward, self.done))


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def observation_messages(obs) -> list[dict]:
    """An environment's observation as messages (module docstring)."""
    if obs is None:
        return []
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, dict):
        return [obs]
    if isinstance(obs, list) and all(isinstance(m, dict) and "role" in m for m in obs):
        return obs
    raise ValueError(f"an environment's observation must be messages, a message or a string, got {type(obs).__name__}")


class ChatEnvironment:
    """See the module docstring. ``rewards``: an ``arbor.data.rewards.Rewards``; ``tools``:
    ``arbor.data.tools.Tool`` list."""

    def __init__(self, rewards, tools=(), prompt_key: str = "prompt", system: str = "", max_turns: int = 6,
                 tool_timeout_s: float = 10.0):
        self.rewards, self.prompt_key, self.system = rewards, prompt_key, system
        self.by_name = {t.name: t for t in tools}
        self.tools = [t.schema for t in tools] or None
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s
        self.row, self.turns = None, 0

    async def reset(self, row: dict) -> list[dict]:
        from arbor.data.prompts import prompt_messages
        self.row, self.turns = row, 0
        return prompt_messages(row, self.prompt_key, self.system)

    async def step(self, message: dict) -> StepResult:
        from arbor.data.tools import call_tool
        from arbor.models.tool_calls import ToolCall, new_call_id
        self.turns += 1
        calls, errors = message.get("tool_calls") or [], message.get("tool_call_errors") or []
        if (calls or errors) and self.turns < self.max_turns:
            obs = []
            for c in calls:
                args = c["function"]["arguments"]
                if isinstance(args, str):           # OpenAI's wire form: a JSON string
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass                         # call_tool answers "error: …" for non-object arguments
                call = ToolCall(c["function"]["name"], args, c.get("id") or new_call_id())
                out = await call_tool(self.by_name, call, self.tool_timeout_s)
                obs.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": out})
            obs += [{"role": "tool", "content": f"error: {e}"} for e in errors]
            return StepResult(obs, 0.0, False)
        return StepResult(None, await self.score(message), True)

    async def score(self, message: dict) -> float:
        return await self.rewards.score(self.row[self.prompt_key], message.get("content") or "", self.row)

    def fork(self) -> "ChatEnvironment":
        twin = object.__new__(ChatEnvironment)       # not copy.copy: that would go through __getstate__
        vars(twin).update(vars(self))
        return twin

    def __getstate__(self):
        """A checkpoint keeps the episode (row, turns), not the loaded functions: ``bind`` restores them."""
        return {k: v for k, v in vars(self).items() if k not in ("rewards", "by_name")}

    def __setstate__(self, state):
        vars(self).update(state, rewards=None, by_name=None)

    def bind(self, like: "ChatEnvironment") -> None:
        """Take ``like``'s reward functions and tools (after a checkpoint was loaded)."""
        self.rewards, self.by_name = like.rewards, like.by_name
