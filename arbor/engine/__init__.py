"""Inference engine: sequences, KV cache, scheduler, model runner, sampler, block-diffusion decoding."""

from arbor.engine.async_engine import AsyncLLMEngine
from arbor.engine.config import EngineConfig
from arbor.engine.llm_engine import LLMEngine
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion

__all__ = ["AsyncLLMEngine", "Completion", "EngineConfig", "LLMEngine", "SamplingParams"]
