"""Inference engine: sequences, paged KV (``kv``), scheduler and its policies (``policies``), model
runner, sampler.

Public API: ``LLMEngine(model_or_path, EngineConfig, tokenizer=None)`` with ``generate``,
``add_request / step / abort``, ``update_weights``, ``stats``; ``AsyncLLMEngine`` (streaming
``generate``, ``pause / resume``); ``SamplingParams``; ``Completion``; the front ends' shared
interface ``EngineClient`` / ``SteppedEngine`` (``client``). ``arbor.serve`` serves an engine over
OpenAI-compatible HTTP.
"""

from arbor.engine.async_engine import AsyncLLMEngine
from arbor.engine.client import EngineClient, SteppedEngine
from arbor.engine.config import EngineConfig
from arbor.engine.llm_engine import LLMEngine
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion

__all__ = ["AsyncLLMEngine", "Completion", "EngineClient", "EngineConfig", "LLMEngine", "SamplingParams",
           "SteppedEngine"]
