"""What a job trains on — the user's files or a built-in example — resolved into one ``Task``.

``load_task`` reads the ``data``, ``reward``, ``tools`` and ``env`` keys of ``arbor sft`` / ``arbor
train``: with ``data.train=PATH`` the rows come from the user's file (``arbor.data.files``); with
``task=NAME`` from a built-in example (``BUILTINS``), which is nothing but a row generator plus tool
and reward specs that go through the very same loaders (``arbor.data.tools.load_tools``,
``arbor.data.rewards.Rewards``, ``arbor.data.objects``). Keys the user sets replace the example's.

Rows whose prompt cannot be read or is longer than ``max_prompt_tokens`` are dropped and counted
(``Task.dropped``; ``Task.notes`` says how many and why, with the first row), never truncated; no row
left is an error.

``DIFFUSION_TASKS`` / ``get_diffusion_task``: the block-diffusion tasks (prompt → answer decoded
directly, no chat or tools): modules with ``GEN_LENGTH``, ``generate(n, seed, split)`` and
``score(problem, text)``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from arbor.tasks import addition, countdown, sudoku


@dataclass(frozen=True)
class Builtin:
    rows: str                        # "module:function" (n, seed, split, **options) → rows
    system: str                      # "module:CONSTANT" holding the system prompt ("" for none)
    tools: tuple[str, ...] = ()
    reward: tuple[str, ...] = ()
    env: str = ""
    check: str = ""                  # "module:function" called once at load (e.g. the sandbox's isolation)


BUILTINS = {
    "arithmetic": Builtin("arbor.tasks.arithmetic:rows", "arbor.tasks.arithmetic:SYSTEM_PROMPT",
                          ("arbor.tasks.arithmetic:calc",), ("arbor.tasks.arithmetic:reward",)),
    "countdown": Builtin("arbor.tasks.countdown_chat:rows", "arbor.tasks.countdown_chat:SYSTEM_PROMPT",
                         ("arbor.tasks.arithmetic:calc",), ("arbor.tasks.countdown_chat:reward",)),
    "python": Builtin("arbor.tasks.python_tool:rows", "arbor.tasks.python_tool:SYSTEM_PROMPT",
                      ("arbor.tasks.python_tool:python",), ("arbor.tasks.python_tool:reward",),
                      check="arbor.tasks.python_tool:check_sandbox"),
    "longtail": Builtin("arbor.tasks.longtail:rows", "", env="arbor.tasks.longtail:LongTailEnvironment"),
}
DIFFUSION_TASKS = {"sudoku": sudoku, "addition": addition, "countdown": countdown}


@dataclass
class Task:
    name: str
    train: list[dict]
    eval: list[dict]
    make_env: Callable[[], object]     # a fresh environment; ``reset(row)`` starts an episode
    rewards: object = None             # arbor.data.rewards.Rewards (None: the environment scores)
    tools: list = field(default_factory=list)
    prompt_key: str = "prompt"
    system: str = ""
    dropped: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def load_task(*, task: str, data, reward, tools: list[str], env: str, seed: int, n_train: int, n_eval: int,
              tokenizer=None, max_prompt_tokens: int = 0, max_turns: int = 6, tool_timeout_s: float = 10.0,
              row_options: dict | None = None, need_reward: bool = True) -> Task:
    """The ``Task`` of a job's keys (module docstring). ``n_train`` / ``n_eval``: rows a built-in example
    generates; ``tokenizer`` + ``max_prompt_tokens`` > 0: drop longer prompts; ``need_reward``: an RL job
    must have reward functions or an environment (an SFT job need not)."""
    from arbor.data.files import load_rows, require_column
    from arbor.data.objects import load_object
    from arbor.data.rewards import RewardConfig, Rewards
    from arbor.data.tools import load_tools
    from arbor.rollout.environment import ChatEnvironment

    if data.train or data.eval:                  # your files (data.eval alone: an evaluation)
        name, system = Path(data.train or data.eval).stem, data.system
        train = load_rows(data.train, "data.train") if data.train else []
        evals = load_rows(data.eval, "data.eval", split="test") if data.eval else []
        tool_specs, reward_cfg, env_spec = list(tools), reward, env
    else:
        if not task:
            raise ValueError("nothing to train on: set data.train=PATH (your dataset: .jsonl/.json/.parquet/.csv "
                             f"or a datasets folder) or task=NAME (a built-in example: {sorted(BUILTINS)})")
        if task not in BUILTINS:
            extra = f" ('{task}' is a block-diffusion task: train a dLLM on it)" if task in DIFFUSION_TASKS else ""
            raise ValueError(f"unknown task '{task}'; built-in tasks: {sorted(BUILTINS)}{extra}; "
                             "or bring your own rows with data.train=PATH")
        b = BUILTINS[task]
        if b.check:
            load_object(b.check, "task")()
        make_rows = load_object(b.rows, "task")
        train = make_rows(n_train, seed, "train", **(row_options or {}))
        evals = make_rows(n_eval, seed + 1, "test") if n_eval else []
        name, system = task, data.system or (load_object(b.system, "task") if b.system else "")
        tool_specs = list(tools) or list(b.tools)
        reward_cfg = reward if reward.fns else RewardConfig(fns=list(b.reward), timeout_s=reward.timeout_s,
                                                            on_error=reward.on_error)
        env_spec = env or b.env
    loaded_tools = load_tools(tool_specs, "tools") if tool_specs else []
    rewards = Rewards(reward_cfg) if reward_cfg.fns and need_reward else None
    if env_spec:
        make_env = _env_factory(load_object(env_spec, "env"), env_spec)
    else:
        if need_reward and rewards is None:
            raise ValueError("no reward: set reward.fns (a built-in such as [\"math\"], [\"exact\"], or your "
                             "[\"my_rewards.py:correct\"]) or env=my_env.py:MyEnv (an environment that scores)")
        if need_reward:     # an SFT job's rows may be whole conversations instead (data.messages_key)
            require_column(train or evals, data.prompt_key, "data.prompt_key", data.train or data.eval or task)
        make_env = lambda: ChatEnvironment(rewards, loaded_tools, data.prompt_key, system, max_turns, tool_timeout_s)
    out = Task(name, train, evals, make_env, rewards, loaded_tools, data.prompt_key, system)
    if tokenizer is not None and not env_spec:
        out.train = _keep(out, out.train, "data.train", tokenizer, data, max_prompt_tokens)
        if out.eval:
            out.eval = _keep(out, out.eval, "data.eval", tokenizer, data, max_prompt_tokens)
    if rewards is not None:
        out.notes += rewards.describe()
    return out


def _env_factory(obj, spec: str):
    make = obj
    if not callable(make):
        raise ValueError(f"env: {spec!r} is a {type(obj).__name__}; expected an environment class or a factory function")
    try:
        probe = make()
    except TypeError as e:
        raise ValueError(f"env: {spec!r} must be constructible with no arguments (the row arrives in reset(row)): {e}") from None
    missing = [m for m in ("reset", "step", "fork") if not callable(getattr(probe, m, None))]
    if missing:
        raise ValueError(f"env: {spec!r} lacks {missing}; an environment has async reset(row) -> messages, "
                         "step(message) -> (observation, reward, done) and fork() (arbor.rollout.environment)")
    if len(inspect.signature(probe.reset).parameters) < 1:
        raise ValueError(f"env: {spec!r}'s reset takes no row; it must be reset(row) -> messages")
    return make


def _keep(task: Task, rows: list[dict], what: str, tokenizer, data, max_prompt_tokens: int) -> list[dict]:
    """``rows`` whose prompt reads and fits ``max_prompt_tokens``; the rest counted in ``task.dropped``."""
    from arbor.data.prompts import keep_rows, prompt_messages
    from arbor.rollout.chat import ChatLayout
    layout = ChatLayout(tokenizer, [t.schema for t in task.tools] or None, data.template_kwargs)
    kept, dropped, note = keep_rows(
        rows, lambda i, row: (row, len(layout.prompt_ids(prompt_messages(row, data.prompt_key, task.system, i)))),
        max_prompt_tokens, what)
    if note:
        task.dropped[what] = dropped
        task.notes.append(note)
    return kept


def get_diffusion_task(name: str):
    """The block-diffusion task module ``name`` (see module docstring)."""
    if name not in DIFFUSION_TASKS:
        raise ValueError(f"task '{name}' has no diffusion version; a block-diffusion model trains on one of "
                         f"{sorted(DIFFUSION_TASKS)} (task=...)")
    return DIFFUSION_TASKS[name]
