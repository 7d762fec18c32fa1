"""Inference engine: sequences, KV cache, scheduler, model runner, sampler, block-diffusion decoding.

Public API: ``LLMEngine(model_or_path, EngineConfig, tokenizer=None)`` with ``generate``,
``add_request / step / abort``, ``update_weights``; ``AsyncLLMEngine`` (streaming ``generate``,
``pause / resume``); ``SamplingParams``; ``Completion``. ``arbor.serve.server.build_app`` serves
an ``AsyncLLMEngine`` over OpenAI-compatible HTTP.
"""

from arbor.engine.async_engine import AsyncLLMEngine
from arbor.engine.config import EngineConfig
from arbor.engine.llm_engine import LLMEngine
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion

__all__ = ["AsyncLLMEngine", "Completion", "EngineConfig", "LLMEngine", "SamplingParams"]
