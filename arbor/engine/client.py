"""The engine front ends' shared interface.

Every front end answers the same four calls — ``generate``, ``abort(request_id)``,
``update_weights(named_tensors) -> seconds`` and ``stats() -> dict`` (queue lengths, KV use,
counters) — in one of two shapes, which differ only in ``generate``:

- ``EngineClient`` (async, streaming): ``generate(prompt, params=None, request_id=None)`` is an async
  iterator of cumulative ``Completion`` snapshots of one request (one per new token of each of its
  ``params.n`` samples; ``text`` on a sample's final one), and ``session()`` is the async context
  inside which it streams (collective on a lockstep engine, a no-op otherwise). What callers that
  take "an engine" type against: the rollout collector and trainer, the OpenAI server, the cluster.
  Implemented by ``AsyncLLMEngine``, ``ThreadedAsyncLLMEngine`` and ``cluster.RemoteEngine``.
- ``SteppedEngine`` (sync, stepped in the caller's thread): ``generate(prompts, params=None)`` runs a
  batch to the end and returns the final completions in prompt order (the n samples of a prompt
  consecutive); ``add_request`` / ``step`` / ``has_unfinished`` / ``check_request`` drive it one step
  at a time. Implemented by ``LLMEngine`` and ``rank_front.RankFront``; ``AsyncLLMEngine(engine)``
  adapts any ``SteppedEngine`` into an ``EngineClient``.

The protocols are ``runtime_checkable``: ``isinstance`` checks that the methods exist (not their
signatures, nor sync versus async); the shapes above are what type checkers see. Data attributes a
stepped engine also has (``tokenizer``, ``model``, ``max_model_len``, ``requests``, ``lockstep``)
are documented on ``LLMEngine`` and left out here, so ``issubclass`` works on the protocols.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import AsyncIterator, Protocol, runtime_checkable

from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion


@runtime_checkable
class EngineClient(Protocol):
    """A streaming engine front end (module docstring)."""

    def generate(self, prompt, params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[Completion]: ...

    def session(self) -> AbstractAsyncContextManager: ...

    def abort(self, request_id: str) -> None: ...

    def update_weights(self, named_tensors) -> float: ...

    def stats(self) -> dict: ...


@runtime_checkable
class SteppedEngine(Protocol):
    """A synchronous engine stepped by its caller (module docstring)."""

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]: ...

    def check_request(self, prompt, params: SamplingParams) -> list[int]: ...

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str) -> None: ...

    def update_weights(self, named_tensors) -> float: ...

    def stats(self) -> dict: ...


__all__ = ["EngineClient", "SteppedEngine"]
