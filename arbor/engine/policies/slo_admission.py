"""SLO-aware admission of prefills (LayerKV), policy ``layerkv``: the ``mixed`` schedule (decodes
first, prefill chunks in the leftover budget, one forward) where a waiting prefill is admitted only
if every running decode keeps its TPOT SLO.

For a running decode i (g_i tokens after its first, r_i = max_tokens − output tokens still to come,
e_i seconds since its first token, t_d the predicted decode-step time):

    slack_i = tpot_slo · (g_i + r_i) − e_i − r_i · t_d

(time it can still lose with its mean TPOT within the SLO). A waiting prefill whose prompt has n
tokens the prefix cache does not hold (the tokens its forwards will compute; T is fitted on those)
is admitted when ``α · T(n) ≤ min_i slack_i`` (T: the per-token prefill model fitted online, α: the
safety factor ``slo_safety``) and the bytes it puts through the copy engine (the n tokens' KV of
the layers that do not fit the device tier's free budget) are copyable within ``T(n)`` at the
measured copy bandwidth. Without running decodes, or before the model has two measured prefills, a
prefill is admitted. A request whose wait plus ``α · T(n)`` reaches ``ttft_slo`` is admitted
regardless: waiting longer would cost it its TTFT SLO (or it has missed it already, and waiting only
makes it later), so no request starves.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from arbor.engine.policies.base import Mixed


class PrefillTimeModel:
    """Step time of a forward as ``t = c0 + c1 · prefill_tokens + c2 · decodes``, a least-squares fit
    over the last ``window`` measured forwards (``observe``). ``prefill(n) = c0 + c1 · n`` is the
    predicted time of a prefill of n tokens, ``decode_step(d)`` that of a step of d decodes."""

    def __init__(self, window: int = 128):
        self.obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coef: np.ndarray | None = None

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        self.obs.append((prefill_tokens, decodes, seconds))
        self._coef = None

    @property
    def ready(self) -> bool:
        return sum(p > 0 for p, _, _ in self.obs) >= 2

    def coef(self) -> np.ndarray:
        if self._coef is None:
            x = np.array([[1.0, p, d] for p, d, _ in self.obs])
            y = np.array([t for _, _, t in self.obs])
            c = np.linalg.lstsq(x, y, rcond=None)[0] if len(self.obs) else np.zeros(3)
            self._coef = np.maximum(c, 0.0)
        return self._coef

    def prefill(self, n: int) -> float:
        c = self.coef()
        return float(c[0] + c[1] * n)

    def decode_step(self, decodes: int) -> float:
        c = self.coef()
        return float(c[0] + c[2] * decodes)


def slack(seq, tpot_slo: float, decode_step: float, now: float) -> float:
    """TPOT slack of a running decode (formula in the module docstring)."""
    generated = max(0, seq.num_output_tokens - 1)
    remaining = max(0, seq.max_tokens - seq.num_output_tokens)
    return tpot_slo * (generated + remaining) - (now - seq.first_token_time) - remaining * decode_step


class LayerKVPolicy(Mixed):
    """``mixed`` with the admission check above. Needs layer-wise KV (``EngineConfig.layer_kv``: the
    prefill-time model, the copy engine's bandwidth and the SLO knobs live on ``scheduler.bm.tiers``)
    and a TPOT SLO (the slack is measured against it)."""
    name = "layerkv"

    @classmethod
    def check(cls, config) -> None:
        if not config.layer_kv:
            raise ValueError("EngineConfig.policy 'layerkv' (SLO-aware admission) needs layer_kv=True")
        if config.tpot_slo is None:
            raise ValueError("EngineConfig.policy 'layerkv' needs tpot_slo (seconds per output token)")

    def schedule(self, s):
        batch = []
        budget = s.schedule_decodes(batch, s.budget)
        s.schedule_prefills(batch, budget, admit=lambda seq: self.admissible(s, seq))
        return batch

    def admissible(self, s, seq, now: float | None = None) -> bool:
        tiers = s.bm.tiers
        model, tpot_slo = tiers.timing, tiers.tpot_slo
        now = time.perf_counter() if now is None else now
        decodes = [r for r in s.running if r.num_pending_tokens == 1 and r.first_token_time is not None]
        if not decodes or not model.ready:
            return True
        step = model.decode_step(len(decodes))
        uncached = len(seq) - s.bm.cached_tokens(seq)
        predicted = model.prefill(uncached)
        if tiers.ttft_slo is not None and now - seq.arrival + tiers.slo_safety * predicted >= tiers.ttft_slo:
            return True     # its last chance to meet the TTFT SLO (or already past it)
        ok = tiers.slo_safety * predicted <= min(slack(r, tpot_slo, step, now) for r in decodes)
        bandwidth = tiers.copier.bandwidth()
        if ok and bandwidth:
            resident = tiers.device.resident_fit(s.bm.blocks_needed(len(seq)))
            ok = tiers.offload_bytes(uncached, resident) / bandwidth <= predicted
        tiers.num_deferrals += not ok
        return ok
