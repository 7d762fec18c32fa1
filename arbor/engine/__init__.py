"""Inference engine: sequences, KV cache, scheduler, model runner, sampler, block-diffusion decoding."""
