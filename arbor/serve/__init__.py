"""One OpenAI-compatible HTTP server (completions, chat, tools, streaming, auth, limits) over an engine
front end; block-diffusion models plug in their backend from ``arbor.dllm.server``."""
