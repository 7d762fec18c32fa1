"""In-place prefill/decode multiplexing in the engine (AInfer-PD): policies ``pd-multiplex`` and
``pd-global-enqueue``.

P and D run concurrently on every rank: a prefill worker and a decode worker, two threads over the
same weights, KV pool and state cache, each with its own CPU thread budget (``EngineConfig.pd_threads``)
— ``pd_runtime.PDRuntime``. An engine step runs one prefill epoch (on one rank it may return before the
epoch ends, as soon as D has tokens; the next step waits on the same epoch):

1. the planner gives prefill the token budget the running decodes leave (decodes are D's);
2. P runs the epoch as one forward cut into segments of ``pd_segment_layers`` layers
   (``pd-global-enqueue``: one segment, no boundaries: the coarse baseline);
3. at the epoch start and at every boundary the turnstile (``turnstile.Turnstile``): all ranks agree
   whether a decode step is pending anywhere; if so (and no rank's D is still busy) every rank queues
   one D step (an empty one where it has no decodes) before P's next collectives, and D computes it
   while P computes its next segment. Without prefill anywhere a step is one D step. Without
   collectives to order (one rank, no EP) ``pd-multiplex``'s D steps back to back whenever it has
   decodes, while ``pd-global-enqueue`` still admits one D step per epoch.

P's and D's batches hold disjoint sequences (decodes exclude the epoch's own and preempt only when no
prefill is in flight, so nothing in flight loses its blocks); shared scheduler and block-manager state
is touched under ``LLMEngine.lock``. Their MoE exchanges are tagged and routed by phase (``ep_phase``:
"prefill" / "decode", private groups), all through the rank's in-order collective queue. A decode
sequence can get several tokens in one step; ``step`` returns each sequence that got any once.

Distributed (lockstep EP engine): per step one flag all-reduce (prefill anywhere?), then per boundary
the turnstile's; a rank without prefill runs the epoch's exchanges with zero rows
(``idle_segments``), so every rank issues every collective in one order.

The two policies refuse ``EngineConfig.layer_kv``: the tiered runner keeps one forward's copies in
flight (``TieredAttention``), and a concurrent decode step would be a second forward inside it.
"""

from __future__ import annotations

from arbor.engine.policies.base import Policy
from arbor.engine.policies.pd_runtime import PDRuntime, parse_pd_threads
from arbor.engine.sequence import Sequence


class PDMultiplex(Policy):
    """Prefill and decode workers running concurrently, prefill cut every ``EngineConfig.pd_segment_layers``
    layers, decode steps admitted at the boundaries (module docstring)."""
    name = "pd-multiplex"
    whole_epoch = False

    @classmethod
    def check(cls, config) -> None:
        if config.layer_kv:
            raise ValueError(f"EngineConfig.layer_kv does not combine with policy '{config.policy}' (a decode "
                             "step concurrent with a segmented prefill would be a second forward inside the tiered "
                             "runner's; "
                             "use a policy with one forward per step: mixed, prefill-first or layerkv)")

    def bind(self, engine) -> None:
        layers = len(engine.model.model.layers)
        per_segment = layers if self.whole_epoch else min(engine.config.pd_segment_layers, layers)
        ordered = engine.lockstep or self.whole_epoch
        self.runtime = PDRuntime(engine, parse_pd_threads(engine.config.pd_threads), per_segment, ordered)
        self.turnstile = self.runtime.turnstile

    def schedule(self, s):
        """The plan (for a caller of ``Scheduler.schedule``): decodes first, prefill in the leftover budget."""
        batch = []
        s.schedule_prefills(batch, s.schedule_decodes(batch, s.budget))
        return batch

    def step(self, engine) -> list[Sequence]:
        return self.runtime.step()

    def idle_step(self, engine) -> list[Sequence]:
        return self.runtime.step(admit=False)

    def stats(self) -> dict:
        t = self.turnstile
        return {"boundaries": t.boundaries, "decode_steps": t.decode_steps,
                "boundary_decode_steps": self.runtime.inside_decode_steps}

    def has_undelivered(self) -> bool:
        return self.runtime.has_undelivered()

    def drain(self) -> None:
        self.runtime.drain()

    def close(self) -> None:
        self.runtime.close()


class PDGlobalEnqueue(PDMultiplex):
    """``pd-multiplex`` without boundaries: the whole prefill epoch is one segment (the coarse baseline)."""
    name = "pd-global-enqueue"
    whole_epoch = True
