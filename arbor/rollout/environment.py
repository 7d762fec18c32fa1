"""The environment protocol and the one tool-using environment the built-in tasks share.

An episode: ``messages = await env.reset()``; then per model turn
``obs, reward, done = await env.step(turn_text)``; when done, ``reward`` is the episode reward.
``env.fork()`` copies the episode state so that a rollout tree can branch at any turn.

``ToolEnvironment``: a model turn holding ``<tool_call>ARG</tool_call>`` gets the tool's output
as the next observation (role "tool"); a turn without a call ends the episode and is scored by
``verify``; so does reaching ``max_turns`` model turns (reward of the last turn's text).
"""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_call(text: str) -> str | None:
    """The argument of the first ``<tool_call>…</tool_call>`` in a model turn, else None."""
    m = _TOOL_CALL.search(text)
    return m.group(1).strip() if m else None


@dataclass
class StepResult:
    observation: str | None
    reward: float
    done: bool

    def __iter__(self):
        return iter((self.observation, self.reward, self.done))


class Environment(Protocol):
    async def reset(self) -> list[dict]: ...
    async def step(self, action: str) -> StepResult: ...
    def fork(self) -> "Environment": ...


class ToolEnvironment:
    def __init__(self, system_prompt: str, question: str, tool: Callable[[str], str | Awaitable[str]],
                 verify: Callable[[str], float], max_turns: int = 6):
        self.system_prompt, self.question = system_prompt, question
        self.tool, self.verify, self.max_turns = tool, verify, max_turns
        self.turns = 0

    async def reset(self) -> list[dict]:
        self.turns = 0
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.question}]

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        call = parse_tool_call(action)
        if call is None or self.turns >= self.max_turns:
            return StepResult(None, float(self.verify(action)), True)
        out = self.tool(call)
        if inspect.isawaitable(out):
            out = await out
        return StepResult(str(out), 0.0, False)

    def fork(self) -> "ToolEnvironment":
        return copy.copy(self)
