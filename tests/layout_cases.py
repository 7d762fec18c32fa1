"""Rank programs for tests/test_step_layout.py: ``python tests/layout_cases.py CASE OUT_DIR [ARGS…]``.

Run only as child processes (``arbor.distributed.launch``), never inside pytest. Rank 0 writes what the
test compares to OUT_DIR.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run as a script: the repository root, for tests.*
from arbor.distributed import DistConfig, DistContext, init_distributed  # noqa: E402
from tests.fsdp_cases import rl_trainer, trajectories  # noqa: E402

MOE_LAYERS, EXPERTS, TOP_K = 2, 4, 2


def routed(trajs):
    """Skewed engine routing for the tiny MoE (experts 0 and 1, both on rank 0 under the contiguous
    placement, get 3 of every 4 tokens' first choice); −1 on the 4 prompt tokens, as the engine leaves them."""
    g = torch.Generator().manual_seed(7)
    for t in trajs:
        ids = torch.full((MOE_LAYERS, len(t.tokens), TOP_K), -1, dtype=torch.long)
        for pos in range(4, len(t.tokens)):
            for layer in range(MOE_LAYERS):
                first = int(torch.randint(0, 2, (1,), generator=g)) if torch.rand(1, generator=g) < 0.75 else \
                    int(torch.randint(2, 4, (1,), generator=g))
                second = (first + 1 + int(torch.randint(0, 3, (1,), generator=g))) % EXPERTS
                ids[layer, pos] = torch.tensor([first, second])
        t.routed_experts = ids
    return trajs


def samples(moe: bool):
    return routed(trajectories()) if moe else trajectories()


def tree_words(tree: str) -> list[str]:
    """Tree mode trains a group in one micro-batch: its cap must hold the largest group (59 tokens)."""
    return ["tree.enabled=true", "tree.token_cap=96"] if tree == "tree" else ["tree.enabled=false"]


def extra(layout: str, tree: str) -> list[str]:
    words = tree_words(tree)
    if layout == "routepack":
        return words + ["plan.routepack=true", "plan.move_s=0", "plan.move_layer_s=0"]
    return words + [f"plan.layout={layout}"]


def steps(trainer, mine) -> list[dict]:
    """Two RL steps' updates as ``RLTrainer._learn`` runs them: advantages, the layout, θ_old, the update."""
    from arbor.train.step_layout import lay_out
    rows = []
    for step in range(2):
        trainer.step = step
        layout = lay_out(trainer, mine, trainer.advantages(mine))
        old, ref, _ = trainer.recompute_old(layout.trajs, layout)
        row = trainer.train_on(layout.trajs, old, ref, layout=layout)
        row.update(layout.stats, trained=sum(len(t.tokens) for t in layout.trajs))
        rows.append(row)
    return rows


def reference(moe: bool, layout: str, tree: str):
    """One process, the local layout, every group (test side): → (HF tensors, rows)."""
    from arbor.models.checkpoint import to_hf_tensors
    trainer = rl_trainer(DistContext.single(), moe, tree_words(tree))
    return to_hf_tensors(trainer.model), steps(trainer, samples(moe))


def case_update(out: Path, kind: str, layout: str, tree: str):
    """Two float64 RL steps on 2 ranks under ``layout``; rank 0 rolled out groups 0-3 (the long ones: twice
    rank 1's tokens), rank 1 groups 4-5. Rank 0 saves the gathered weights, the rows, each rank's tokens."""
    from arbor.models.checkpoint import gather_hf_tensors
    from arbor.models.expert_migration import placements_of
    moe = kind == "moe"
    ctx = init_distributed(DistConfig(timeout_s=20, ep_size=0 if moe else 1), 4 * moe)
    trainer = rl_trainer(ctx, moe, extra(layout, tree))
    mine = [t for t in samples(moe) if (t.group < 4) == (ctx.rank == 0)]
    rows = steps(trainer, mine)
    tokens = ctx.all_gather_object([r["trained"] for r in rows])
    tensors = gather_hf_tensors(trainer.model, ctx)
    if ctx.is_main:
        torch.save({"tensors": tensors, "rows": rows, "tokens": tokens,
                    "rank_of": {m: p.rank_of for m, p in placements_of(trainer.model).items()}}, out / "update.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    case, out, *args = sys.argv[1:]
    globals()[f"case_{case}"](Path(out), *args)
    from arbor.distributed.context import leave
    leave(0)
