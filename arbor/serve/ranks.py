"""``arbor serve MODEL ranks=N``: the OpenAI server over N ranks of a distributed engine.

Every rank runs ``serve_ranks``: it loads the folder under ``init_distributed``; rank 0 serves HTTP
(only it binds the port) over ``AsyncLLMEngine(RankFront)`` and ranks ≥ 1 apply rank 0's rounds
(``arbor.engine.rank_front``: the protocol, its rounds, heartbeat and stop). Shutdown: SIGTERM or
SIGINT to rank 0 (``arbor launch`` forwards its first signal to every rank as SIGTERM), or the
launcher gone (this rank re-parented), stops the server; rank 0 then sends ``stop`` and every rank
exits 0 after one barrier.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from arbor.engine.async_engine import AsyncLLMEngine
from arbor.engine.rank_front import RankFront, agree_context_length, worker_loop
from arbor.serve.config import ServerConfig
from arbor.serve.server import build_app


def _orphaned() -> bool:
    """The launcher that started this rank died (the rank was re-parented)."""
    launcher = os.environ.get("ARBOR_LAUNCHER_PID")
    return bool(launcher) and os.getppid() != int(launcher)


def serve_front(front: RankFront, host: str, port: int, model_name: str, server_config: ServerConfig | None = None):
    """Rank 0: HTTP over ``front`` until a signal or the launcher's end; a heartbeat round meanwhile
    whenever none went out for ``rank_front.HEARTBEAT_S``; ``stop`` to every rank at the end."""
    import uvicorn

    app = build_app(AsyncLLMEngine(front), model_name, server_config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port))

    def on_signal(signum, frame):       # uvicorn re-raises the signals it caught into these after it stops
        server.should_exit = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    async def watch():
        while True:
            await asyncio.sleep(0.2)
            if _orphaned():
                server.should_exit = True
            front.heartbeat()

    async def main():
        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        front.close()


def serve_ranks(model_dir: str, host: str, port: int, config, model_name: str | None = None,
                server_config: ServerConfig | None = None) -> None:
    """This process's part of a multi-rank server (``config``: its ``EngineConfig``); the rank comes
    from torchrun's environment."""
    from arbor.distributed import DistConfig, init_distributed
    from arbor.engine.llm_engine import LLMEngine
    from arbor.models import ModelConfig
    ctx = init_distributed(DistConfig(), num_experts=ModelConfig.from_file(model_dir).num_experts,
                           device=config.device)
    engine = LLMEngine(model_dir, config, ctx=ctx)
    agree_context_length(engine, ctx)
    if ctx.rank == 0:
        print(f"arbor serve: {ctx.world_size} ranks (expert-parallel over {ctx.ep_size})", flush=True)
        serve_front(RankFront(engine, ctx), host, port, model_name or Path(model_dir).name, server_config)
    else:
        worker_loop(engine, ctx)
    # Every rank knows of the stop. Tearing a gloo group down while its peer exits can abort the
    # process in C++ ("terminate called without an active exception"), so a served rank leaves
    # without destructors once its output is flushed.
    ctx.barrier("serve: stopped")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


__all__ = ["serve_front", "serve_ranks"]
