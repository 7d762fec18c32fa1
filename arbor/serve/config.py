"""``ServerConfig``: the limits and switches of ``arbor serve`` (one field per command-line flag)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from arbor.serve.openai_protocol import RequestError
from arbor.engine.sampling_params import SamplingParams


@dataclass
class ServerConfig:
    """Per request: at most ``max_n`` samples per prompt, ``max_prompts`` prompts, and
    prompts × n × min(max_tokens, context length) ≤ ``max_request_tokens`` generated tokens in all;
    a body of at most ``max_body_bytes``. ``api_key``: every route needs ``Authorization: Bearer
    KEY`` (None: open). ``/update_weights`` is refused unless ``enable_weight_updates``, and then
    reads only paths inside ``weight_updates_root`` (symbolic links resolved). On SIGTERM/SIGINT
    new requests get 503, running ones are aborted after ``shutdown_grace_s`` seconds.
    A block-diffusion model decodes in ``diffusion_mode`` unless a request names its ``mode``, and
    holds at most ``max_queued_requests`` requests waiting or decoding (more get 429)."""
    max_n: int = 16
    max_prompts: int = 64
    max_request_tokens: int = 65536
    max_body_bytes: int = 32 << 20
    api_key: str | None = None
    enable_weight_updates: bool = False
    weight_updates_root: str | None = None
    shutdown_grace_s: float = 5.0
    diffusion_mode: str = "quality"
    max_queued_requests: int = 64

    def __post_init__(self):
        from arbor.dllm.decoding import MODES
        if self.diffusion_mode not in MODES:
            raise ValueError(f"server diffusion_mode must be one of {MODES}, got {self.diffusion_mode!r}")
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
            raise RequestError(f"n = {params.n} is more than this server allows ({self.max_n}, --max-n)", "n")
        if num_prompts > self.max_prompts:
            raise RequestError(f"{num_prompts} prompts in one request is more than this server allows "
                               f"({self.max_prompts}, --max-prompts)", "prompt")
        tokens = min(params.max_tokens, context)
        total = num_prompts * params.n * tokens
        if total > self.max_request_tokens:
            raise RequestError(f"prompts × n × max_tokens = {num_prompts} × {params.n} × {tokens} = {total} tokens "
                               f"is more than this server generates for one request ({self.max_request_tokens}, "
                               "--max-request-tokens)", "max_tokens")

    def weights_path(self, path) -> Path:
        """The resolved path of new weights; RequestError 403 when updates are off or the path lies
        outside the root, 400 when it is not a usable path."""
        if not self.enable_weight_updates:
            raise RequestError("weight updates are off; start the server with --enable-weight-updates",
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
