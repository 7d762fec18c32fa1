"""RoutePack in the RL trainer: re-place experts every ``plan.window`` steps from observed routing.

With ``plan.routepack=true`` on an expert-parallel run (``dist.ep_size`` > 1) the trainer counts,
over a window of ``plan.window`` optimizer steps, the routed copies d_l[e] of every MoE layer from
the trajectories' replayed expert ids (the engine's choices; tokens it did not route are not
counted), summed over all ranks. After the window's last optimizer step every rank computes the
same balanced placement (``window_placements`` → ``arbor.plan.routepack.place_demand``: labels
matched to the current one, experts kept in place while the max load stays within ``plan.tolerance``
of the balanced optimum, and, with a migration price — ``plan.move_s`` per moved expert and
``plan.move_layer_s`` per changed layer, by default the values ``arbor plan calibrate`` measured
into the cost file ``plan.cost_file`` — a layer moves only where the window's EP time, e × its max
load, gains more than its migration costs) and migrates experts with their weights and AdamW
moments (``arbor.models.expert_migration``) before the engine's weight sync; an engine that holds
its own copy of the weights is relabelled first, so ``update_weights`` lands every expert in its
new slot. Routing and the loss are unchanged.

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
from arbor.plan.placement import rank_loads
from arbor.plan.routepack import place_demand


@dataclass
class PlanConfig:
    routepack: bool = False      # re-place experts every `window` steps (expert-parallel runs only)
    window: int = 4              # optimizer steps per planning window
    tolerance: float = 0.0       # keep experts in place while the max EP load is within this (relative) of the optimum
    move_s: float | None = None  # modeled s per migrated expert; default: the cost file's (plan calibrate), else 0
    move_layer_s: float | None = None   # modeled seconds per MoE layer whose placement changes; default as move_s
    cost_file: str = ""          # cost model JSON (arbor plan calibrate); "" = ~/.cache/arbor/plan_cost.json if present

    def validate(self) -> None:
        from pathlib import Path

        from arbor.configs import check
        finite = lambda v: v is None or (v >= 0 and v != float("inf"))      # also false for NaN
        check(self, (self.window >= 1, "window", "must be ≥ 1"),
              (finite(self.tolerance), "tolerance", "must be a finite number ≥ 0 (e.g. 0.02: 2 % above the optimum)"),
              (finite(self.move_s), "move_s", "must be a finite number ≥ 0 (seconds per migrated expert)"),
              (finite(self.move_layer_s), "move_layer_s", "must be a finite number ≥ 0 (seconds per changed layer)"),
              (not self.cost_file or Path(self.cost_file).is_file(), "cost_file",
               "must name an existing cost model JSON (write one with `arbor plan calibrate --out FILE`)"))

    def migration_price(self, model_config=None) -> tuple[float, float, float]:
        """→ (move_s, move_layer_s, e): the migration price in seconds and the cost model's seconds per
        routed row, from these keys or the cost file (0 where neither gives a price). Warns when the
        cost file was measured on another model shape than ``model_config``'s."""
        import sys

        from arbor.plan.cost import CostModel
        cost = CostModel.load(self.cost_file or None)
        move_s = self.move_s if self.move_s is not None else (cost.move_s or 0.0)
        layer_s = self.move_layer_s if self.move_layer_s is not None else (cost.move_layer_s or 0.0)
        shape = cost.meta.get("shape") or {}
        keys = ("hidden_size", "num_experts", "moe_intermediate_size")
        if model_config is not None and (move_s or layer_s) and shape and any(
                shape.get(k) != getattr(model_config, k, None) for k in keys):
            print(f"warning: plan: the cost model {cost.meta.get('file')} was measured on "
                  f"{ {k: shape.get(k) for k in keys} }, not this model's "
                  f"{ {k: getattr(model_config, k, None) for k in keys} }; its migration price may be off "
                  "(run `arbor plan calibrate --model DIR --out FILE`, set plan.cost_file)", file=sys.stderr)
        return move_s, layer_s, cost.e


def window_placements(total: np.ndarray, current: dict[int, ExpertPlacement], tolerance: float = 0.0,
                      move_s: float = 0.0, move_layer_s: float = 0.0, e: float = 1.0):
    """A window's demand [Lm, E] (routed copies, all ranks) and the current placements → (new placements,
    max ÷ mean EP load per layer before, after). ``arbor.plan.routepack.place_demand``: balanced from
    ``current`` within ``tolerance``; with a migration price (seconds per moved expert and per changed
    layer, over ``e`` seconds per routed row) a layer moves only where the window's EP time gains more."""
    layers = sorted(current)
    rows = (lambda s: s / e) if e > 0 else (lambda s: 0.0)
    plans = place_demand(total[layers], current[layers[0]].ep_size, [current[m].rank_of for m in layers],
                         tolerance, rows(move_s), rows(move_layer_s))
    new, before, after = {}, [], []
    for m, plan in zip(layers, plans):
        p = current[m]
        new[m] = ExpertPlacement(plan.rank_of, plan.slot_of, p.ep_size)
        old_loads = rank_loads(total[m], p.rank_of, p.ep_size)
        before.append(float(old_loads.max() / max(old_loads.mean(), 1e-12)))
        after.append(plan.max_over_mean)
    return new, before, after


class RoutePackHook:
    def __init__(self, cfg: PlanConfig, model, optimizer, engine, ctx):
        self.cfg, self.model, self.optimizer, self.engine, self.ctx = cfg, model, optimizer, engine, ctx
        self.active = cfg.routepack and getattr(model, "ep_state", None) is not None
        self.demand = None
        self.move_s, self.move_layer_s, self.e = cfg.migration_price(model.config) if self.active else (0.0, 0.0, 1.0)

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
        new, before, after = window_placements(total, current, self.cfg.tolerance, self.move_s, self.move_layer_s,
                                               self.e)
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
