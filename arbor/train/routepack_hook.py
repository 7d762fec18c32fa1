"""RoutePack in the RL trainer, proactive: each step's own samples place the experts, pack the rows and
lay out the micro-batches before the step trains (``plan.routepack=true``, expert parallelism).

Routing replay makes every sample's length and expert demand known before its training step: the
engine's expert id per model token (``replay_routing``). Rank 0 plans from the step's samples of all
ranks (``arbor.train.step_layout``) and every rank applies the plan:

1. samples: per unit (a trajectory; in tree mode a group) its tokens n and demand d[l, e] = routed
   copies of its tokens per MoE layer l and expert e. Tokens the engine did not route (prompt and
   environment tokens route themselves in training) are counted at the sample's own rate:
   d = d_known · n_traj / n_known, and a group's tree scales the sum by compact / total tokens;
2. on the first step of every window of ``plan.window`` steps, ``arbor.plan.routepack.plan_window``
   with the step's parts (its ``mini_batches`` optimizer steps) as the window's steps: one placement per
   MoE layer from their demand, kept where it is unless the modeled gain on this step beats the migration
   price shared by the window's steps ((``plan.move_s`` per moved expert + ``plan.move_layer_s`` per changed
   layer) ÷ ``plan.window``; the prices are the cost file's, measured by ``arbor plan calibrate``): the
   step's demand stands for the window's, the placement serves all of them; then per part certified row
   packing and the annealed layout of the cells cells[rank][micro]; on the window's other steps the same
   under the standing placement;
3. experts whose rank changes migrate with their weights and AdamW moments
   (``arbor.models.expert_migration``) before the step's first pass; an engine holding its own copy is
   relabelled, so the next weight sync lands every expert in its new slot.

Routing and the loss are unchanged: only which rank computes what. A step whose samples cannot fill
the grid (fewer units than cells, a unit above ``tree.token_cap``) falls back to the LPT layout under
the standing placement (``routepack_fallback``). The placement is saved with the model state, so a
resumed run continues with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from arbor.models.expert_migration import migrate_experts, placements_of, set_placement


@dataclass
class PlanConfig:
    routepack: bool = False      # RoutePack (EP + replay_routing): each step's samples place experts and lay out micro-batches
    layout: str = "auto"         # DP layout of a step's samples without routepack: auto | local | lpt | kk (arbor.train.step_layout)
    window: int = 4              # RoutePack re-places experts on the first of every `window` steps (between: layout only)
    tolerance: float = 0.0       # keep experts in place while the max EP load is within this (relative) of the optimum
    move_s: float | None = None  # modeled s per migrated expert; default: the cost file's (plan calibrate), else 0
    move_layer_s: float | None = None   # modeled seconds per MoE layer whose placement changes; default as move_s
    cost_file: str = ""          # cost model JSON (arbor plan calibrate); "" = ~/.cache/arbor/plan_cost.json if present

    def validate(self) -> None:
        from pathlib import Path

        from arbor.configs import check
        from arbor.train.step_layout import LAYOUTS
        finite = lambda v: v is None or (v >= 0 and v != float("inf"))      # also false for NaN
        check(self, (self.window >= 1, "window", "must be ≥ 1"),
              (self.layout in LAYOUTS, "layout", f"must be one of {', '.join(LAYOUTS)}"),
              (not self.routepack or self.layout == "auto", "layout",
               "is RoutePack's own with plan.routepack=true: leave plan.layout at auto"),
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

        cost = self.cost_model()
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

    def cost_model(self):
        from arbor.plan.cost import CostModel
        return CostModel.load(self.cost_file or None)


def unit_demand(trajs, members: list[int], tokens: int, num_experts: int) -> np.ndarray:
    """[Lm, E] routed copies of a unit's ``tokens`` (module docstring, step 1)."""
    total, seen = None, 0
    for i in members:
        ids = trajs[i].routed_experts.numpy()                      # [Lm, T, k], −1 = not routed by the engine
        known = int((ids[0, :, 0] >= 0).sum())
        seen += len(trajs[i].tokens)
        if not known:
            continue
        counts = np.stack([np.bincount(l[l >= 0], minlength=num_experts) for l in ids.reshape(ids.shape[0], -1)])
        part = counts * (len(trajs[i].tokens) / known)
        total = part if total is None else total + part
    if total is None:
        return np.zeros((trajs[members[0]].routed_experts.shape[0], num_experts))
    return total * (tokens / max(1, seen))


class RoutePackHook:
    def __init__(self, cfg, model, optimizer, engine, ctx):
        """``cfg``: the run's ``RLConfig``."""
        self.cfg, self.model, self.optimizer, self.engine, self.ctx = cfg, model, optimizer, engine, ctx
        self.plan_cfg = cfg.plan
        self.cost = cfg.plan.cost_model()
        active = cfg.plan.routepack
        if active and (getattr(model, "ep_state", None) is None or not cfg.replay_routing):
            raise ValueError("plan.routepack=true needs an MoE model with its experts split over ranks "
                             "(`arbor launch -n N train …`, dist.ep_size > 1) and replay_routing=true: it plans "
                             "from the engine's expert ids; set plan.routepack=false (plan.layout balances "
                             "samples without it)")
        self.move_s, self.move_layer_s, _ = cfg.plan.migration_price(model.config) if active else (0.0, 0.0, 1.0)

    def plan(self, trajs, per_part, step: int):
        """Rank 0: → (unit cells per part, new placements or None, stats); (None, None, stats) to fall back."""
        from arbor.plan import plan_window, routepack
        from arbor.plan import placement as pl
        from arbor.plan.routepack import Sample, moved
        current = placements_of(self.model)
        layers, ep, E = sorted(current), self.ctx.ep_size, self.model.config.num_experts
        rank_of = [current[m].rank_of for m in layers]
        if any(t.routed_experts is None for t in trajs) or any(not us for us, _ in per_part):
            return self.fall_back(step, "a sample without replayed expert ids, or an optimizer step without samples")
        steps = [[Sample(n, unit_demand(trajs, u, n, E)) for u, n in zip(us, tok)] for us, tok in per_part]
        world, cap = self.ctx.world_size, self.cfg.tree.token_cap
        demand = sum(s.expert_counts for part in steps for s in part)             # [Lm, E] over the step
        try:
            if step % self.plan_cfg.window == 0:       # the placement serves the window: its steps share a move's price
                w = self.plan_cfg.window
                plans = plan_window(steps, ep, world, cap, self.cost, rank_of, tolerance=self.plan_cfg.tolerance,
                                    move_s=self.move_s / w, move_layer_s=self.move_layer_s / w)
            else:
                keep = [pl.from_ranks(r, ep, demand[l]) for l, r in enumerate(rank_of)]
                plans = [routepack(part, ep, world, cap, self.cost, placements=keep) for part in steps]
        except ValueError as e:
            return self.fall_back(step, str(e))
        new = plans[0].placements
        peak = lambda r: float(np.mean([pl.rank_loads(demand[l], r[l], ep).max() / max(demand[l].sum() / ep, 1e-12)
                                        for l in range(len(layers))]))
        stats = {"routepack_moved": float(moved(new, rank_of)), "routepack_fallback": 0.0,
                 "ep_peak_before": peak(rank_of), "ep_peak_after": peak([p.rank_of for p in new]),
                 "plan_energy_s": float(sum(p.energy for p in plans)),
                 "certified": float(all(p.packing is None or p.packing.certified for p in plans))}
        changed = any(p.rank_of != r for p, r in zip(new, rank_of))
        raw = {m: {"rank_of": list(p.rank_of), "slot_of": list(p.slot_of), "ep_size": ep}
               for m, p in zip(layers, new)} if changed else None
        return [p.cells for p in plans], raw, stats

    def fall_back(self, step: int, why: str):
        import sys
        print(f"plan: step {step}: RoutePack cannot plan this step ({why}); it trains under the LPT layout "
              "and the standing placement", file=sys.stderr, flush=True)
        return None, None, {"routepack_fallback": 1.0}

    def apply(self, placements) -> dict:
        """Every rank: migrate to ``placements`` (weights + AdamW moments; collective), relabel the engine."""
        t0 = time.perf_counter()
        info = migrate_experts(self.model, self.ctx, placements, self.optimizer)
        self.relabel_engine()
        return {"migrate_s": time.perf_counter() - t0, "migrate_bytes": float(info["bytes_sent"])}

    def relabel_engine(self) -> None:
        """An engine with its own weight copy takes the trainer's placement (its tensors follow by name)."""
        inner = getattr(self.engine, "engine", self.engine)
        em = getattr(inner, "model", None)
        if em is not None and em is not self.model and getattr(em, "ep_state", None) is not None:
            set_placement(em, placements_of(self.model))

