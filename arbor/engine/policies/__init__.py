"""Scheduling policies of the engine: each one object that owns which sequences run in a step
(``schedule``) and how the step runs (``step``), and that refuses the configurations it cannot run
(``check``); with their admission (``slo_admission``), P/D coordination (``turnstile``,
``device_queue``) and layer-wise KV (``layerkv``, ``layerkv_runner``).

``POLICIES``: the one registry, name → class, read by ``EngineConfig`` validation, the scheduler
and the ``arbor serve --policy`` choices.
"""

from arbor.engine.policies.base import Mixed, Policy, PrefillFirst
from arbor.engine.policies.pd_multiplex import PDGlobalEnqueue, PDMultiplex
from arbor.engine.policies.slo_admission import LayerKVPolicy

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (PrefillFirst, Mixed, PDMultiplex, PDGlobalEnqueue,
                                                          LayerKVPolicy)}


def policy_class(name: str, what: str = "EngineConfig.policy") -> type[Policy]:
    """The registered policy called ``name``; ValueError listing the names otherwise."""
    if name not in POLICIES:
        raise ValueError(f"{what} must be one of {sorted(POLICIES)}, got '{name}'")
    return POLICIES[name]


__all__ = ["POLICIES", "LayerKVPolicy", "Mixed", "PDGlobalEnqueue", "PDMultiplex", "Policy", "PrefillFirst",
           "policy_class"]
