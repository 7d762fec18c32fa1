"""The policy interface, and the two one-forward policies ``prefill-first`` and ``mixed``.

A policy owns one engine step end to end:

- ``schedule(scheduler) -> [(seq, num_tokens)]``: which sequences run and how many tokens each, built
  from the scheduler's blocks (``schedule_decodes``, ``schedule_prefills``), within its invariants
  (Σ chunk ≤ ``max_num_batched_tokens``, running ≤ ``max_num_seqs``, every token has a KV slot);
- ``step(engine) -> [seq]``: how the scheduled work runs — here one forward (``engine.run_batch``);
  the P/D policies run a prefill epoch cut into segments with decode steps at the boundaries;
- ``idle_step(engine)``: a lockstep (expert-parallel) rank with nothing of its own joins the other
  ranks' collectives of one step;
- ``close()``: stop what ``bind`` started (the P/D policies' worker threads);
- ``check(config)`` (a classmethod): ValueError when an ``EngineConfig`` cannot run under this
  policy, saying why. ``EngineConfig.validate`` calls it through the registry
  (``arbor.engine.policies.POLICIES``), so each refusal lives with the policy that knows its reason.

One policy object serves one engine (``bind(engine)`` once, before the first step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from arbor.engine.config import EngineConfig
    from arbor.engine.llm_engine import LLMEngine
    from arbor.engine.scheduler import ScheduledBatch, Scheduler
    from arbor.engine.sequence import Sequence


class Policy:
    name: ClassVar[str]

    @classmethod
    def check(cls, config: EngineConfig) -> None:
        """ValueError when ``config`` cannot run under this policy (nothing here: any config can)."""

    def bind(self, engine: LLMEngine) -> None:
        """Called once by the engine this policy steps."""

    def schedule(self, s: Scheduler) -> ScheduledBatch:
        raise NotImplementedError

    def step(self, engine: LLMEngine) -> list[Sequence]:
        """One forward of the scheduled batch (an idle one on a lockstep rank with nothing scheduled);
        → the sequences that got a token."""
        batch = engine.scheduler.schedule()
        if not batch:
            if engine.lockstep:
                engine.idle_step()
            return []
        return engine.run_batch(batch)

    @torch.inference_mode()
    def idle_step(self, engine: LLMEngine) -> list[Sequence]:
        """This rank's part (zero rows) of the other ranks' forward: their expert exchanges."""
        from arbor.models.expert_parallel import idle_forward
        idle_forward(engine.model)
        engine.num_steps += 1
        return []

    def stats(self) -> dict:
        """Counters of this policy (``LLMEngine.stats`` includes them)."""
        return {}

    def has_undelivered(self) -> bool:
        """Whether a later ``step`` still has sequences to return that the scheduler no longer holds
        (a policy whose workers run beside ``step``; nothing here: a step returns all it did)."""
        return False

    def drain(self) -> None:
        """Return once no forward of this policy is in flight (``LLMEngine.update_weights`` and ``abort``;
        nothing here: a one-forward step has ended when ``step`` returns)."""

    def close(self) -> None:
        """Stop what ``bind`` started (``LLMEngine.close``; nothing here)."""


class PrefillFirst(Policy):
    """A step is all-prefill (running chunks, then admissions) when any prefill work fits;
    otherwise all-decode."""
    name = "prefill-first"

    def schedule(self, s: Scheduler) -> ScheduledBatch:
        batch: ScheduledBatch = []
        if s.has_prefill_work():
            s.schedule_prefills(batch, s.budget)
            if batch:
                return batch
        s.schedule_decodes(batch, s.budget)
        return batch


class Mixed(Policy):
    """Decodes first, then prefill chunks and admissions fill the rest of the budget; one forward."""
    name = "mixed"

    def schedule(self, s: Scheduler) -> ScheduledBatch:
        batch: ScheduledBatch = []
        budget = s.schedule_decodes(batch, s.budget)
        s.schedule_prefills(batch, budget)
        return batch
