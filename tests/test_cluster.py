"""RL on a local Ray cluster (2 CPUs, no dashboard), shared by the module and shut down after it.

Skipped only when Ray cannot be imported (``pip install -e .[ray]``; ``make test`` installs it).
"""

import asyncio
import json
import os
import re
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from arbor.cluster import ray_env  # noqa: E402
from arbor.cluster.config import ClusterConfig, load_train_config, plain_rl_config  # noqa: E402
from arbor.cluster.remote_engine import ClusterError, RemoteEngine  # noqa: E402
from arbor.cluster.run import ClusterRun  # noqa: E402
from arbor.train.run import sampling_factory  # noqa: E402
from arbor.cluster.weights import digests  # noqa: E402
from arbor.models import CausalLM, ModelConfig, load_model, save_model  # noqa: E402
from arbor.models.tokenizer import builtin_tokenizer  # noqa: E402

SMALL = dict(architecture="Qwen3ForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(a local Ray cluster with its session files under a temp folder, that folder)."""
    folder = tmp_path_factory.mktemp("ray")
    assert ray_env.start(ClusterConfig(num_cpus=2, object_store_mb=256, temp_dir=str(folder / "ray")), folder)
    yield folder
    ray_env.stop(True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id)).eval()
    folder = tmp_path_factory.mktemp("model")
    save_model(model, folder, tokenizer=tok)
    return folder


def rl_words(model_dir, out, steps):
    return [f"model={model_dir}", f"out={out}", "task=longtail", f"steps={steps}", "groups_per_step=2",
            "checkpoint_every=1", "c3po.enabled=false", "rollout.max_turn_tokens=16", "rollout.max_context=120",
            "rollout.branch=[2]", "dist.timeout_s=20", "log.progress=false"]


def test_ray_files_stay_in_the_run_folder(cluster):
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert any(p.name.startswith("session_") for p in (cluster / "ray").iterdir())
    long = cluster / ("x" * 80)
    assert len(ray_env.short_temp_dir(long)) <= ray_env.MAX_TEMP_DIR_CHARS and long.is_dir()


def test_a_placement_the_cluster_cannot_hold_names_what_it_needs(cluster):
    from arbor.cluster import placement
    with pytest.raises(ValueError, match=r"could not place 2 bundles .*'CPU': 8.*the cluster has \{'CPU': 2"):
        placement.place(ClusterConfig(colocate=False, engines=2, cpus_per_engine=4, start_timeout_s=1))


@pytest.fixture(scope="module")
def ray_run(cluster, model_dir, tmp_path_factory):
    """A 2-rank, 2-replica run of 3 steps, disaggregated, whose rank 1 is killed after a step, then
    the same run colocated (it resumes: placement is not part of a checkpoint's settings).
    → (the second run, still up; its rows; the run folder; the first run's error and placement)."""
    out = tmp_path_factory.mktemp("ray_run")
    words = ["cluster=ray", "cluster.engines=2", "cluster.trainers=2", *rl_words(model_dir, out, 3)]
    apart = ["cluster.colocate=false", "cluster.cpus_per_trainer=0.5", "cluster.cpus_per_engine=0.5"]
    cfg = load_train_config(None, words)
    first = ClusterRun(load_train_config(None, words + apart)).start().launch()
    try:
        deadline = time.monotonic() + 60
        while (first._progress(None) or {}).get("steps", 0) < 1:
            assert time.monotonic() < deadline, "no step within 60 s"
            time.sleep(0.1)
        os.kill(first.info["trainers"][1]["pid"], signal.SIGKILL)
        with pytest.raises(ClusterError) as died:
            first.wait()
    finally:
        first.close()
    second = ClusterRun(cfg).start()
    try:
        rows = second.wait()
        yield second, rows, out, str(died.value), first.info["placement"]
    finally:
        second.close()


def test_a_dead_trainer_rank_stops_the_run_naming_it_and_the_same_command_resumes(ray_run):
    run, rows, out, error, _ = ray_run
    assert re.search(r"trainer rank 1 of 2 \(pid \d+, node .*\) died.* resumes from .*checkpoint", error), error
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2] and rows[-1]["step"] == 2


def test_two_replicas_two_ranks_give_the_single_process_metrics_and_one_hf_folder(ray_run, model_dir, tmp_path):
    from arbor.train.run import train as train_here
    run, rows, out, _, apart = ray_run
    assert len({t["pid"] for t in run.info["trainers"]}) == 2 and len({r["pid"] for r in run.info["replicas"]}) == 2
    together = run.info["placement"]             # colocated: replica j shares trainer rank j's bundle
    assert together["groups"] == 1 and [e["bundle"] for e in together["engines"]] == [0, 1]
    assert apart["groups"] == 2 and {e["group"] for e in apart["engines"]} == {1}     # disaggregated: their own
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["samples"] == 8 for r in logged)          # 2 ranks × 2 groups × 2 samples
    # float32 replicas sample what the trainer computes: a mean ≤ 2 × the float32 log-prob noise (max ≈ 5e-7
    # here, tests/float64_ref.py), so 1e-5 is 10×; measured 7.4e-8 to 8.7e-8
    assert all(r["mismatch_abs"] < 1e-5 for r in logged)
    one = train_here(plain_rl_config(load_train_config(None, rl_words(model_dir, tmp_path / "one", 1))))
    assert set(one[0]) == set(logged[-1])                  # the same metrics as the single-process loop
    models = [p.relative_to(out) for p in out.rglob("model.safetensors") if "checkpoint" not in p.parts]
    assert [str(p.parent) for p in models] == ["final/model"]
    assert load_model(out / "final" / "model").config.hidden_size == 64
    info = json.loads((out / "cluster.json").read_text())
    assert info["cluster"]["engines"] == 2 and len(info["trainers"]) == 2


@pytest.fixture
def replicas(ray_run):
    """The replica manager of the finished run (its replicas hold the final weights)."""
    return ray_run[0].manager


def test_a_replica_takes_many_requests_per_call_and_a_closed_stream_aborts_there(replicas):
    """16 samples and one closed after its first tokens: a few submit calls, polls bounded by the
    stream interval (not one call or stream per sample or token), every token once, the closed one aborted."""
    from arbor.engine import SamplingParams
    engine = RemoteEngine(replicas)
    handles = [h for _, h in engine.slots]
    calls = lambda: [ray.get(h.info.remote())["calls"] for h in handles]
    before = calls()

    async def sample(i, max_tokens, close_early=False):
        params = SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
        snaps = []
        stream = engine.generate([1 + i, 2, 3], params)
        async for out in stream:
            snaps.append(out)
            if close_early:
                await stream.aclose()
                break
        return snaps

    async def rollout():
        t0 = time.monotonic()
        snaps = await asyncio.gather(*[sample(i, 32) for i in range(16)], sample(99, 150, True))
        return snaps, time.monotonic() - t0, [ray.get(h.info.remote())["running"] for h in handles]

    snaps, seconds, running = asyncio.run(rollout())
    assert running == [0, 0]                                  # the closed request was aborted on its replica
    for s in snaps[:16]:
        assert s[-1].finish_reason == "length" and len(s[-1].token_ids) == len(s[-1].logprobs) == 32
        assert all(a.token_ids == b.token_ids[:len(a.token_ids)] for a, b in zip(s, s[1:]))   # cumulative
    assert len(snaps[16]) == 1 and snaps[16][0].finish_reason is None
    after = calls()
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    assert sum(d["requests"] for d in delta) == 17 and all(d["requests"] >= 8 for d in delta)    # balanced
    assert all(d["submit"] <= 4 for d in delta), delta        # batched (one more carries the abort)
    interval = ClusterConfig().stream_interval_ms / 1e3
    assert all(d["poll"] <= seconds / interval + 2 for d in delta), (delta, seconds)


def test_a_replica_killed_mid_rollout_is_replaced_and_no_trajectory_is_lost_or_doubled(ray_run, replicas):
    from arbor.rollout.collector import Collector, RolloutConfig
    from arbor.tasks.longtail import LongTailEnvironment, LongTailProblem
    from tests.float64_ref import engine_gap
    tok, model = builtin_tokenizer(), load_model(ray_run[2] / "final" / "model").eval()   # what the replicas serve
    engine = RemoteEngine(replicas)
    collector = Collector(engine, tok, RolloutConfig(max_turn_tokens=64, max_context=160, branch=[4]),
                          sampling_factory(tok, False))
    epoch, victim = engine.slots[0][0], ray.get(engine.slots[0][1].info.remote())["pid"]

    async def rollout():
        pool = []
        for g in range(4):
            p = LongTailProblem("ab"[g % 2], 64)
            pool += await collector.start(LongTailEnvironment(p), None, g, p, 0)

        async def kill_when_streaming():          # once the first tokens arrived: ~56 of each sample to go
            while not any(ep.partial is not None and ep.partial.tokens for ep in pool):
                await asyncio.sleep(0.002)
            os.kill(victim, signal.SIGKILL)

        killer = asyncio.ensure_future(kill_when_streaming())
        trees, left, _ = await collector.run_iteration(pool, 0)
        await killer
        return trees, left

    trees, left = asyncio.run(rollout())
    trajs = [t for tree in trees for t in tree.trajectories()]
    assert not left and engine.resubmitted > 0
    assert sorted(t.group for t in trajs) == sorted(list(range(4)) * 4)          # every group, 4 leaves each
    assert len({tuple(t.tokens) for t in trajs}) == 16                          # none twice
    assert all(t.num_model_tokens == 64 and len(t.logp_infer) == len(t.tokens) for t in trajs)
    gap, bound = engine_gap(model, trajs)     # stitched streams are exact: vs float64, 10× float32 noise (1×)
    assert gap <= bound, (gap, bound)
    deadline = time.monotonic() + 60
    while ray.get(replicas.stats.remote())["epochs"][0] == epoch and time.monotonic() < deadline:
        time.sleep(0.1)
    table = ray.get(replicas.table.remote())
    assert table[0][0] == epoch + 1 and ray.get(table[0][1].info.remote())["pid"] != victim
    assert ray.get(table[0][1].digests.remote()) == digests(model.state_dict())    # restarted on the current weights


@pytest.mark.parametrize("method", ["store", "broadcast"])
def test_weights_after_a_sync_equal_the_trainers_bit_for_bit_on_every_replica(replicas, model_dir, method):
    """Also after a replica died between two syncs (it is replaced; the broadcast group is rebuilt)."""
    model = load_model(model_dir)
    engine = RemoteEngine(replicas, weight_sync=method, timeout_s=30)     # joins at the manager's version
    for kill in (False, True):
        if kill:
            os.kill(ray.get(ray.get(replicas.table.remote())[1][1].info.remote())["pid"], signal.SIGKILL)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        engine.update_weights(model.state_dict())
        want = digests(model.state_dict())
        for _, handle in ray.get(replicas.table.remote()):
            assert ray.get(handle.digests.remote()) == want
        assert ray.get(replicas.stats.remote())["version"] == engine.version


def test_the_weight_buffer_round_trips_every_dtype_bit_for_bit_and_a_tied_weight_once():
    from arbor.cluster.weights import flatten, unflatten
    emb = torch.randn(7, 3)
    named = {"emb": emb, "head": emb, "b": torch.randn(5).bfloat16(), "h": torch.randn(3).half(),
             "i": torch.arange(3), "flag": torch.tensor([True, False, True]), "s": torch.tensor(2.5)}
    flat, layout = flatten(named)
    back = unflatten(flat, layout)
    assert digests(back) == digests(named) and all(back[k].dtype == v.dtype for k, v in named.items())
    assert flat.numel() < 2 * emb.numel() * 4 + 200          # the tied tensor is stored once
