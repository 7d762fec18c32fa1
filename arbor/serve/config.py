"""``arbor serve``'s configuration: ``ServeConfig`` (where to listen, and the ``engine`` and ``server``
sections: ``arbor serve MODEL [cfg.toml] [key=value …]``) and ``ServerConfig`` (the server's limits
and switches, whatever its backend)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from arbor.engine.config import EngineConfig
from arbor.engine.sampling_params import SamplingParams
from arbor.serve.openai_protocol import RequestError


@dataclass
class ServerConfig:
    """Per request: at most ``max_n`` samples per prompt, ``max_prompts`` prompts, and
    prompts × n × min(max_tokens, context length) ≤ ``max_request_tokens`` generated tokens in all;
    a body of at most ``max_body_bytes``. ``api_key``: every route needs ``Authorization: Bearer
    KEY`` (None: open). ``/update_weights`` is refused unless ``enable_weight_updates``, and then
    reads only paths inside ``weight_updates_root`` (symbolic links resolved). On SIGTERM/SIGINT
    new requests get 503, running ones are aborted after ``shutdown_grace_s`` seconds.
    A block-diffusion model decodes in ``diffusion_mode`` unless a request names its ``mode`` (the
    diffusion backend checks the name), and holds at most ``max_queued_requests`` requests waiting or
    decoding (more get 429)."""
    max_n: int = 16                         # most samples per prompt (n)
    max_prompts: int = 64                   # most prompts in one completions request
    max_request_tokens: int = 65536         # most tokens one request may generate: prompts × n × max_tokens
    max_body_bytes: int = 32 << 20          # largest request body, bytes
    api_key: str | None = None              # require 'Authorization: Bearer KEY' on every route (None: open)
    enable_weight_updates: bool = False     # allow POST /update_weights
    weight_updates_root: str | None = None  # /update_weights reads only in here (arbor serve: the model's parent)
    shutdown_grace_s: float = 5.0           # seconds requests may run on after SIGTERM/SIGINT before they are aborted
    diffusion_mode: str = "quality"         # block-diffusion models: the mode of requests that name none
    max_queued_requests: int = 64           # block-diffusion models: requests waiting or decoding

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field no server can run with."""
        for name in ("max_n", "max_prompts", "max_request_tokens", "max_body_bytes", "max_queued_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"server {name} must be a positive integer, got {value!r}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"server shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.enable_weight_updates:
            if not self.weight_updates_root:
                raise ValueError("weight updates need a root folder the new weights must lie in (weight_updates_root)")
            if not Path(self.weight_updates_root).is_dir():
                raise ValueError(f"weight_updates_root '{self.weight_updates_root}' is not a folder")

    def check_size(self, params: SamplingParams, num_prompts: int, context: int) -> None:
        """RequestError (400) when a request asks for more than the limits allow."""
        if params.n > self.max_n:
            raise RequestError(f"n = {params.n} is more than this server allows ({self.max_n}, server.max_n)", "n")
        if num_prompts > self.max_prompts:
            raise RequestError(f"{num_prompts} prompts in one request is more than this server allows "
                               f"({self.max_prompts}, server.max_prompts)", "prompt")
        tokens = min(params.max_tokens, context)
        total = num_prompts * params.n * tokens
        if total > self.max_request_tokens:
            raise RequestError(f"prompts × n × max_tokens = {num_prompts} × {params.n} × {tokens} = {total} tokens "
                               f"is more than this server generates for one request ({self.max_request_tokens}, "
                               "server.max_request_tokens)", "max_tokens")

    def weights_path(self, path) -> Path:
        """The resolved path of new weights; RequestError 403 when updates are off or the path lies
        outside the root, 400 when it is not a usable path."""
        if not self.enable_weight_updates:
            raise RequestError("weight updates are off; start the server with server.enable_weight_updates=true",
                               "path", "weight_updates_disabled", 403)
        if not isinstance(path, str) or not path:
            raise RequestError("'path' (a safetensors file or HF folder) is required", "path")
        try:
            target, root = Path(path).resolve(), Path(self.weight_updates_root).resolve()
            os.fsencode(str(target))
        except (OSError, ValueError) as e:
            raise RequestError(f"'path' is not a usable path: {e}", "path") from None
        if not target.is_relative_to(root):
            raise RequestError(f"'{path}' is outside the folder weight updates may read from", "path",
                               "path_not_allowed", 403)
        return target


@dataclass
class ServeConfig:
    """``arbor serve MODEL [cfg.toml] [key=value …]``: the address, the served name, the number of local
    ranks (data-parallel attention; an MoE model's experts split over them), and the ``engine``
    (``EngineConfig``) and ``server`` (``ServerConfig``) sections, each validated by its own class."""
    host: str = "127.0.0.1"                 # address to bind (127.0.0.1: this machine only)
    port: int = 8000                        # port to bind
    served_model_name: str | None = None    # the model's name in the API (default: the folder name)
    ranks: int = 1                          # serve from N local ranks
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port!r}")


def load_serve_config(model_dir: str, path: str | None = None, overrides=()) -> ServeConfig:
    """The ``ServeConfig`` of serving ``model_dir``: the defaults, with ``server.api_key`` from
    ``$ARBOR_API_KEY`` and ``server.weight_updates_root`` the model folder's parent; then the TOML
    file ``path``; then the ``key=value`` words (``arbor.configs``), every section validated once."""
    from arbor import configs

    def defaults() -> ServeConfig:
        return ServeConfig(server=ServerConfig(api_key=os.environ.get("ARBOR_API_KEY") or None,
                                               weight_updates_root=str(Path(model_dir).resolve().parent)))

    return configs.load(defaults, path, list(overrides))
