"""Rank programs for tests/test_fsdp.py: ``python tests/fsdp_cases.py CASE OUT_DIR [ARGS…]``.

Run only as child processes (``arbor.distributed.launch``), never inside pytest: a collective mismatch can
abort the process. Rank 0 writes what the test compares to OUT_DIR.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run as a script: the repository root, for tests.*
from arbor.distributed import DistConfig, DistContext, init_distributed  # noqa: E402
from arbor.models import CausalLM  # noqa: E402
from arbor.models.expert_parallel import shard_experts  # noqa: E402
from tests.dist_cases import sequences, tiny_config  # noqa: E402


def sft_config(moe: bool, steps: int = 3, **kw):
    from arbor.train.optim import OptimConfig
    from arbor.train.sft import SFTConfig
    from arbor.train.tree_batch import TreeConfig
    # token_cap 48 over ~200 tokens: 5 micro-batches, so one rank runs an idle pass every step
    return SFTConfig(steps=steps, batch_tokens=200, log_every=1, tree=TreeConfig(enabled=False, token_cap=48),
                     moe_aux_coef=0.01 if moe else 0.0, optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.5),
                     **{"checkpoint_every": 0, **kw})


def examples():
    return [(s, [0] + [1] * (len(s) - 1)) for s in sequences(5, 40)]


def fresh(ctx, moe: bool):
    """The tiny float64 model every run starts from (seed 0), its experts split when ``ctx`` is EP."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(moe)).double()
    shard_experts(model, ctx)
    return model


def trained_optimizers():
    """Patch ``BatchTrainer`` so that each one made is kept: → the list they are appended to."""
    from arbor.train.loop import BatchTrainer
    trainers, original = [], BatchTrainer.__init__

    def keep(self, *a, **k):
        original(self, *a, **k)
        trainers.append(self)
    BatchTrainer.__init__ = keep
    return trainers


def reference(kind: str):
    """One process, no FSDP (test side): → (HF tensors, history, optimizer state bytes)."""
    from arbor.models.checkpoint import to_hf_tensors
    from arbor.train.fsdp import optimizer_state_bytes
    from arbor.train.loop import BatchTrainer
    from arbor.train.sft import sft
    moe, original = kind.startswith("moe"), BatchTrainer.__init__
    model, trainers = fresh(DistContext.single(), moe), trained_optimizers()
    try:
        history = sft(model, examples(), sft_config(moe))
    finally:
        BatchTrainer.__init__ = original
    return to_hf_tensors(model), history, optimizer_state_bytes(trainers[-1].optimizer)


def case_sft(out: Path, kind: str):
    """Three float64 SFT steps with ``dist.fsdp``; then the same run stopped after step 1 and resumed from its
    checkpoint. Rank 0 saves the full weights, the history, each rank's optimizer bytes and the resumed weights."""
    from arbor.train.fsdp import full_hf_tensors, optimizer_state_bytes
    from arbor.train.sft import sft
    moe = kind.startswith("moe")       # moe: experts over 2 EP ranks; moe-dp: experts replicated (sharded by FSDP)
    ctx = init_distributed(DistConfig(timeout_s=20, fsdp=True, ep_size=0 if kind == "moe" else 1), 4 * moe)
    model, trainers = fresh(ctx, moe), trained_optimizers()
    history = sft(model, examples(), sft_config(moe), ctx=ctx)
    state_bytes = ctx.all_gather_object(optimizer_state_bytes(trainers[-1].optimizer))
    tensors = full_hf_tensors(model, ctx)
    ckpt = out / "checkpoint"
    stopped = fresh(ctx, moe)
    sft(stopped, examples(), sft_config(moe, checkpoint_every=1), until=lambda step: step >= 0, checkpoint_dir=ckpt,
        ctx=ctx)                                               # stops (and checkpoints) after step 1
    resumed = fresh(ctx, moe)
    rows = sft(resumed, examples(), sft_config(moe, checkpoint_every=1), checkpoint_dir=ckpt, ctx=ctx)
    again = full_hf_tensors(resumed, ctx)
    if ctx.is_main:
        torch.save({"tensors": tensors, "history": history, "state_bytes": state_bytes, "resumed": again,
                    "resumed_history": rows}, out / "sft.pt")


def trajectories():
    """Six groups of two fixed samples (random tokens, a prompt of 4, loss on the rest, the engine's
    log-probs near the random model's −ln 96, rewards 0 and 1 in each group): ``arbor train``'s update, without the rollouts."""
    from arbor.rollout.tree import Trajectory
    g = torch.Generator().manual_seed(3)
    out = []
    for i, s in enumerate(sequences(2, 12, lo=8, hi=30)):
        mask = [0] * 4 + [1] * (len(s) - 4)
        out.append(Trajectory(tokens=s, loss_mask=mask, logp_infer=(-4.7 + 0.2 * torch.rand(len(s), generator=g)).tolist(),
                              versions=[0] * len(s), reward=float(i % 2), group=i // 2, prompt_len=4))
    return out


def rl_trainer(ctx, moe: bool, extra=()):
    """An ``RLTrainer`` on the float64 model (its engine a float32 copy), two optimizer steps per RL step
    (so θ_old is recomputed), a KL reference, micro-batches of ≤ 48 tokens, the clip active (0.2 < ‖g‖);
    ``extra``: more ``key=value`` overrides."""
    import types

    from arbor import configs
    from arbor.engine import EngineConfig
    from arbor.models.tokenizer import builtin_tokenizer
    from arbor.train.config import RLConfig
    from arbor.train.rl import RLTrainer
    from arbor.train.run import make_engine
    cfg = configs.load(RLConfig, None, ["steps=2", "ppo_epochs=2", "loss.kl_coef=0.05", "tree.enabled=false",
                                        "tree.token_cap=48", "optim.lr=1e-2", "optim.warmup_steps=0",
                                        "optim.grad_clip=0.2", f"dist.fsdp={str(ctx.fsdp).lower()}", *extra])
    model, tok = fresh(ctx, moe), builtin_tokenizer()
    engine, sampling = make_engine(model, tok, EngineConfig(dtype="float32", share_weights=False, num_blocks=16,
                                                            max_model_len=64), ctx)
    task = types.SimpleNamespace(train=[], eval=[], rewards=None, make_env=None)
    return RLTrainer(cfg, model, tok, engine, sampling, task, ctx)


def rl_steps(trainer, mine) -> list[dict]:
    rows = []
    for step in range(2):
        trainer.step = step
        old, ref, _ = trainer.recompute_old(mine)
        rows.append(trainer.train_on(mine, old, ref))
    trainer.sync_weights()
    return rows


def rl_reference(kind: str):
    """One process, no FSDP, every group (test side): → (HF tensors, rows)."""
    from arbor.models.checkpoint import to_hf_tensors
    trainer = rl_trainer(DistContext.single(), kind.startswith("moe"))
    rows = rl_steps(trainer, trajectories())
    return to_hf_tensors(trainer.model), rows


def case_rl(out: Path, kind: str):
    """Two float64 RL steps of ``arbor train``'s update with ``dist.fsdp`` on 2 ranks (rank r: groups r, r+2, …;
    rank 0 runs 3 micro-batches a pass, rank 1 2, so rank 1 runs idle passes, with and without grad), then a
    weight sync. Rank 0 saves the full weights, the rows and its engine's weights after the sync."""
    from arbor.train.fsdp import full_hf_tensors, full_tensors
    moe = kind.startswith("moe")
    ctx = init_distributed(DistConfig(timeout_s=20, fsdp=True, ep_size=0 if kind == "moe" else 1), 4 * moe)
    trainer = rl_trainer(ctx, moe)
    mine = [t for t in trajectories() if t.group % 2 == ctx.rank]
    rows = rl_steps(trainer, mine)
    tensors, whole = full_hf_tensors(trainer.model, ctx), dict(full_tensors(trainer.model))
    if ctx.is_main:
        served = {k: v.clone() for k, v in trainer.engine.engine.model.state_dict().items()}
        torch.save({"tensors": tensors, "rows": rows, "served": served, "whole": whole}, out / "rl.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    case, out, *args = sys.argv[1:]
    globals()[f"case_{case}"](Path(out), *args)
    from arbor.distributed.context import leave
    leave(0)
