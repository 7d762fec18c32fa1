"""Rank programs for tests/test_routepack_migration.py: ``python tests/routepack_cases.py CASE OUT_DIR``.

Run only as child processes (``arbor.distributed.launch``), never inside pytest. Each case checks its own
equalities and exits non-zero on failure.
"""

import copy
import os
import sys
from pathlib import Path

import torch

from arbor.distributed import DistConfig, init_distributed
from arbor.models import CausalLM
from arbor.models.expert_migration import migrate_experts, placements_of
from arbor.models.checkpoint import gather_hf_tensors
from arbor.models.expert_parallel import ExpertPlacement, shard_experts
from arbor.train.optim import OptimConfig, make_optimizer, optimizer_step

sys.path.insert(0, str(Path(__file__).parent))
from dist_cases import hidden, sequences, tiny_config  # noqa: E402

NEW = {0: ExpertPlacement([1, 1, 0, 0], [0, 1, 0, 1], 2),        # every expert of layer 0 changes rank
       1: ExpertPlacement([0, 1, 1, 0], [0, 0, 1, 1], 2)}        # two move, one stays in place, one changes slot
CFG = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1e9)        # no clipping: the global norm's sum order
                                                                 # follows the placement (rounding only)


def step(model, opt, ctx, seqs, k):
    """One optimizer step on this rank's sequences → the hidden states of its forward."""
    h = hidden(model, seqs)
    h.square().mean().backward()
    optimizer_step(model, opt, k, 10, CFG, ctx)
    return h.detach()


def moments(model, opt, ctx) -> dict:
    """AdamW moments (and step) of every expert by logical id, gathered over ranks."""
    mine = {}
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            ids = model.get_submodule(name.rsplit(".", 1)[0]).expert_ids
            st = opt.state[p]
            for slot, e in enumerate(ids):
                mine[(name, e)] = (st["exp_avg"][slot].clone(), st["exp_avg_sq"][slot].clone(), float(st["step"]))
    out = {}
    for part in ctx.all_gather_object(mine, "gather moments"):
        out.update(part)
    return out


def same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = a[k], b[k]
        ok = all(torch.equal(u, v) if torch.is_tensor(u) else u == v for u, v in zip(x, y)) \
            if isinstance(x, tuple) else torch.equal(x, y)
        if not ok:
            sys.exit(f"{what} differ at {k}")


def case_migrate(ctx, out: Path):
    """Train 2 steps, migrate (weights + AdamW moments), then one more step: bit-identical to not migrating."""
    torch.manual_seed(0)
    ref = CausalLM(tiny_config(True))
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    shard_experts(a, ctx)
    shard_experts(b, ctx)
    opt_a, opt_b = make_optimizer(a, CFG), make_optimizer(b, CFG)
    data = [sequences(10 * k + ctx.rank, 3) for k in range(4)]
    for k in range(2):
        step(a, opt_a, ctx, data[k], k)
        step(b, opt_b, ctx, data[k], k)
    params_before = [id(p) for p in b.parameters()]
    info = migrate_experts(b, ctx, NEW, opt_b)
    assert info["moved"] == 6 and info["layers"] == [0, 1], info
    assert [id(p) for p in b.parameters()] == params_before                     # the optimizer's list stays valid
    assert {m: p.rank_of for m, p in placements_of(b).items()} == {m: p.rank_of for m, p in NEW.items()}
    want = {0: [2, 3], 1: [0, 1]}[ctx.rank]
    assert b.model.layers[0].mlp.experts.expert_ids == want, b.model.layers[0].mlp.experts.expert_ids
    same(gather_hf_tensors(a, ctx), gather_hf_tensors(b, ctx), "weights after migration")
    same(moments(a, opt_a, ctx), moments(b, opt_b, ctx), "AdamW moments after migration")
    ha, hb = step(a, opt_a, ctx, data[2], 2), step(b, opt_b, ctx, data[2], 2)
    if not torch.equal(ha, hb):
        sys.exit(f"outputs differ after migration by {float((ha - hb).abs().max()):.3g}")
    same(gather_hf_tensors(a, ctx), gather_hf_tensors(b, ctx), "weights after the next step")
    same(moments(a, opt_a, ctx), moments(b, opt_b, ctx), "AdamW moments after the next step")
    print("migration: outputs, weights and moments bit-identical", flush=True)

    # a checkpoint of the migrated model resumes into a freshly (contiguously) sharded one
    from arbor.train.checkpoint import load_state, save_state
    save_state(out / "ckpt", b, opt_b, {"settings": {}}, ctx=ctx)
    c = copy.deepcopy(ref)
    shard_experts(c, ctx)
    opt_c = make_optimizer(c, CFG)
    load_state(out / "ckpt", c, opt_c, {}, ctx)
    assert {m: p.rank_of for m, p in placements_of(c).items()} == {m: p.rank_of for m, p in NEW.items()}
    ha, hc = step(a, opt_a, ctx, data[3], 3), step(c, opt_c, ctx, data[3], 3)
    if not torch.equal(ha, hc):
        sys.exit(f"resumed outputs differ by {float((ha - hc).abs().max()):.3g}")
    same(gather_hf_tensors(a, ctx), gather_hf_tensors(c, ctx), "weights after resuming")
    same(moments(a, opt_a, ctx), moments(c, opt_c, ctx), "AdamW moments after resuming")
    print("resume after migration: bit-identical", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    case, out = sys.argv[1:3]
    ctx = init_distributed(DistConfig(timeout_s=float(os.environ.get("CASE_TIMEOUT", "20"))), 4)
    globals()[f"case_{case}"](ctx, Path(out))
    from arbor.distributed.context import leave
    leave(0)        # as dist_cases: no gloo teardown at interpreter exit (it aborted one rank now and then)
