"""Agents written with the ``openai`` client, trained through the trainer's endpoint (real HTTP on
127.0.0.1, served on the rollout's own event loop; every run is bounded by ``bounded``'s thread join and
``agent.timeout_s``, so a hung server or agent fails the test instead of hanging it)."""

import asyncio
import json
import threading

import httpx
import pytest
import torch

from arbor.bench.rl_setup import make_trainer
from arbor.data.config import DataConfig
from arbor.models import CausalLM, ModelConfig
from arbor.models.tokenizer import builtin_tokenizer
from arbor.rollout.agent_config import AgentConfig
from arbor.rollout.chat import ChatLayout
from arbor.train.config import C3POConfig, RLConfig, RLRolloutConfig
from arbor.train.losses import LossConfig
from arbor.train.optim import OptimConfig
from tests import agent_cases
from tests.float64_ref import engine_gap
from arbor.models import VarlenAttention
from tests.test_rl_loop import SMALL, tiny_moe

LIMIT_S = 120        # no test's run may take longer than this


@pytest.fixture(scope="module")
def tiny():
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id)).eval(), tok


def agent_config(tmp_path, fn: str, rows: list[dict], timeout_s: float = 30.0, **kw) -> RLConfig:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(data=DataConfig(train=str(path)), agent=AgentConfig(fn=f"tests.agent_cases:{fn}", timeout_s=timeout_s),
                seed=0, groups_per_step=2, checkpoint_every=0, out=str(tmp_path / "out"), c3po=C3POConfig(enabled=False),
                rollout=RLRolloutConfig(max_turn_tokens=8, max_context=400, branch=[2]),
                optim=OptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0))
    base.update(kw)
    cfg = RLConfig(**base)
    cfg.validate()
    return cfg


def bounded(coro):
    """``asyncio.run(coro)`` on a daemon thread, failing the test if it has not ended after ``LIMIT_S`` (a
    step that blocks its event loop cannot be cut short by ``asyncio.wait_for``)."""
    box = {}

    def work():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:      # noqa: BLE001 — re-raised on the test's thread
            box["error"] = e

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    assert not thread.is_alive(), f"the run had not ended after {LIMIT_S} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_tool_agent_is_recorded_token_for_token(tiny, tmp_path):
    model, tok = tiny
    agent_cases.SEEN.clear()
    rows = [{"prompt": f"add {i} and {i + 1}", "n": i} for i in range(4)]
    trainer = make_trainer(agent_config(tmp_path, "tool_agent", rows), model, tok)
    groups, left, stats = bounded(trainer.collect())
    assert not left and stats["agent_episodes"] == 4 and stats["agent_calls"] == 12 and stats["agent_dropped"] == 0
    assert len(agent_cases.SEEN) == 4
    by_episode = {}
    for ep, seen_ids, messages in agent_cases.SEEN:
        calls = ep.calls
        assert len(calls) == 3
        # the first prompt is the template's rendering of the agent's first message with its tools
        assert calls[0].prompt_ids == ChatLayout(tok, agent_cases.TOOLS).prompt_ids(messages[:1])
        for c, ids in zip(calls, seen_ids):          # what the engine sampled is what the client received
            assert c.token_ids == ids and len(c.logprobs) == len(ids) and c.versions == [0] * len(ids)
            assert c.params["temperature"] == 1.0 and c.requested["temperature"] == 0.3   # the trainer samples
        for a, b in zip(calls, calls[1:]):           # each call's prompt extends the previous prompt + completion
            assert b.prompt_ids[:len(a.prompt_ids) + len(a.token_ids)] == a.prompt_ids + a.token_ids
        by_episode[(ep.group, ep.sample)] = calls
    trajs = [t for g in groups for t in g.trajectories()]
    assert len(trajs) == 4                           # one multi-turn trajectory per episode
    for g in groups:
        for sample, t in enumerate(g.trajectories()):
            calls = by_episode[(g.group, sample)]
            assert t.tokens == calls[-1].prompt_ids + calls[-1].token_ids
            sampled = {i for c in calls for i in range(len(c.prompt_ids), len(c.prompt_ids) + len(c.token_ids))}
            assert {i for i, m in enumerate(t.loss_mask) if m} == sampled       # exactly the sampled tokens
            assert [x for x, m in zip(t.logp_infer, t.loss_mask) if m] == [x for c in calls for x in c.logprobs]
            assert t.reward == float(g.task["n"] % 3)     # what run returned for this row
    # step 0: the trainer's float32 log-probs (its tree forward) on the recorded ids equal the recorded ones:
    # the recorded ones are within 10× the trainer's own float32 noise of a float64 copy, and the trainer's
    # within that bound of the recorded (tests/float64_ref.py; measured over seeds 0-2: gap 4.4e-7 .. 4.8e-7,
    # noise 5.0e-7 .. 6.0e-7, trainer − recorded 4.8e-7: about 1× the noise)
    gap, bound = engine_gap(trainer.model, trajs, lambda m: trainer.logprobs(trajs, model=m)[0])
    assert gap <= bound, (gap, bound)
    with torch.no_grad():
        mine = trainer.logprobs(trajs)[0]
    mask = torch.tensor([m for t in trajs for m in t.loss_mask], dtype=torch.bool)
    recorded = torch.tensor([x for t in trajs for x in t.logp_infer])
    assert float((mine - recorded)[mask].abs().max()) <= bound
    row = bounded(trainer.train_step())              # a step: new episodes, one update
    assert row["samples"] == 4 and row["agent_dropped"] == 0 and torch.isfinite(torch.tensor(row["loss"]))


def test_bad_episodes_are_dropped_counted_and_logged(tiny, tmp_path):
    model, tok = tiny
    kinds = ["ok", "text", "raise", "hang", "silent", "nan", "set", "ok"]
    rows = [{"kind": k} for k in kinds]
    cfg = agent_config(tmp_path, "bad_agent", rows, groups_per_step=8, timeout_s=2.0,
                       rollout=RLRolloutConfig(max_turn_tokens=4, max_context=200, branch=[1]))
    trainer = make_trainer(cfg, model, tok)
    trainer.rows = rows                              # every kind once, in this order
    cfg.data.shuffle = False
    row = bounded(trainer.train_step())
    assert (row["agent_episodes"], row["agent_dropped"]) == (8, 5)
    assert (row["agent_bad_reward"], row["agent_raised"], row["agent_timeout"], row["agent_no_calls"]) == (2, 1, 1, 1)
    assert row["samples"] == 3 and row["agent_dropped_groups"] == 5
    logged = [json.loads(line) for line in (tmp_path / "out" / "agent_errors.jsonl").read_text().splitlines()]
    assert sorted((e["reason"], e["row"]["kind"]) for e in logged) == sorted(
        [("bad_reward", "text"), ("bad_reward", "nan"), ("raised", "raise"), ("timeout", "hang"),
         ("no_calls", "silent")])
    assert "the agent's own bug" in next(e["error"] for e in logged if e["reason"] == "raised")
    assert row["reward"] == pytest.approx((1.0 + 0.75 + 1.0) / 3)        # the episode reward set by the agent counts
    row = bounded(trainer.train_step())              # the run goes on
    assert row["step"] == 1 and row["agent_dropped"] == 5


def test_history_rewriting_agent_goes_down_the_tree_path(tiny, tmp_path):
    model, tok = tiny
    agent_cases.SEEN.clear()
    rows = [{"prompt": f"count to {i}"} for i in range(2)]
    trainer = make_trainer(agent_config(tmp_path, "rewriting_agent", rows, groups_per_step=1,
                                        rollout=RLRolloutConfig(max_turn_tokens=6, max_context=400, branch=[1])),
                           model, tok)
    groups, _, stats = bounded(trainer.collect())
    [group] = groups
    [(ep, _, _)] = agent_cases.SEEN
    c1, c2, c3, c4 = ep.calls
    assert c2.prompt_ids[:len(c1.prompt_ids) + len(c1.token_ids)] == c1.prompt_ids + c1.token_ids
    assert len(group.trees) == 2                     # the chat calls as one tree, the plain completion on its own
    chat, plain = group.trees
    trajs = chat.trajectories()
    assert [t.tokens for t in trajs] == [c2.prompt_ids + c2.token_ids, c3.prompt_ids + c3.token_ids]
    assert [t.reward for t in trajs] == [1.0, 0.5]   # the rewritten thread carries its per-call reward
    shared = next(i for i, (a, b) in enumerate(zip(*[t.tokens for t in trajs])) if a != b)
    assert 0 < shared < len(c1.prompt_ids)           # they share the system prompt and the start of the question
    total, compact = chat.num_tokens()
    assert compact == total - shared                 # the shared prefix is counted once
    assert plain.trajectories()[0].tokens == c4.prompt_ids + c4.token_ids
    assert c4.prompt_ids == tok.encode("zz" + ep.row["prompt"])
    row = bounded(trainer.train_step())
    assert row["samples"] == 3


async def _probe(trainer):
    """Requests an agent should not make, against a live endpoint → their status codes."""
    endpoint = trainer.collector.endpoint
    await endpoint.ensure()
    settings = trainer.collector._settings()
    ep, client = endpoint.open("probe", {}, 0, 0, settings)
    body = {"model": "arbor-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"authorization": f"Bearer {endpoint.key}"}
    async with httpx.AsyncClient(base_url=endpoint.base, timeout=30) as h:
        codes = {"ok": (await h.post("/episodes/probe/v1/chat/completions", json=body, headers=auth)).status_code,
                 "n": (await h.post("/episodes/probe/v1/chat/completions", json={**body, "n": 2},
                                    headers=auth)).status_code,
                 "key": (await h.post("/episodes/probe/v1/chat/completions", json=body)).status_code,
                 "other": (await h.post("/episodes/nope/v1/chat/completions", json=body, headers=auth)).status_code,
                 "bare": (await h.post("/v1/chat/completions", json=body, headers=auth)).status_code}
        endpoint.close(ep)
        codes["closed"] = (await h.post("/episodes/probe/v1/chat/completions", json=body, headers=auth)).status_code
    await endpoint.aclose()
    return codes, ep.calls


def test_endpoint_serves_only_running_episodes(tiny, tmp_path):
    model, tok = tiny
    trainer = make_trainer(agent_config(tmp_path, "tool_agent", [{"prompt": "x", "n": 0}]), model, tok)
    codes, calls = bounded(_probe(trainer))
    assert codes == {"ok": 200, "n": 400, "key": 401, "other": 404, "bare": 404, "closed": 404}
    assert len(calls) == 1 and calls[0].done         # only the good request reached the engine


def test_agent_run_with_c3po_overlap_checkpoints_and_resume(tiny, tmp_path):
    """C3PO++ budget, IcePop, overlapped rollout (a new event loop per step: the endpoint restarts on it)
    and a checkpoint resumed mid-run: versions recorded per token, staleness 1 under overlap."""
    model, tok = tiny
    rows = [{"prompt": f"add {i} and {i + 1}", "n": i} for i in range(6)]
    cfg = agent_config(tmp_path, "tool_agent", rows, steps=3, checkpoint_every=1, loss=LossConfig(correction="icepop"),
                       c3po=C3POConfig(enabled=True, token_budget=40, capacity=2, max_age=1),
                       rollout=RLRolloutConfig(max_turn_tokens=8, max_context=400, branch=[2], overlap=True))
    first = make_trainer(cfg, model, tok)
    history = bounded(first.run(stop_after=2))
    assert [r["step"] for r in history] == [0, 1]
    assert [r["staleness"] for r in history] == [0, 1] and all(r["agent_dropped"] == 0 for r in history)
    assert all(r["finished_tokens"] >= 40 for r in history)          # each iteration reached its token budget
    again = make_trainer(cfg, model, tok)
    history = bounded(again.run())
    assert [r["step"] for r in history] == [0, 1, 2] and again.collector.version == 3
    trees, _, _ = again.prefetched                  # rolled out at the version trained last, token by token
    assert {v for g in trees for t in g.trajectories() for v, m in zip(t.versions, t.loss_mask) if m} == {2}


def test_an_agent_that_always_fails_cannot_stall_a_c3po_iteration(tiny, tmp_path):
    model, tok = tiny
    cfg = agent_config(tmp_path, "bad_agent", [{"kind": "raise"}], timeout_s=5.0,
                       c3po=C3POConfig(enabled=True, token_budget=100, capacity=3))
    trainer = make_trainer(cfg, model, tok)
    row = bounded(trainer.train_step())             # the budget is never reached: the iteration ends anyway
    # it stops admitting once `capacity` (3) groups in a row were dropped; up to capacity − 1 groups admitted
    # before that still run (how many depends on when episodes end against the refills): 3 to 5 groups
    assert row["agent_stalled"] == 1 and 3 <= row["agent_dropped_groups"] <= 5
    assert row["agent_raised"] == 2 * row["agent_dropped_groups"]          # branch [2]: every episode raised
    assert "samples" not in row and row["step"] == 0


def test_moe_agent_calls_carry_the_engine_routing(tmp_path):
    """replay_routing: each recorded call keeps the engine's expert ids, placed on its sampled tokens."""
    tok, moe = tiny_moe()
    agent_cases.SEEN.clear()
    trainer = make_trainer(agent_config(tmp_path, "tool_agent", [{"prompt": "add 1 and 2", "n": 1}],
                                        groups_per_step=1), moe, tok)
    groups, _, _ = bounded(trainer.collect())
    trajs = [t for g in groups for t in g.trajectories()]
    assert len(trajs) == 2
    for t in trajs:
        r = t.routed_experts
        assert r.shape == (2, len(t.tokens), 2)
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        known = (r[0] >= 0).all(-1)
        assert not (known & ~mask).any() and known.sum() >= mask.sum() - 3     # a call's last token: never fed back
        own = trainer.model(torch.tensor(t.tokens), VarlenAttention.from_lengths([len(t.tokens)]),
                            return_routing=True).routed_experts
        assert torch.equal(own[:, known].sort(-1).values, r[:, known].sort(-1).values)
