"""In-place prefill/decode multiplexing in the engine (AInfer-PD): policies ``pd-multiplex`` and
``pd-global-enqueue``.

One engine step is one prefill epoch with decode steps at its boundaries:

1. D first — ``PDMultiplex.schedule_pd`` schedules every running decode, then gives
   the leftover token budget to prefill (running chunks, then admissions): the epoch;
2. P — the epoch as one forward cut into segments of ``pd_segment_layers`` layers
   (``pd-global-enqueue``: one segment, no boundaries: the coarse baseline);
3. at every boundary the turnstile (``turnstile.Turnstile``): all ranks agree whether a decode step
   is pending anywhere; if so every rank runs its decode step (an empty one where it has none),
   meets the others again, and the next segment is released.

The P and D executors share the weights, the KV pool and the state cache; their batches hold
disjoint sequences (decodes inside an epoch exclude the epoch's own and never preempt, so nothing in
flight loses its blocks). Their MoE exchanges are tagged — and with ``DistConfig.phase_groups``
routed — by phase (``ep_phase``: "prefill" / "decode"). On CPU one thread per rank runs both in the
turnstile's global order (an in-order device queue would run them one after the other anyway); on
CUDA, P and D streams are not built. A decode sequence can get several tokens in one step; ``step``
returns each sequence that got any once.

Distributed (lockstep EP engine): per step one flag all-reduce (prefill anywhere? decode anywhere?),
then per boundary the turnstile's; a rank without prefill runs the epoch's exchanges with zero rows
(``idle_segments``), so every rank issues every collective in one order.

The two policies refuse ``EngineConfig.layer_kv``: the tiered runner keeps one forward's copies in
flight (``TieredAttention``), and a decode step at a boundary would be a second forward inside it.
"""

from __future__ import annotations

import torch

from arbor.engine.policies.base import Policy
from arbor.engine.policies.turnstile import Turnstile
from arbor.engine.sequence import Sequence
from arbor.models.expert_parallel import ep_phase, idle_segments


class PDMultiplex(Policy):
    """Decode batch first (with preemption), prefill epoch in the leftover budget, run as separate
    forwards, the prefill cut every ``EngineConfig.pd_segment_layers`` layers (module docstring)."""
    name = "pd-multiplex"
    whole_epoch = False

    @classmethod
    def check(cls, config) -> None:
        if config.layer_kv:
            raise ValueError(f"EngineConfig.layer_kv does not combine with policy '{config.policy}' (a decode step "
                             "inside a segmented prefill would be a second forward inside the tiered runner's; "
                             "use a policy with one forward per step: mixed, prefill-first or layerkv)")

    def bind(self, engine) -> None:
        self.engine = engine
        layers = len(engine.model.model.layers)
        self.layers_per_segment = layers if self.whole_epoch else min(engine.config.pd_segment_layers, layers)
        self.turnstile = Turnstile(engine.ctx if engine.lockstep else None)

    def schedule_pd(self, s) -> tuple[list, list]:
        """→ (decodes, prefill epoch): every running decode, then prefill in the leftover budget."""
        decodes = []
        budget = s.schedule_decodes(decodes, s.budget)
        prefill = []
        s.schedule_prefills(prefill, budget)
        return decodes, prefill

    def schedule(self, s):
        decodes, prefill = self.schedule_pd(s)
        return decodes + prefill

    def step(self, engine, admit: bool = True) -> list[Sequence]:
        """One epoch (steps 1–3); ``admit=False`` schedules nothing of this rank's own and only joins
        the other ranks' collectives. → the sequences that got tokens (each once)."""
        decodes, prefill = self.schedule_pd(engine.scheduler) if admit else ([], [])
        any_decode, any_prefill = bool(decodes), bool(prefill)
        if engine.lockstep:
            any_decode, any_prefill = map(bool, engine.ctx.flags_max(any_decode, any_prefill, name="pd: work"))
        out: list[Sequence] = []
        if any_decode:
            out += self._decode(decodes)
        if any_prefill:
            out += self._prefill(prefill, admit)
        return list(dict.fromkeys(out))

    def idle_step(self, engine) -> list[Sequence]:
        return self.step(engine, admit=False)

    def stats(self) -> dict:
        t = self.turnstile
        return {"boundaries": t.boundaries, "boundary_decode_steps": t.decode_steps}

    def _decode(self, batch) -> list[Sequence]:
        with ep_phase(self.engine.model, "decode"):
            if batch:
                return self.engine.run_batch(batch, phase="decode")
            self._idle()
            return []

    def _prefill(self, batch, admit: bool) -> list[Sequence]:
        eng, out = self.engine, []
        in_flight = {seq for seq, _ in batch}

        def boundary():
            decodes = []
            if admit:
                eng.scheduler.schedule_decodes(decodes, eng.scheduler.budget, exclude=in_flight, preempt=False)
            self.turnstile.boundary(bool(decodes), lambda: out.extend(self._decode(decodes)))

        with ep_phase(eng.model, "prefill"):
            if batch:
                out += eng.run_batch(batch, self.layers_per_segment, boundary, phase="prefill")
            else:
                self._idle(self.layers_per_segment, boundary)
        return out

    @torch.inference_mode()
    def _idle(self, layers_per_segment: int | None = None, at_boundary=None) -> None:
        """This rank's part of the other ranks' forward (one segment by default): zero rows through
        each segment's exchanges, ``at_boundary()`` between segments."""
        eng = self.engine
        if not eng.lockstep:
            return
        for _, rows in idle_segments(eng.model, layers_per_segment or len(eng.model.model.layers)):
            if rows is None:
                at_boundary()
        eng.num_steps += 1


class PDGlobalEnqueue(PDMultiplex):
    """``pd-multiplex`` without boundaries: the whole prefill epoch is one segment (the coarse baseline)."""
    name = "pd-global-enqueue"
    whole_epoch = True
