"""The cross-rank turnstile of in-place prefill/decode multiplexing (AInfer-PD).

Prefill (P) runs in segments cut at communication-safe boundaries (after a range of layers, i.e.
after the last collective of that range). At every boundary every rank calls ``boundary``:

1. rendezvous on the control group, agreeing whether a decode step is pending anywhere
   (MAX all-reduce of this rank's flag) and whether any rank's decode worker is still busy;
2. if pending anywhere and busy nowhere, every rank enqueues its decode step (D) — an empty one
   where it has no decodes — before P goes on;
3. (``confirm``) rendezvous again: the decode step's collectives are issued on every rank;
4. release the next prefill segment.

So every rank issues its conflicting P and D collectives in one global order, and phase-private
groups through an in-order device queue can no longer deadlock, however skewed the ranks are.
``run_decode`` is this rank's decode step (it must issue the decode collectives even with nothing
to decode). With concurrent workers (``pd_runtime``) ``run_decode`` only enqueues the step: it holds
the rank's collective queue for the decode worker (``DeviceQueue.reserve``), which orders D's
collectives before P's next ones locally, so step 3 is not needed there (``confirm=False``).
Without a rank context (one process) the agreement is this rank's own flags.
"""

from __future__ import annotations


class Turnstile:
    def __init__(self, ctx, run_decode=None, confirm: bool = True):
        self.ctx, self.run_decode, self.confirm = ctx, run_decode, confirm
        self.boundaries = self.decode_steps = 0

    def boundary(self, decode_pending: bool, run_decode=None, busy: bool = False) -> bool:
        """One boundary (steps 1–4), ``run_decode`` standing in for the one given at construction;
        ``busy``: this rank's decode worker still runs an earlier step (then no rank enqueues one).
        → whether a decode step was enqueued."""
        self.boundaries += 1
        pending, busy = decode_pending, busy
        if self.ctx is not None:
            pending, busy = map(bool, self.ctx.flags_max(float(decode_pending), float(busy),
                                                         name="turnstile: decode pending?"))
        if pending and not busy:
            (run_decode or self.run_decode)()
            self.decode_steps += 1
            if self.ctx is not None and self.confirm:
                self.ctx.barrier("turnstile: decode issued")
            return True
        return False
