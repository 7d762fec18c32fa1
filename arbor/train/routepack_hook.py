"""RoutePack in the RL trainer: re-place experts every ``plan.window`` steps from observed routing.

With ``plan.routepack=true`` on an expert-parallel run (``dist.ep_size`` > 1) the trainer counts,
over a window of ``plan.window`` optimizer steps, the routed copies d_l[e] of every MoE layer from
the trajectories' replayed expert ids (the engine's choices; tokens it did not route are not
counted), summed over all ranks. After the window's last optimizer step every rank computes the
same balanced placement (``arbor.plan.placement.balanced``, labels matched to the current one) and
migrates experts with their weights and AdamW moments (``arbor.models.expert_migration``) before
the engine's weight sync; an engine that holds its own copy of the weights is relabelled first, so
``update_weights`` lands every expert in its new slot. Routing and the loss are unchanged.

Where the data come from: each rank trains its own trajectories in RL, so only the placement part
of RoutePack applies here (``arbor bench routepack`` measures the full plan). The window's counts
are part of the checkpoint, and the placement is saved with the model state (``save_state``), so a
resumed run continues with the same placement and window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from arbor.models.expert_migration import migrate_experts, placements_of, set_placement
from arbor.models.expert_parallel import ExpertPlacement
from arbor.plan.placement import balanced, rank_loads


@dataclass
class PlanConfig:
    routepack: bool = False      # re-place experts every `window` steps (expert-parallel runs only)
    window: int = 4              # optimizer steps per planning window

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.window >= 1, "window", "must be ≥ 1"))


class RoutePackHook:
    def __init__(self, cfg: PlanConfig, model, optimizer, engine, ctx):
        self.cfg, self.model, self.optimizer, self.engine, self.ctx = cfg, model, optimizer, engine, ctx
        self.active = cfg.routepack and getattr(model, "ep_state", None) is not None
        self.demand = None

    def observe(self, trajs) -> None:
        ids = [t.routed_experts for t in trajs if t.routed_experts is not None]
        if not ids:
            return
        flat = torch.cat([x.reshape(x.shape[0], -1) for x in ids], 1).cpu().numpy()     # [Lm, copies]
        E = self.model.config.num_experts
        counts = np.stack([np.bincount(row[row >= 0], minlength=E) for row in flat]).astype(np.float64)
        self.demand = counts if self.demand is None else self.demand + counts

    def after_step(self, trajs, step: int) -> dict:
        """Count this step's routing; at a window's end re-place and migrate (collective). → metrics."""
        if not self.active:
            return {}
        self.observe(trajs)
        if (step + 1) % self.cfg.window:
            return {}
        t0 = time.perf_counter()
        current = placements_of(self.model)
        Lm, E = len(current), self.model.config.num_experts
        mine = self.demand if self.demand is not None else np.zeros((Lm, E))
        total = np.asarray(self.ctx.sum_floats(mine.ravel().tolist(), "routepack demand")).reshape(Lm, E)
        new, before, after = {}, [], []
        for m, p in current.items():
            plan = balanced(total[m], p.ep_size, current=p.rank_of)
            new[m] = ExpertPlacement(plan.rank_of, plan.slot_of, p.ep_size)
            old_loads = rank_loads(total[m], p.rank_of, p.ep_size)
            before.append(float(old_loads.max() / max(old_loads.mean(), 1e-12)))
            after.append(plan.max_over_mean)
        info = migrate_experts(self.model, self.ctx, new, self.optimizer)
        self.relabel_engine()
        self.demand = None
        return {"routepack_moved": info["moved"], "routepack_s": time.perf_counter() - t0,
                "ep_peak_before": float(np.mean(before)), "ep_peak_after": float(np.mean(after))}

    def relabel_engine(self) -> None:
        """An engine with its own weight copy takes the trainer's placement (its tensors follow by name)."""
        inner = getattr(self.engine, "engine", self.engine)
        em = getattr(inner, "model", None)
        if em is not None and em is not self.model and getattr(em, "ep_state", None) is not None:
            set_placement(em, placements_of(self.model))

    def state_dict(self) -> dict:
        return {"demand": None if self.demand is None else self.demand.tolist()}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the window's counts; the placement itself comes back with the model (``load_state``)."""
        if state and state.get("demand") is not None:
            self.demand = np.asarray(state["demand"], dtype=np.float64)
        if self.active:
            self.relabel_engine()
