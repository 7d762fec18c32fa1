"""The cross-rank turnstile of in-place prefill/decode multiplexing (AInfer-PD).

Prefill (P) runs in segments cut at communication-safe boundaries (after a range of layers, i.e.
after the last collective of that range). At every boundary every rank calls ``boundary``:

1. rendezvous on the control group, agreeing whether a decode step is pending anywhere
   (MAX all-reduce of this rank's flag);
2. if so, every rank runs its decode step (D) — an empty one where it has no decodes — before P goes on;
3. rendezvous again (the decode step's collectives are all issued on every rank);
4. release the next prefill segment.

So every rank issues its conflicting P and D collectives in one global order, and phase-private
groups through an in-order device queue can no longer deadlock, however skewed the ranks are.
``run_decode`` is this rank's decode step (it must issue the decode collectives even with nothing
to decode). Without a rank context (one process) the agreement is this rank's own flag.
"""

from __future__ import annotations


class Turnstile:
    def __init__(self, ctx, run_decode=None):
        self.ctx, self.run_decode = ctx, run_decode
        self.boundaries = self.decode_steps = 0

    def boundary(self, decode_pending: bool, run_decode=None) -> bool:
        """One boundary (steps 1–4), ``run_decode`` standing in for the one given at construction;
        → whether a decode step ran."""
        self.boundaries += 1
        pending = decode_pending
        if self.ctx is not None:
            pending = bool(self.ctx.flags_max(float(decode_pending), name="turnstile: decode pending?")[0])
        if pending:
            (run_decode or self.run_decode)()
            self.decode_steps += 1
            if self.ctx is not None:
                self.ctx.barrier("turnstile: decode issued")
        return pending
