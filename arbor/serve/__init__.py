"""One OpenAI-compatible HTTP server (completions, chat, tools, streaming, auth, limits) with a pluggable
backend (``app``: ``make_app``, ``Backend``): the autoregressive engine (``server.EngineBackend``, one
process or N ranks: ``ranks``) or another (the block-diffusion one is ``arbor.dllm.server``'s);
the caller picks. ``config``: ``ServeConfig`` / ``ServerConfig``."""
