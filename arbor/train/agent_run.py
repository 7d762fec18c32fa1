"""What ``arbor train agent=my_agent.py:run`` builds around the RL trainer: the agent's rows (``Task``)
and its collector (``arbor.rollout.agent_collector.AgentCollector`` over the trainer's endpoint,
``arbor.rollout.agent_server.AgentEndpoint``), in place of a built-in environment's. Without
``agent.fn`` the trainer's collector is the built-in one (``arbor.rollout.collector.Collector``).
"""

from __future__ import annotations

from pathlib import Path


def agent_task(cfg):
    """The rows an agent runs on (``data.train`` / ``data.eval``, or ``task=NAME``'s generated rows), as a
    ``Task`` with no environment; its ``rewards`` are ``reward.fns`` (None when unset: ``run`` returns
    the reward). A row reaches the agent whole; no prompt column is required."""
    from arbor.data.rewards import Rewards
    from arbor.tasks.registry import load_task
    task = load_task(task=cfg.task, data=cfg.data, reward=cfg.reward, tools=[], env="", seed=cfg.seed,
                     n_train=max(4096, cfg.steps * cfg.c3po.capacity * 2), n_eval=cfg.eval_problems,
                     need_reward=False)
    task.rewards = Rewards(cfg.reward) if cfg.reward.fns else None
    task.tools, task.make_env = [], lambda: None
    if task.rewards is not None:
        task.notes += task.rewards.describe()
    task.notes.append(f"agent {cfg.agent.fn}: {cfg.rollout.branch[0]} episodes per row, each at most "
                      f"{cfg.agent.timeout_s:g} s; dropped episodes go to {Path(cfg.out) / 'agent_errors.jsonl'}")
    return task


def make_collector(cfg, engine, tok, sampling_factory, task, model):
    """The trainer's collector: the agent's (``agent.fn`` set) or the built-in environments'."""
    if not cfg.agent.fn:
        from arbor.rollout.collector import Collector
        return Collector(engine, tok, cfg.rollout, sampling_factory, cfg.data.template_kwargs)
    from arbor.rollout.agent_collector import AgentCollector
    from arbor.rollout.agent_config import load_agent
    from arbor.rollout.agent_server import AgentEndpoint, require_openai
    require_openai()
    agent = load_agent(cfg.agent.fn)
    moe = bool(getattr(model.config, "moe_layers", None))
    endpoint = AgentEndpoint(engine, tok, moe, cfg.data.template_kwargs)
    return AgentCollector(endpoint, agent, cfg.rollout, cfg.agent.timeout_s, task.rewards, cfg.data.prompt_key,
                          Path(cfg.out) / "agent_errors.jsonl")
