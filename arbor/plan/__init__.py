"""RoutePack planning for MoE RL training (numpy only; no torch, no model code).

``routepack(samples, ep_size, dp_size, token_cap) -> Plan``: expert placement per MoE layer,
certified token-capped rows, and an annealed (DP rank, micro-batch) layout, all on the cost model
of ``arbor.plan.cost`` (fitted by ``arbor plan calibrate``). Baselines: ``token_balance``,
``kk_workload`` (Karmarkar–Karp on c·len + len², static contiguous experts).
"""

from arbor.plan.baselines import karmarkar_karp, kk_workload, token_balance
from arbor.plan.cost import CostModel, default_cost_file
from arbor.plan.layout import AnnealConfig
from arbor.plan.packing import Packing, pack_rows
from arbor.plan.placement import Placement, balanced, contiguous
from arbor.plan.routepack import Plan, Sample, evaluate, plan_window, routepack, step_lower_bound

__all__ = ["AnnealConfig", "CostModel", "Packing", "Placement", "Plan", "Sample", "balanced", "contiguous",
           "default_cost_file", "evaluate", "karmarkar_karp", "kk_workload", "pack_rows", "plan_window", "routepack",
           "step_lower_bound", "token_balance"]
