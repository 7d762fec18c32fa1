"""Continuous batching under a per-step token budget, with pluggable policies.

Every running sequence has ``num_pending_tokens ≥ 1``: 1 for a decode (its last sampled token),
more for a prompt (or a recomputed sequence) still in prefill. A step schedules, per sequence,
a number of tokens (a chunk); a sequence samples when its chunk reaches its last token.
Invariants: Σ chunk ≤ ``max_num_batched_tokens``; running ≤ ``max_num_seqs``; every scheduled
token has a KV slot. When a decode needs a block and none is free, the newest running sequence
is preempted by recompute (blocks freed, computed count reset, re-queued at the front).
For models with linear-attention layers (``BlockManager.states``) prefill chunks end on block
boundaries where they can (the tail after the last boundary runs as its own chunk), so the
recurrent state at those boundaries can be snapshotted for prefix caching.

What a step schedules is the policy's (``arbor.engine.policies``: ``policy.schedule(scheduler) ->
[(seq, num_tokens)]``, built from the blocks below):
- ``prefill-first``: a step is all-prefill (running chunks, then admissions) when any prefill
  work fits; otherwise all-decode.
- ``mixed``: decodes first, then prefill chunks and admissions fill the rest of the budget, one forward.
- ``pd-multiplex`` / ``pd-global-enqueue``: decodes on a decode worker, prefill in the budget they
  leave on a prefill worker, the two running concurrently; decode steps admitted at every prefill
  segment boundary or at epoch starts only (``arbor.engine.policies.pd_multiplex``).
- ``layerkv``: ``mixed`` with SLO-aware admission of prefills (``arbor.engine.policies.slo_admission``; needs
  ``EngineConfig.layer_kv``).
"""

from __future__ import annotations

from collections import deque

from arbor.engine.block_manager import BlockManager
from arbor.engine.policies import Policy, policy_class
from arbor.engine.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str | Policy = "mixed", on_free=None):
        """``policy``: a policy object, or the name of one (``arbor.engine.policies.POLICIES``)."""
        self.bm, self.max_num_seqs, self.budget = block_manager, max_num_seqs, max_num_batched_tokens
        self.policy = policy_class(policy, "the scheduler policy")() if isinstance(policy, str) else policy
        self.on_free = on_free or (lambda seq: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        return self.policy.schedule(self)

    # ---- building blocks for policies ---------------------------------------------------
    def schedule_decodes(self, batch: ScheduledBatch, budget: int, exclude=(), preempt: bool = True) -> int:
        """Add one token for each running decode (oldest first), preempting when blocks run out.
        ``exclude``: sequences not to schedule (a prefill in flight); ``preempt=False``: a decode
        that needs a block when none is free waits instead (nothing in flight loses its blocks)."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens != 1 or seq in exclude or (not preempt and not self.bm.can_append(seq)):
                i += 1
                continue
            while not self.bm.can_append(seq):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.bm.append_slot(seq)
                batch.append((seq, 1))
                budget -= 1
                i += 1
        return budget

    def schedule_prefills(self, batch: ScheduledBatch, budget: int, admit=None) -> int:
        """Continue running prefills, then admit waiting sequences, chunking to the budget;
        ``admit(seq)`` False stops admissions (the SLO check of ``layerkv``). A waiting sequence whose
        next uncached prompt block a running one is computing (``BlockManager.waits_for_prefill``: the
        samples of one prompt, the same system prompt) keeps its place in the queue while later ones
        are admitted: once that block is committed it is a prefix-cache hit instead of computed again."""
        for seq in self.running:
            if budget == 0:
                return 0
            if seq.num_pending_tokens > 1:  # decodes (pending 1) are scheduled apart
                n = self.chunk(seq, budget)
                batch.append((seq, n))
                budget -= n
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.bm.waits_for_prefill(seq):      # its next prompt block is being computed: hit it later
                deferred.append(self.waiting.popleft())
                continue
            if not self.bm.can_allocate(seq) or (admit is not None and not admit(seq)):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self.chunk(seq, budget)
            batch.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return budget

    def chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill tokens of ``seq`` to run now: all pending ones within the budget, cut back to
        the last block boundary when block-boundary states are wanted and one lies inside."""
        n = min(seq.num_pending_tokens, budget)
        if self.bm.states is not None:
            start, bs = seq.num_computed_tokens, self.bm.block_size
            boundary = (start + n - (start + n == len(seq))) // bs * bs
            if boundary > start:
                n = boundary - start
        return n

    def has_prefill_work(self) -> bool:
        if any(s.num_pending_tokens > 1 for s in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.max_num_seqs and self.bm.can_allocate(self.waiting[0])

    # ---- lifecycle ----------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.deallocate(seq)
        self.on_free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.deallocate(seq)
            self.on_free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
