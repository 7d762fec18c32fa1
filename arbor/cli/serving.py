"""``arbor generate`` and ``arbor serve``: a model folder's family picks the decoder and the server backend
(``arbor.families``); engine keys are ``engine.KEY=VALUE`` words, short flags are aliases of keys."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from arbor.cli.common import flag_words


_UNSET = object()


def _threshold_or_none(text: str):
    return None if text.lower() == "none" else float(text)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate completions of prompts from a checkpoint",
                       description="arbor generate MODEL [engine.KEY=VALUE …] PROMPT …: a word engine.KEY=VALUE sets "
                                   "an EngineConfig key (arbor serve --help lists them)")
    p.add_argument("model", help="HF-layout checkpoint folder")
    p.add_argument("prompts", nargs="*", help="prompts, and engine.KEY=VALUE words")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; taken as is)")
    p.add_argument("--device", help="= engine.device=…")
    a = p.add_argument_group("autoregressive (arbor.engine.LLMEngine)")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--seed", type=int)
    a.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    a.add_argument("--dtype", help="= engine.dtype=…")
    d = p.add_argument_group("block diffusion (the default for block-diffusion checkpoints)")
    d.add_argument("--diffusion", action="store_true", help="decode with arbor.dllm.decoding")
    d.add_argument("--mode", choices=["quality", "speed", "threshold"], default="quality",
                   help="LLaDA2.1 preset, or Fast-dLLM threshold decoding")
    d.add_argument("--method", choices=["editing", "threshold", "low_confidence"])
    d.add_argument("--threshold", type=float)
    d.add_argument("--editing-threshold", type=_threshold_or_none, default=_UNSET, help="a float, or 'none' (off)")
    d.add_argument("--max-post-steps", type=int)
    d.add_argument("--block-size", type=int, help="default: the model's block_size")
    d.add_argument("--steps-per-block", type=int)
    d.add_argument("--gen-length", type=int, default=32)
    d.add_argument("--no-cache", action="store_true", help="re-forward all blocks every step (reference path)")
    d.add_argument("--show-steps", action="store_true",
                   help="print the response after every forward (_ = mask, · = stop) with its unmasks and edits")
    p.set_defaults(func=_run_generate, trailing_words="prompts")


def _run_generate(a) -> None:
    import re

    from arbor import configs
    from arbor.engine import EngineConfig
    from arbor.families import FAMILIES, family
    key = re.compile(r"engine\.[A-Za-z_]\w*=")
    words = [w.removeprefix("engine.") for w in a.prompts if key.match(w)]
    words += flag_words(a, {"device": "device", "dtype": "dtype"})
    a.engine = configs.load(EngineConfig, None, words)
    a.prompts = [w for w in a.prompts if not key.match(w)] + a.prompt
    if not a.prompts:
        raise ValueError("give at least one prompt (positional or --prompt)")
    fam = FAMILIES["block_diffusion"] if a.diffusion else family(a.model)
    a.diffusion_knobs = {k: getattr(a, k) for k in ("method", "threshold", "max_post_steps", "block_size",
                                                       "steps_per_block") if getattr(a, k) is not None}
    if a.editing_threshold is not _UNSET:
        a.diffusion_knobs["editing_threshold"] = a.editing_threshold
    for prompt, (text, summary, steps) in zip(a.prompts, fam.generate(a.model, a.prompts, a.engine, a)):
        print(f"{prompt}{text}	[{summary}]")
        for line in steps:
            print(line)


class _PolicyNames:
    """The ``--policy`` choices: the engine's policy registry, imported when argparse first reads them."""

    def _names(self) -> list[str]:
        from arbor.engine.policies import POLICIES
        return sorted(POLICIES)

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


SERVE_FLAGS = {"host": "host", "port": "port", "ranks": "ranks", "served_model_name": "served_model_name",
               "policy": "engine.policy", "device": "engine.device", "api_key": "server.api_key"}


def add_serve(sub) -> None:
    help = "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) over a model folder"
    p = sub.add_parser("serve", help=help, config="arbor.serve.config:ServeConfig",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=help + ". arbor serve MODEL [cfg.toml] [key=value …]: engine.KEY sets the engine "
                       "(EngineConfig), server.KEY the server's limits (ServerConfig); a short flag is its key=value "
                       "word, applied last.")
    p.add_argument("model", help="HF-layout checkpoint folder")
    p.add_argument("overrides", nargs="*", help="[cfg.toml] key=value …, e.g. port=9000 engine.max_model_len=2048")
    p.add_argument("--host", help="= host=… (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="= port=… (default 8000)")
    p.add_argument("--ranks", type=int, help="= ranks=…: serve from N local ranks (experts split when MoE)")
    p.add_argument("--served-model-name", help="= served_model_name=… (default: the folder name)")
    p.add_argument("--policy", choices=_PolicyNames(), help="= engine.policy=…")
    p.add_argument("--device", help="= engine.device=…")
    p.add_argument("--api-key", help="= server.api_key=… (default: $ARBOR_API_KEY; none: open)")
    p.set_defaults(func=_run_serve, trailing_words="overrides")


def _run_serve(a):
    from arbor.serve.config import load_serve_config
    path = a.overrides[0] if a.overrides and "=" not in a.overrides[0] else None     # a leading TOML file
    words = [*a.overrides[path is not None:], *flag_words(a, SERVE_FLAGS)]
    cfg = load_serve_config(a.model, path, words)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.ranks > 1 and "WORLD_SIZE" not in os.environ:       # start the ranks, each re-running this command
        from arbor.distributed.launch import launch
        if cfg.server.api_key:          # to the ranks through the environment, not their command lines
            os.environ["ARBOR_API_KEY"] = cfg.server.api_key
        argv = ["serve", a.model, *([path] if path else []), *(w for w in words if not w.startswith("server.api_key="))]
        return launch([sys.executable, "-m", "arbor.cli", *argv], cfg.ranks).returncode
    if cfg.ranks > 1 and world != cfg.ranks:
        raise ValueError(f"ranks={cfg.ranks} but this process is one of WORLD_SIZE={world} ranks")
    name = cfg.served_model_name or Path(a.model).name
    if world > 1:                                              # a rank (arbor launch, torchrun, ranks=N)
        from arbor.serve.ranks import serve_ranks
        return serve_ranks(a.model, cfg.host, cfg.port, cfg.engine, name, cfg.server)
    from arbor.families import family
    from arbor.serve.server import serve
    serve(family(a.model).server_backend(a.model, cfg.engine, cfg.server), name, cfg.host, cfg.port, cfg.server)
