"""The RoutePack benches' cost model: a cost file, or calibrated on this machine as
``arbor plan calibrate --ep`` does (one process, then 2 EP ranks, then expert migration)."""

from __future__ import annotations

from pathlib import Path

from arbor.plan import CostModel


def bench_cost_model(shape: dict, cap: int, out_dir, cost_file=None, timeout_s: float = 1800.0,
                     need_migration: bool = True) -> tuple[CostModel, Path]:
    """→ (the cost model, the file it is in): ``cost_file`` when it exists, else calibrated now and saved as
    OUT/routepack_cost.json; a file without a migration measurement gets one when ``need_migration``."""
    if cost_file and Path(cost_file).exists():
        cost, path = CostModel.load(cost_file), Path(cost_file)
    else:
        import torch

        from arbor.distributed import DistContext
        from arbor.models.random_init import random_moe_model
        from arbor.train.plan_calibrate import calibrate
        from arbor.train.plan_calibrate_ep import calibrate_ep, calibrate_migration, with_ep_fit, with_migration
        print("calibrating the cost model on this machine (as `arbor plan calibrate --ep`: 2 EP ranks) ...", flush=True)
        cost = calibrate(random_moe_model(shape, DistContext.single(), torch.device("cpu")), repeats=3, threads=1)
        cost = with_ep_fit(cost, calibrate_ep(shape, repeats=3, timeout_s=timeout_s, max_tokens=cap))
        cost = with_migration(cost, calibrate_migration(shape, repeats=3, timeout_s=timeout_s))
        path = cost.save(Path(out_dir) / "routepack_cost.json")
    if need_migration and cost.move_s is None:
        from arbor.train.plan_calibrate_ep import calibrate_migration, with_migration
        print("the cost file has no migration measurement: measuring it on 2 ranks ...", flush=True)
        cost = with_migration(cost, calibrate_migration(shape, repeats=3, timeout_s=timeout_s))
        path = cost.save(Path(out_dir) / "routepack_cost.json")
    return cost, path
