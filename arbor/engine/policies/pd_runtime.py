"""The concurrent prefill/decode runtime of one rank (AInfer-PD): a prefill worker (P) and a decode
worker (D), two threads that share the engine's weights, paged KV pool and state cache and compute at
the same time, each with its own CPU thread budget (``EngineConfig.pd_threads`` = "P,D", the way P and D
split a GPU's SMs; ``arbor.kernels.threads`` says what a budget governs).

One ``step()`` (the caller's thread, e.g. the rollout loop's), unless an epoch is still in flight:

1. schedule the prefill epoch (running chunks, then admissions) in the budget the running decodes
   leave (``max_num_batched_tokens`` − decodes); its sequences are ``in_flight`` until it ends;
2. lockstep: all ranks agree whether any has prefill (one flag all-reduce on the control group);
3. with prefill: P runs the epoch, cut every ``layers_per_segment`` layers; at the epoch start and at
   every boundary the turnstile (``turnstile.Turnstile``) enqueues one D step on every rank when a
   decode is pending on any and no rank's D is still busy; without: the turnstile once, then wait
   for that D step;
4. wait: under lockstep for the epoch's end; otherwise for its end or for D's next tokens, so that
   a sequence D finishes is handed back (e.g. starts its tool call) while P still computes;
5. → the sequences that got tokens since the last step (each once).

A D step runs on the D thread, concurrently with P's next segment: this rank's decodes (every running
sequence with one pending token, not ``in_flight``; it preempts only when no prefill is in flight), or
under lockstep an empty step (zero rows through every MoE exchange) where it has none.

Invariants. P's and D's batches hold disjoint sequences (in-flight ones are never decoded, decodes are
never prefilled), so each writes only its own KV slots and state slots; the scheduler, block manager,
state cache, sampler and counters are touched only under ``engine.lock``. Only the caller and P threads
issue control-group collectives, never both at once (the caller waits for P's epoch). Under lockstep
every collective of the rank runs through one in-order queue (``DeviceQueue``, installed on
``ctx.queue`` when there is none), P's and D's expert exchanges on private groups
(``make_phase_groups``); a granted D step holds that queue (``DeviceQueue.reserve``) until it ends, so
on every rank D's collectives are queued between P's segments in the order the turnstile agreed.

``ordered=False``: D steps back to back whenever this rank has decodes, P never waits for a boundary's
agreement. Without collectives (one rank, no EP) nothing needs ordering, and ``pd-multiplex`` runs so;
under lockstep it is the naive design, kept because it deadlocks or crosses tags under skew (tests).
"""

from __future__ import annotations

import threading

import torch

from arbor.engine.policies.device_queue import DeviceQueue
from arbor.engine.policies.turnstile import Turnstile
from arbor.kernels.threads import set_thread_budget
from arbor.models.expert_parallel import idle_segments


def parse_pd_threads(text) -> tuple[int, int]:
    """"P,D" → (P, D), two integers ≥ 1; ValueError otherwise."""
    parts = str(text).split(",")
    try:
        p, d = (int(x) for x in parts)
    except ValueError:
        p = d = 0
    if len(parts) != 2 or p < 1 or d < 1:
        raise ValueError(f"EngineConfig.pd_threads must be 'P,D': the prefill and decode workers' CPU threads, "
                         f"two integers >= 1 (e.g. '1,1'), got {text!r}")
    return p, d


class PDRuntime:
    def __init__(self, engine, threads: tuple[int, int], layers_per_segment: int, ordered: bool = True):
        self.engine, self.lock, self.layers, self.ordered = engine, engine.lock, layers_per_segment, ordered
        self.ctx = engine.ctx if engine.lockstep else None
        self.saved_threads = torch.get_num_threads()
        p, d = threads
        self.decode = DeviceQueue("decode", init=lambda: self._init_worker(d, "decode"))
        self.decode.run(lambda: None)         # D's budget first, P's last: ATen's global count is P's
        self.prefill = DeviceQueue("prefill", init=lambda: self._init_worker(p, "prefill"))
        self.prefill.run(lambda: None)
        self.own_queue = self.queue = None
        if self.ctx is not None:
            from arbor.distributed.context import make_phase_groups
            make_phase_groups(self.ctx)
            if self.ctx.queue is None:
                self.own_queue = self.ctx.queue = DeviceQueue(f"rank{self.ctx.rank}-collectives")
            self.queue = self.ctx.queue
        self.turnstile = Turnstile(self.ctx if ordered else None, self._enqueue_decode, confirm=False)
        self.in_flight: frozenset = frozenset()
        self.decoded: list = []               # sequences that got tokens since the last step
        self.progress = threading.Condition(self.lock)
        self.epoch = None                     # the Future of the prefill epoch in flight
        self.pending = None                   # the Future of the last D step
        self.inside_decode_steps = 0          # D steps enqueued at a boundary inside a prefill epoch

    def _init_worker(self, threads: int, phase: str) -> None:
        set_thread_budget(threads)
        state = getattr(self.engine.model, "ep_state", None)
        if state is not None:
            state.phase = phase               # thread-local: this worker's exchanges are tagged and routed so

    # ---- the caller's step -------------------------------------------------------------
    def step(self, admit: bool = True) -> list:
        """Start an epoch unless one is in flight (``admit=False``: no prefill of this rank's own), then
        wait — under lockstep for the epoch's end, else for its end or for D's next tokens; → the
        sequences that got tokens since the last step, each once."""
        eng, batch = self.engine, []
        with self.lock:
            epoch = self.epoch
            if epoch is None and admit:
                s = eng.scheduler
                decodes = sum(seq.num_pending_tokens == 1 for seq in s.running)
                s.schedule_prefills(batch, max(1, s.budget - decodes))
                self.in_flight = frozenset(seq for seq, _ in batch)
        if epoch is None:
            any_prefill = bool(batch)
            if self.ctx is not None:
                any_prefill = bool(self.ctx.flags_max(float(any_prefill), name="pd: prefill anywhere?")[0])
            if any_prefill:
                with self.lock:               # before the epoch can end and clear it
                    epoch = self.epoch = self.prefill.submit(lambda: self._run_epoch(batch))
        if epoch is None:
            self._wait_decode()
            if self._boundary() or not self.ordered:
                self._wait_decode()
        else:
            with self.progress:
                self.progress.wait_for(lambda: self.epoch is not epoch or (self.ctx is None and self.decoded))
            if self.epoch is not epoch:
                epoch.result()                # re-raises P's error on the caller
        with self.lock:
            out, self.decoded = self.decoded, []
        return list(dict.fromkeys(out))

    def has_undelivered(self) -> bool:
        """Sequences got tokens since the last ``step`` (D decodes beside it, and may finish a sequence the
        scheduler then drops), or a prefill epoch is in flight: the next ``step`` returns them. Ranks in
        lockstep (``ctx``) step together and each step waits for its epoch: there the scheduler decides."""
        if self.ctx is not None:
            return False
        with self.lock:
            return bool(self.decoded) or self.epoch is not None

    def _run_epoch(self, batch) -> None:
        out = []
        try:
            out = self._epoch(batch)
        finally:
            with self.progress:
                self.decoded += out
                self.in_flight, self.epoch = frozenset(), None
                self.progress.notify_all()
        if not self.ordered:
            self._free_decode()

    def _epoch(self, batch) -> list:
        """P's thread: D first (a boundary before the first segment), then the segments."""
        eng = self.engine
        self._boundary()
        if batch:
            return eng.run_batch(batch, self.layers, self._segment_boundary, phase="prefill")
        if self.ctx is not None:              # this rank's part of the others' prefill exchanges
            with torch.inference_mode():
                for _, rows in idle_segments(eng.model, self.layers):
                    if rows is None:
                        self._segment_boundary()
            with self.lock:
                eng.num_steps += 1
        return []

    # ---- decode steps ------------------------------------------------------------------
    def _busy(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def _decode_pending(self) -> bool:
        with self.lock:
            running = self.engine.scheduler.running
            return any(seq.num_pending_tokens == 1 and seq not in self.in_flight for seq in running)

    def _boundary(self) -> bool:
        if not self.ordered:
            self._free_decode()
            return False
        return self.turnstile.boundary(self._decode_pending(), busy=self._busy())

    def _segment_boundary(self) -> None:
        self.inside_decode_steps += self._boundary()

    def _free_decode(self) -> None:
        """Unordered: D steps back to back whenever this rank has decodes, no agreement with the others."""
        with self.lock:
            if not self._busy() and self._decode_pending():
                self.pending = self.decode.submit(self._decode_step)

    def _enqueue_decode(self) -> None:
        """The turnstile's step 2: hold the collective queue for D, then queue D's step."""
        if self.queue is not None:
            self.queue.reserve(self.decode.thread)
        self.pending = self.decode.submit(self._decode_step)

    def _wait_decode(self, chain: bool = False) -> None:
        """Wait for the D step in progress (``chain``: and for the steps it queues after itself);
        re-raises a D step's error on the caller."""
        while (f := self.pending) is not None:
            f.result()
            if not chain or self.pending is f:
                return

    def _decode_step(self) -> None:
        eng = self.engine
        try:
            with self.lock:
                batch, s = [], eng.scheduler
                s.schedule_decodes(batch, s.budget, exclude=self.in_flight, preempt=not self.in_flight)
            if batch:
                out = eng.run_batch(batch, phase="decode")
                with self.progress:
                    self.decoded += out
                    self.progress.notify_all()
            elif self.ctx is not None:
                with torch.inference_mode():
                    for _ in idle_segments(eng.model, len(eng.model.model.layers)):
                        pass
                with self.lock:
                    eng.num_steps += 1
        finally:
            if self.queue is not None and self.queue.held:
                self.queue.release()
        if batch and not self.ordered:       # (an empty step waits for blocks: P's next boundary retries)
            with self.lock:
                if self._decode_pending():
                    self.pending = self.decode.submit(self._decode_step)

    def drain(self) -> None:
        """Wait until neither P's epoch nor a D step is in flight (re-raising their errors)."""
        epoch = self.epoch
        if epoch is not None:
            epoch.result()
        self._wait_decode(chain=True)

    def close(self) -> None:
        """Drain, stop both workers, uninstall the collective queue this runtime installed, and give
        the caller's process its thread count back."""
        try:
            self.drain()
        finally:
            self.decode.close()
            self.prefill.close()
            if self.own_queue is not None:
                self.ctx.queue = None
                self.own_queue.close()
            torch.set_num_threads(self.saved_threads)
