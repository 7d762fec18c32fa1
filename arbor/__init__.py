"""Arbor: RL post-training for agentic LLMs."""
