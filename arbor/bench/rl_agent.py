"""The cost of training an OpenAI-client agent through the trainer's endpoint (``arbor bench rl
--workload agent``): the same episodes, once as a built-in environment and once as an agent.

Workload ``agent``: ``prompts`` groups × ``samples`` episodes per step; an episode is a system prompt of
``system_tokens`` tokens + a short task, ``turns`` model turns of ``new_tokens`` tokens each (EOS
ignored), and after every turn but the last a tool answer of exactly ``tool_tokens`` tokens; the reward
is the share of letters a…j in the last turn (``arbor.bench.rl_workloads``). Both sides have the same
token counts per step, so their step times compare the paths, not the samples.

- built-in: ``BenchEnvironment`` under the trainer's collector (the engine streamed in process);
- agent: ``bench_agent`` — the same episode written with the ``openai`` package
  (``client.chat.completions.create`` with ``extra_body={"ignore_eos": true}``, the tool answer as a
  ``role: "tool"`` message) — under ``agent.fn``: every model turn is an HTTP request to the endpoint
  on 127.0.0.1, rendered, recorded and merged back into one trajectory per episode.

Both run ``arbor.train.rl.RLTrainer`` synchronously (C3PO++ off), all steps on one event loop as
``arbor train`` runs them, alternated side by side for ``--rounds`` rounds; each step is timed whole
and per phase; medians over ``--steps`` steps after one warm-up step. Target: agent step time ≤ 1.2 ×
the built-in one (the HTTP hop's overhead).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from pathlib import Path

from arbor.bench.common import median, print_table, print_targets, target, write_result
from arbor.bench.rl_workloads import Workload, default_model, make_task, score, text_of_tokens

WANTED = 1.2
CURRENT: dict = {}        # the workload, tokenizer and system prompt ``bench_agent`` runs (set by ``run``)


def agent_workload(prompts: int | None = None, new_tokens: int | None = None) -> Workload:
    return Workload("agent", prompts or 4, (4,), new_tokens or 32, turns=3, system_tokens=256, tool_min=64, tool_max=64)


async def bench_agent(client, row) -> float:
    """``BenchEnvironment``'s episode, written against the OpenAI API."""
    w, tok, system = CURRENT["workload"], CURRENT["tok"], CURRENT["system"]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": row["prompt"]})
    for turn in range(1, w.turns + 1):
        r = await client.chat.completions.create(model="arbor-policy", messages=messages, max_tokens=w.new_tokens,
                                                 extra_body={"ignore_eos": True})
        text = r.choices[0].message.content or ""
        if turn == w.turns:
            return score(text)
        h = zlib.crc32(f"{row['index']}/{turn}/{text}".encode())
        messages += [{"role": "assistant", "content": text},
                     {"role": "tool", "content": text_of_tokens(tok, w.tool_min, h)}]
    return 0.0


def trainer(model_dir, w: Workload, steps: int, engine_dtype: str, device: str, agent: bool):
    """The RL trainer of ``arbor train`` on ``w``: its built-in environment, or (``agent``) ``bench_agent``."""
    import torch

    from arbor.engine.config import EngineConfig
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    from arbor.rollout.agent_config import AgentConfig
    from arbor.train.config import C3POConfig, RLConfig, RLRolloutConfig, engine_config
    from arbor.train.rl import RLTrainer
    from arbor.train.run import make_engine
    torch.manual_seed(0)
    model = load_model(model_dir, dtype=torch.float32, device=device)
    tok = Tokenizer.load(model_dir)
    extra = {"agent": AgentConfig(fn="arbor.bench.rl_agent:bench_agent", timeout_s=600.0)} if agent else {}
    cfg = RLConfig(model=str(model_dir), task="bench-agent", seed=0, device=device, steps=steps + 1,
                   groups_per_step=w.prompts, checkpoint_every=0, engine=EngineConfig(dtype=engine_dtype),
                   c3po=C3POConfig(enabled=False), out=str(Path(model_dir).parent / "rl_agent_run"),
                   rollout=RLRolloutConfig(max_turn_tokens=w.new_tokens, max_context=w.max_context,
                                           branch=list(w.branch), end_on_truncation=False), **extra)
    cfg.validate()
    engine, sampling = make_engine(model, tok, engine_config(cfg))
    return RLTrainer(cfg, model, tok, engine, sampling, make_task(w, tok))


async def _time_steps(trainer, steps: int) -> dict:
    """``steps`` + 1 training steps on this event loop → medians after the first (module docstring)."""
    hist, walls = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        row = await trainer.train_step()
        walls.append(time.perf_counter() - t0)
        hist.append(row)
    hist, walls = hist[1:], walls[1:]
    phases = ("rollout_s", "recompute_s", "train_s", "sync_s")
    return {"step_s": median(walls), "steps_s": walls, "tokens_per_step": median([r["tokens"] for r in hist]),
            "samples_per_step": median([r["samples"] for r in hist]),
            "phases_s": {k: median([r[k] for r in hist]) for k in phases},
            "dropped": sum(r.get("agent_dropped", 0) for r in hist)}


def run(out_dir="bench_results", model=None, steps=3, rounds=1, engine_dtype="float32", device="cpu",
        prompts=None, threads: int = 0) -> dict:
    import torch

    from arbor.models.tokenizer import Tokenizer
    out = Path(out_dir)
    model_dir = Path(model) if model else default_model(out / "rl_model")
    w = agent_workload(prompts)
    tok = Tokenizer.load(model_dir)
    CURRENT.update(workload=w, tok=tok, system=text_of_tokens(tok, w.system_tokens, 512))
    if threads:
        torch.set_num_threads(threads)
    runs = {"builtin": [], "agent": []}
    for _ in range(rounds):
        for side in runs:
            made = trainer(model_dir, w, steps, engine_dtype, device, agent=side == "agent")
            runs[side].append(asyncio.run(_time_steps(made, steps)))
    sides = {k: {**v[0], "step_s": median([r["step_s"] for r in v]), "rounds": v} for k, v in runs.items()}
    ratio = sides["agent"]["step_s"] / sides["builtin"]["step_s"]
    tokens_equal = sides["agent"]["tokens_per_step"] == sides["builtin"]["tokens_per_step"]
    result = {"workload": {"name": w.name, "prompts": w.prompts, "samples": w.samples, "turns": w.turns,
                           "new_tokens": w.new_tokens, "system_tokens": w.system_tokens, "tool_tokens": w.tool_min},
              "steps": steps, "rounds": rounds, "engine_dtype": engine_dtype, "device": device,
              "threads": threads or torch.get_num_threads(), "model": str(model_dir), **sides,
              "agent_over_builtin": ratio, "same_trained_tokens": tokens_equal,
              "targets": [target("agent: RL step through the endpoint / built-in environment (median)", round(ratio, 3),
                                 f"≤ {WANTED}", ratio <= WANTED and tokens_equal)]}
    print_table("RL step, agent workload (medians)", ["path", "step s", "rollout s", "train s", "tokens/step"],
                [[k, f"{v['step_s']:.3f}", f"{v['phases_s']['rollout_s']:.3f}", f"{v['phases_s']['train_s']:.3f}",
                  v["tokens_per_step"]] for k, v in sides.items()])
    print_targets(result["targets"])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 2.6))
        names, phases = list(sides), ("rollout_s", "recompute_s", "train_s", "sync_s")
        for i, phase in enumerate(phases):
            ax.barh(names, [sides[n]["phases_s"][phase] for n in names], label=phase[:-2],
                    left=[sum(sides[n]["phases_s"][q] for q in phases[:i]) for n in names])
        ax.set_xlabel("seconds per RL step (median)")
        ax.set_title(f"agent through the endpoint: {ratio:.2f}x the built-in environment")
        ax.legend(fontsize=7)
        return fig

    write_result(out, "rl-agent", result, plot)
    return result
