"""The ``agent`` section of ``arbor train``: train an agent written against the OpenAI API.

``agent=my_agent.py:run`` (shorthand for ``agent.fn``) names ``async def run(client, row) -> float``:
the trainer calls it once per sample with ``client`` an ``openai.AsyncOpenAI`` whose base URL is the
trainer's endpoint for that one episode, and ``row`` a copy of the dataset row. ``agent.timeout_s``
bounds one episode's wall time while its iteration runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from arbor.configs import check

RUN_FORM = "an `async def run(client, row) -> float` (client: openai.AsyncOpenAI, row: the dataset row)"


@dataclass
class AgentConfig:
    SHORTHAND = "fn"             # ``agent=my_agent.py:run`` sets ``agent.fn``
    fn: str = ""                 # "my_agent.py:run" or "module:run": the agent's async run(client, row) -> float
    timeout_s: float = 300.0     # an episode running longer than this is cancelled, dropped and counted

    def validate(self) -> None:
        check(self, (self.timeout_s > 0, "timeout_s", "must be > 0 seconds"),
              (not self.fn or self.fn.count(":") == 1, "fn", "must be FILE.py:FUNCTION or module:FUNCTION"))


def load_agent(spec: str):
    """The agent function ``spec`` names, checked: it exists, is async and takes (client, row);
    ValueError saying what is wrong otherwise."""
    from arbor.data.objects import load_callable
    fn = load_callable(spec, "agent")
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    if not inspect.iscoroutinefunction(call):
        raise ValueError(f"agent: {spec!r} is not async; the agent must be {RUN_FORM}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"agent: {spec!r} does not take two arguments (client, row); it must be {RUN_FORM}") from None
    except ValueError:                   # no signature to read (a builtin): leave it to the call
        pass
    return fn


def check_agent_run(cfg) -> None:
    """The keys an agent run cannot combine with ``agent.fn`` (an ``RLConfig``); ValueError naming them."""
    if cfg.env:
        raise ValueError(f"agent={cfg.agent.fn!r} and env={cfg.env!r} are two ways to roll out; set one of them")
    if cfg.tools:
        raise ValueError("tools=[…] are offered by the trainer's built-in environment; an agent passes its own "
                         "`tools` to client.chat.completions.create (remove tools=…)")
    if any(b != 1 for b in cfg.rollout.branch[1:]):
        raise ValueError(f"rollout.branch={cfg.rollout.branch}: an agent's episode cannot be forked after its "
                         "first call; set rollout.branch=[G] (G episodes per row)")
