"""Rank programs for tests/test_dist.py: ``python tests/dist_cases.py CASE OUT_DIR [ARGS…]``.

Run only as child processes (``arbor.distributed.launch``), never inside pytest: a collective mismatch can
abort the process. Each case checks its own equalities and exits non-zero on failure, or writes what
the test compares to OUT_DIR.
"""

import copy
import os
import sys
from pathlib import Path

import torch

from arbor.distributed import DistConfig, init_distributed
from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.checkpoint import gather_hf_tensors
from arbor.models.expert_parallel import idle_forward, shard_experts

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


def tiny_config(moe: bool) -> ModelConfig:
    if moe:
        return ModelConfig(architecture="Qwen3MoeForCausalLM", **TINY, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, norm_topk_prob=True)
    return ModelConfig(**TINY)


def sequences(seed: int, n: int, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def hidden(model, seqs):
    ids = torch.tensor([t for s in seqs for t in s])
    return model(ids, VarlenAttention.from_lengths([len(s) for s in seqs])).hidden


def case_ep_grad(ctx, out: Path, dtype: str):
    """EP forward and gradients equal one process's; rank 1 also runs a forward with no tokens.
    float32 is held to 10× its own rounding error (|float32 − float64| of the one-process run, measured
    here: 1.4e-6 on an AVX-512 Xeon); float64 to 1e-10 (gradients up to 2.4e2: 4e-13 relative, ~2e3 float64 eps; measured 0)."""
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    ref = CausalLM(tiny_config(True)).to(dt)
    wide = copy.deepcopy(ref).double()          # the float64 reference that measures dt's rounding noise
    ep = copy.deepcopy(ref)
    shard_experts(ep, ctx)
    batches = {0: [sequences(1, 3), sequences(2, 2)], 1: [sequences(3, 2), []]}   # rank 1: no tokens in pass 2
    worst = noise = 0.0
    for k in range(2):
        mine = batches[ctx.rank][k]
        if mine:
            h = hidden(ep, mine)
            worst = max(worst, float((h - hidden(ref, mine)).detach().abs().max()))
            noise = max(noise, float((hidden(ref, mine) - hidden(wide, mine)).detach().abs().max()))
            (h.square().sum()).backward()
        else:
            idle_forward(ep).backward()
        everyone = [s for r in (0, 1) for s in batches[r][k]]
        hidden(ref, everyone).square().sum().backward()
        hidden(wide, everyone).square().sum().backward()
    for (name, p), (_, q), (_, w) in zip(ep.named_parameters(), ref.named_parameters(), wide.named_parameters()):
        want = q.grad
        if ".mlp.experts." in name:
            layer = ep.get_submodule(name.rsplit(".", 1)[0])
            want = q.grad[torch.tensor(layer.expert_ids)]
        else:                        # replicated weights hold this rank's part only: compared by the SFT test
            continue
        if p.grad is None and want is None:
            continue
        worst = max(worst, float((p.grad - want).abs().max()))
        noise = max(noise, float((q.grad - w.grad).abs().max()))
    tol = 1e-10 if dt == torch.float64 else 10 * noise
    print(f"max diff {worst:.3g} (bound {tol:.3g})")
    if worst > tol:
        sys.exit(f"EP differs from one process by {worst:.3g} > {tol:g}")


def case_sft(ctx_unused, out: Path, kind: str, dtype: str = "float32"):
    """Three SFT steps of a global batch split over the ranks, in ``dtype``; rank 0 saves the weights."""
    from arbor.train.optim import OptimConfig
    from arbor.train.sft import SFTConfig, sft
    from arbor.train.tree_batch import TreeConfig
    moe = kind.startswith("moe")           # moe-recompute: recompute=true under EP
    ctx = init_distributed(DistConfig(timeout_s=20), 4 if moe else 0)
    torch.manual_seed(0)
    model = CausalLM(tiny_config(moe)).to(getattr(torch, dtype))
    shard_experts(model, ctx)
    examples = [(s, [0] + [1] * (len(s) - 1)) for s in sequences(5, 40)]
    cfg = SFTConfig(steps=3, batch_tokens=200, log_every=1, checkpoint_every=0, tree=TreeConfig(enabled=False, token_cap=48),
                    moe_aux_coef=0.01 if moe else 0.0, optim=OptimConfig(lr=1e-2, warmup_steps=0),
                    recompute=kind == "moe-recompute")
    history = sft(model, examples, cfg, ctx=ctx)
    tensors = gather_hf_tensors(model, ctx)
    if ctx.is_main:
        torch.save({"tensors": tensors, "history": history}, out / "sft.pt")


def case_engine(ctx, out: Path):
    """Greedy tokens of the distributed engine equal the one-process engine's; uneven requests."""
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    torch.manual_seed(0)
    ref = CausalLM(tiny_config(True))
    ep = copy.deepcopy(ref)
    shard_experts(ep, ctx)
    prompts = sequences(7, 7, 3, 30)
    mine = prompts[:5] if ctx.rank == 0 else prompts[5:]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in LLMEngine(ep, EngineConfig(num_blocks=128), ctx=ctx).generate(mine, params)]
    want = [c.token_ids for c in LLMEngine(ref, EngineConfig(num_blocks=128)).generate(mine, params)]
    print(f"{len(mine)} requests, equal: {got == want}")
    if got != want:
        sys.exit(f"rank {ctx.rank}: distributed engine {got} != single-process {want}")


def case_crossed(ctx, out: Path):
    """Rank 1 issues layer 1's exchange while rank 0 issues layer 0's: both must raise the tag error."""
    from arbor.distributed import TagMismatchError
    from arbor.distributed.all_to_all import exchange_counts
    try:
        exchange_counts(ctx, torch.ones(2, 2, dtype=torch.int64), (0, ctx.rank, 1))
    except TagMismatchError as e:
        print(f"TagMismatchError: {e}")
        return
    sys.exit("no error for a crossed collective")


def _peer_fails(ctx, rank1_action) -> None:
    """Rank 1 runs ``rank1_action`` instead of the collective; rank 0 must get a CollectiveError."""
    from arbor.distributed import CollectiveError
    if ctx.rank == 1:
        rank1_action()
    try:
        ctx.all_reduce(torch.ones(4), name="test step all-reduce")
    except CollectiveError as e:
        print(f"CollectiveError: {e}", flush=True)
        os._exit(3)
    sys.exit("the collective succeeded without its peer")


def case_kill(ctx, out: Path):
    """Rank 1 dies while rank 0 waits inside a collective; rank 0 must fail fast, naming rank 1 and it."""
    import time
    _peer_fails(ctx, lambda: (time.sleep(1.0), os._exit(9)))


def case_stuck(ctx, out: Path):
    """Rank 1 never joins; rank 0's collective must time out (CASE_TIMEOUT s) with an error."""
    import time
    _peer_fails(ctx, lambda: time.sleep(60))


if __name__ == "__main__":
    torch.set_num_threads(1)
    case, out, *args = sys.argv[1:]
    ctx = init_distributed(DistConfig(timeout_s=float(os.environ.get("CASE_TIMEOUT", "20"))), 4) if case != "sft" else None
    globals()[f"case_{case}"](ctx, Path(out), *args)
    from arbor.distributed.context import leave
    leave(0)
