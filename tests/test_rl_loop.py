"""The RL loop end to end on tiny random models: token exactness, C3PO++, learning, resume."""

import asyncio
import copy
import json

import pytest
import torch

from arbor.bench.rl_setup import make_trainer
from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.tokenizer import builtin_tokenizer
from arbor.rollout.collector import RolloutConfig
from arbor.train.optim import OptimConfig
from arbor.engine.config import EngineConfig
from arbor.train.config import C3POConfig, RLConfig
from tests.float64_ref import engine_gap

SMALL = dict(architecture="Qwen3ForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny():
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id)).eval(), tok


def config(tmp_path=None, **kw) -> RLConfig:
    base = dict(task="longtail", seed=0, groups_per_step=4, checkpoint_every=0, out=str(tmp_path or "runs/test"),
                rollout=RolloutConfig(max_turn_tokens=24, max_context=200, temperature=1.0, branch=[4]),
                optim=OptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0),
                c3po=C3POConfig(enabled=False))
    base.update(kw)
    return RLConfig(**base)


def test_trained_tokens_are_what_the_engine_saw(tiny):
    model, tok = tiny
    trainer = make_trainer(config(task="arithmetic", rollout=RolloutConfig(max_turn_tokens=12, max_context=300,
                                                                         branch=[2, 2])), model, tok)
    trees, left, _ = asyncio.run(trainer.collect())
    assert not left and len(trees) == 4
    trajs = [t for tree in trees for t in tree.trajectories()]
    assert len(trajs) >= 8
    # engine log-probs (float32, shared weights) equal the trainer's recompute on the same ids: against a
    # float64 copy, within 10× the trainer's own float32 noise (tests/float64_ref.py; measured ≤ 1×)
    gap, bound = engine_gap(trainer.model, trajs)
    assert gap <= bound, (gap, bound)
    for t in trajs:
        first = next(u for u in trajs if u.group == t.group)
        assert t.tokens[:t.prompt_len] == first.tokens[:t.prompt_len]   # one prompt per group


class ThreeTurns:
    """Answers every model turn with a fixed observation; ends after the third turn, reward = turn count."""

    def __init__(self):
        self.turns = 0

    async def reset(self, row):
        return [{"role": "user", "content": "go"}]

    async def step(self, message):
        self.turns += 1
        return (None, float(self.turns), True) if self.turns == 3 else (f"obs{self.turns}", 0.0, False)

    def score(self, message):
        return 0.0

    def fork(self):
        env = ThreeTurns()
        env.turns = self.turns
        return env


def test_tree_branches_at_chosen_turns(tiny):
    model, tok = tiny
    trainer = make_trainer(config(rollout=RolloutConfig(max_turn_tokens=6, max_context=300, branch=[2, 3],
                                                           end_on_truncation=False)), model, tok)
    col = trainer.collector

    async def go():
        pool = await col.start(ThreeTurns(), {}, 0, None, 0)
        return await col.run_iteration(pool, 0)

    (tree,), left, _ = asyncio.run(go())
    trajs = tree.trajectories()
    assert len(trajs) == 6 and not left
    total, compact = tree.num_tokens()
    assert compact < total
    for t in trajs:
        text = tok.decode(t.tokens)
        assert text.count("obs1") == 1 and text.count("obs2") == 1 and t.reward == 3.0
        model_text = tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if m])
        assert "obs" not in model_text
    # siblings differ (own seeds) and a trajectory's tokens are its path's segments, in order
    assert len({tuple(t.tokens) for t in trajs}) == 6



def test_rollouts_without_a_budget_ask_for_final_snapshots_only(tiny):
    """No token budget (C3PO++ off): every model turn is a ``final_only`` request (no snapshot per token),
    with the same trajectories as per-token streams (a budget never reached); with a budget, streams."""
    from arbor.engine import AsyncLLMEngine

    class Recording(AsyncLLMEngine):
        def add_request(self, prompt, params=None, request_id=None):
            self.kinds.append(params.final_only)
            return super().add_request(prompt, params, request_id)

    model, tok = tiny
    got = {}
    for budget in (None, 10 ** 9):
        trainer = make_trainer(config(rollout=RolloutConfig(max_turn_tokens=6, max_context=300, branch=[2, 2],
                                                               end_on_truncation=False)), model, tok)
        col = trainer.collector
        col.engine = Recording(trainer.engine.engine)
        col.engine.kinds = []

        async def go():
            pool = [e for g in range(2) for e in await col.start(ThreeTurns(), {}, g, None, 0)]
            return await col.run_iteration(pool, 0, budget)

        trees, left, _ = asyncio.run(go())
        assert not left and set(col.engine.kinds) == {budget is None} and len(col.engine.kinds) == 2 * (2 + 4 + 4)
        got[budget] = sorted((t.group, tuple(t.tokens), tuple(t.logp_infer)) for tree in trees for t in tree.trajectories())
    assert len(got[None]) == 8 and got[None] == got[10 ** 9]


class SlowTool(ThreeTurns):
    """ThreeTurns whose tool answers after a fixed latency (prefills of observations arrive while others decode)."""

    async def step(self, message):
        await asyncio.sleep(0.02)
        return await super().step(message)

    def fork(self):
        env = SlowTool()
        env.turns = self.turns
        return env


def test_pd_multiplex_rollouts_equal_prefill_first(tiny):
    """Greedy multi-turn rollouts with tool latency: the same trajectories under every engine policy."""
    model, tok = tiny
    got = {}
    for policy in ("prefill-first", "pd-multiplex", "pd-global-enqueue"):
        trainer = make_trainer(config(rollout=RolloutConfig(max_turn_tokens=8, max_context=300, branch=[2, 2],
                                                               temperature=0.0, end_on_truncation=False),
                                      engine=EngineConfig(policy=policy)), model, tok)
        col = trainer.collector

        async def go():
            pool = [e for g in range(3) for e in await col.start(SlowTool(), {}, g, None, 0)]
            return await col.run_iteration(pool, 0)

        trees, left, _ = asyncio.run(go())
        assert not left and trainer.engine.engine.config.policy == policy
        got[policy] = sorted((t.group, tuple(t.tokens), tuple(round(x, 4) for x in t.logp_infer))
                             for tree in trees for t in tree.trajectories())
    assert len(got["prefill-first"]) == 12
    assert got["pd-multiplex"] == got["prefill-first"] == got["pd-global-enqueue"]


def test_c3po_carries_partial_rollouts_across_versions(tiny):
    model, tok = tiny
    cfg = config(c3po=C3POConfig(enabled=True, token_budget=60, capacity=6, max_age=3))
    trainer = make_trainer(cfg, model, tok)
    rows = [asyncio.run(trainer.train_step()) for _ in range(4)]
    assert any(r["carried_episodes"] > 0 for r in rows)
    for r in rows:   # each step trains on every model token of the groups it finished: at least the budget Φ
        assert r["finished_groups"] >= 1 and r["samples"] == 4 * r["finished_groups"]      # branch [4]
        assert r["tokens"] == r["finished_tokens"] >= cfg.c3po.token_budget
    staleness = [r["staleness"] for r in rows]
    assert max(staleness) >= 1                                    # some trained token came from an older policy
    assert all(s <= min(step, cfg.c3po.max_age) for step, s in enumerate(staleness))   # ≤ steps so far, ≤ σ


def test_c3po_drops_groups_older_than_max_age(tiny):
    """C3PO++'s σ: at iteration 5 with max_age 2, the groups started at iterations 3 (age 2, the bound)
    and 4 run on; the one started at 2 (age 3) is dropped before any of its episodes runs again."""
    model, tok = tiny
    cfg = config(c3po=C3POConfig(enabled=True, token_budget=1, capacity=2, max_age=2),
                 rollout=RolloutConfig(max_turn_tokens=6, max_context=300, branch=[2], end_on_truncation=False))
    trainer = make_trainer(cfg, model, tok)
    col = trainer.collector

    async def go():
        trainer.pool = [e for group, born in ((0, 2), (1, 3), (2, 4))
                        for e in await col.start(ThreeTurns(), {}, group, None, born)]
        return await trainer.collect(iteration=5)

    trees, left, stats = asyncio.run(go())
    assert stats["dropped_groups"] == 1 and stats["finished_groups"] == len(trees) >= 1
    assert {t.group for t in trees} | {e.tree.group for e in left} == {1, 2}    # no refill: capacity 2 is full


def test_rl_raises_reward(tiny):
    model, tok = tiny
    trainer = make_trainer(config(optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0)), model, tok)
    rows = [asyncio.run(trainer.train_step()) for _ in range(12)]
    first, last = sum(r["reward"] for r in rows[:3]) / 3, sum(r["reward"] for r in rows[-3:]) / 3
    assert last > first + 0.1, (first, last)
    assert all(r["masked_frac"] == 0.0 for r in rows)   # float32 engine shares the trainer's weights


def test_resume_gives_the_same_metrics_and_weights(tiny, tmp_path):
    """Crash + resume = the uninterrupted run, bit for bit (built-in tasks: no wall-clock in the
    environment), and metrics.jsonl holds each step once."""
    model, tok = tiny
    keys = ("reward", "grad_norm", "samples", "finished_groups", "entropy", "approx_kl")

    def metrics(path):
        return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]

    a = make_trainer(config(tmp_path / "a", steps=4, checkpoint_every=2,
                            c3po=C3POConfig(enabled=True, token_budget=60, capacity=6)), model, tok)
    asyncio.run(a.run())
    b_cfg = config(tmp_path / "b", steps=4, checkpoint_every=2, c3po=C3POConfig(enabled=True, token_budget=60, capacity=6))
    asyncio.run(make_trainer(b_cfg, model, tok).run(stop_after=3))   # "crashes" after step 3 (checkpoint at 2)
    (tmp_path / "b" / "checkpoint").rename(tmp_path / "b" / "checkpoint.tmp")   # … inside save_state's moves
    b = make_trainer(b_cfg, model, tok)
    asyncio.run(b.run())                                            # a new process resumes from step 2
    ra, rb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in rb] == [0, 1, 2, 3]                  # the step redone after the crash: once
    for x, y in zip(ra, rb):
        for k in keys:
            assert x[k] == y[k], (k, x["step"])
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
    other = config(tmp_path / "b", steps=4, checkpoint_every=2, c3po=C3POConfig(enabled=True, token_budget=90, capacity=6))
    with pytest.raises(ValueError, match="c3po"):                   # other settings: refused, not mixed in
        asyncio.run(make_trainer(other, model, tok).run())


def tiny_moe():
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    moe = CausalLM(ModelConfig(**SMALL | dict(architecture="Qwen3MoeForCausalLM", num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=32),
                               eos_token_id=tok.eos_token_id)).eval()
    return tok, moe


def test_moe_trajectories_carry_and_replay_the_engine_routing(tmp_path):
    tok, moe = tiny_moe()
    cfg = config(tmp_path, c3po=C3POConfig(enabled=True, token_budget=40, capacity=6, max_age=3))
    trainer = make_trainer(cfg, moe, tok)
    trajs, carried = [], 0
    for _ in range(3):   # C3PO++ interrupts turns: their routing is stitched across requests
        trees, trainer.pool, stats = asyncio.run(trainer.collect())
        trajs += [t for tree in trees for t in tree.trajectories()]
        carried += stats["carried_episodes"]
    assert trajs and carried > 0
    for t in trajs:
        r = t.routed_experts
        assert r.shape == (2, len(t.tokens), 2)
        assert (r[:, :t.prompt_len] == -1).all()                      # the prompt routes itself
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        known = (r[0] >= 0).all(-1)
        assert not (known & ~mask).any() and known.sum() >= mask.sum() - 4
        # float32 engine, shared weights: the engine's ids are the trainer's own routing
        own = trainer.model(torch.tensor(t.tokens), VarlenAttention.from_lengths([len(t.tokens)]),
                            return_routing=True).routed_experts
        assert torch.equal(own[:, known].sort(-1).values, r[:, known].sort(-1).values)
    sub = trajs[:4]
    with torch.no_grad():
        replayed, _ = trainer.logprobs(sub)
        shuffled = [copy.copy(t) for t in sub]
        for t in shuffled:
            t.routed_experts = torch.where(t.routed_experts >= 0, (t.routed_experts + 1) % 4, -1)
        assert not torch.allclose(trainer.logprobs(shuffled)[0], replayed)   # the replay is used
    row = asyncio.run(trainer.train_step())
    # a float32 mean ≤ 2 × the log-prob noise (max ≈ 5e-7, tests/float64_ref.py): 1e-5 is 10×; measured 9.2e-8
    assert row["masked_frac"] == 0.0 and row["mismatch_abs"] < 1e-5


def test_moe_aux_coef_adds_the_load_balancing_loss(tmp_path):
    from arbor.train.tree_forward import tree_packed_logprobs
    tok, moe = tiny_moe()
    trainer = make_trainer(config(tmp_path), moe, tok)
    moe = trainer.model
    trees, _, _ = asyncio.run(trainer.collect())
    trajs = [t for tree in trees for t in tree.trajectories()]
    logp_old, _, _ = trainer.recompute_old(trajs)
    start = copy.deepcopy(moe.state_dict())
    gates = {}
    for coef in (0.0, 1.0):
        moe.load_state_dict(start)
        trainer.optimizer.state.clear()
        trainer.cfg.moe_aux_coef = coef
        if coef:
            with torch.no_grad():
                micros = [[trajs[i] for i in m] for m in trainer.micro_batches(trajs)]
                want = [(tree_packed_logprobs(moe, [t.tokens for t in g], routed_experts=torch.cat(
                    [t.routed_experts for t in g], 1), with_aux=True)[2], len(g)) for g in micros]
        stats = trainer.train_on(trajs, logp_old)
        assert ("moe_aux" in stats) == bool(coef)
        gates[coef] = moe.model.layers[0].mlp.gate.weight.detach().clone()
    # the stat is the sample-weighted mean of the micro-batches' losses
    # both sides sum the same float32 per-micro-batch values on the same CPU, in another order: a few roundings
    # (2^-24 each) of a value ≈ 1 on any ISA; measured equal; rel 1e-6 ≈ 16 roundings
    assert stats["moe_aux"] == pytest.approx(sum(float(a) * n for a, n in want) / len(trajs), rel=1e-6)
    assert not torch.allclose(gates[0.0], gates[1.0])
