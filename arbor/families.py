"""Model families: what each Arbor command does with a model folder, chosen once from its config.json.

``family(model_dir)`` reads the folder's ``model_type`` (``ModelConfig.family``) and answers its
``Family``: how ``arbor train`` / ``arbor eval`` build a trainer, how ``arbor serve`` builds a server
backend, how ``arbor generate`` decodes, and whether the family runs on Ray. Two families exist:

- ``autoregressive`` (Qwen3, Qwen3-MoE, Qwen3-Next, …): the paged engine (``arbor.engine``), the RL
  trainer over rollout trees (``arbor.train``), the engine server backend (``arbor.serve``);
- ``block_diffusion`` (``arbor_block_diffusion``): threshold decoding with editing
  (``arbor.dllm.decoding``), EBPO (``arbor.dllm.ebpo_trainer``), the diffusion server backend.

This is the only module that tells the families apart; everything under it is written for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    build_trainer: Callable        # RLConfig → trainer with async ``run()`` / ``evaluate(n)`` and ``ctx``
    server_backend: Callable       # (model_dir, EngineConfig, ServerConfig) → a backend for ``arbor.serve.server.serve``
    generate: Callable             # (model_dir, prompts, EngineConfig, options) → [(text, summary line, extra lines)]
    on_ray: bool                   # ``arbor train cluster.backend=ray`` runs it


def _ar_trainer(cfg):
    from arbor.train.run import build_trainer
    return build_trainer(cfg)


def _ar_backend(model_dir, engine_cfg, server_cfg):
    from arbor.serve.server import engine_backend
    return engine_backend(model_dir, engine_cfg)


def _ar_generate(model_dir, prompts, engine_cfg, o) -> list:
    from arbor.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model_dir, engine_cfg)
    if engine.tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json; text prompts need one")
    texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             if o.chat else p for p in prompts]
    params = SamplingParams(max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p, seed=o.seed)
    return [(c.text, f"{len(c.token_ids)} tokens, {c.finish_reason}, {c.latency:.2f} s", [])
            for c in engine.generate(texts, params)]


def _dllm_trainer(cfg):
    from arbor.dllm.ebpo_trainer import build_ebpo_trainer
    return build_ebpo_trainer(cfg)


def _dllm_backend(model_dir, engine_cfg, server_cfg):
    from arbor.dllm.server import diffusion_backend
    return diffusion_backend(model_dir, engine_cfg, server_cfg)


def _dllm_generate(model_dir, prompts, engine_cfg, o) -> list:
    from arbor.dllm.decoding import generate_text, mode_config, trajectory_lines
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    cfg = mode_config(o.mode, gen_length=o.gen_length, use_cache=not o.no_cache, **o.diffusion_knobs)
    cfg.record = o.show_steps
    model, tok = load_model(model_dir, device=engine_cfg.device).eval(), Tokenizer.load(model_dir)
    out = []
    for text, r in generate_text(model, tok, prompts, cfg):
        steps = trajectory_lines(r.trajectory, model.config.mask_token_id, tok) if o.show_steps else []
        out.append((text, f"{r.num_tokens} tokens, {r.forwards} forwards, TPF {r.tpf:.2f}, {r.edits} edits", steps))
    return out


FAMILIES = {
    "autoregressive": Family("autoregressive", _ar_trainer, _ar_backend, _ar_generate, on_ray=True),
    "block_diffusion": Family("block_diffusion", _dllm_trainer, _dllm_backend, _dllm_generate, on_ray=False),
}


def family(model_dir) -> Family:
    """The family of the model folder ``model_dir`` (its config.json's ``model_type``)."""
    from arbor.models import ModelConfig
    return FAMILIES[ModelConfig.from_file(model_dir).family]


def train(cfg) -> list[dict]:
    """``arbor train`` with a ``ClusterRLConfig``: on Ray (``cluster.backend=ray``) or in this process
    (one rank, or each rank under ``arbor launch``), with the trainer of the model's family."""
    from arbor.cluster.config import plain_rl_config
    fam = family(cfg.model)
    if cfg.cluster.backend == "ray":
        if not fam.on_ray:
            raise ValueError(f"cluster.backend=ray runs autoregressive models; {cfg.model} is a {fam.name} model "
                             "(its RL runs in one process or under `arbor launch`)")
        from arbor.cluster.run import train as train_on_ray
        return train_on_ray(cfg)
    from arbor.train.run import train as train_here
    return train_here(plain_rl_config(cfg), fam.build_trainer)


def evaluate(model_dir: str, task: str, n: int, device: str = "cpu", overrides: list[str] = ()) -> dict:
    """``arbor eval``: held-out metrics of ``model_dir`` on ``n`` rows of ``task`` or of ``data.eval``
    (``overrides``: RL config keys), with the trainer of its family."""
    from arbor.train.run import evaluate_metrics
    return evaluate_metrics(model_dir, task, n, device, family(model_dir).build_trainer, overrides)
