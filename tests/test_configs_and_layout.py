"""Config loading, token layout of chats, rollout-tree trajectories, packing."""

import pytest

from arbor import configs
from arbor.models.tokenizer import builtin_tokenizer
from arbor.rollout.chat import env_turn_ids, model_turn_ids, prompt_ids, transcript_ids
from arbor.rollout.tree import Node, RolloutTree, Segment
from arbor.tasks import arithmetic as ar
from arbor.plan.packing import first_fit_decreasing
from arbor.train.config import RLConfig


def test_toml_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 7\ntask = "arithmetic"\n[loss]\ncorrection = "tis"\n[rollout]\nbranch = [2, 2]\n')
    cfg = configs.load(RLConfig, f, ["loss.icepop_beta=4", "tree.enabled=false", "optim.lr=1e-5"])
    assert (cfg.steps, cfg.loss.correction, cfg.rollout.branch) == (7, "tis", [2, 2])
    assert cfg.loss.icepop_beta == 4.0 and isinstance(cfg.loss.icepop_beta, float)
    assert cfg.tree.enabled is False and cfg.optim.lr == 1e-5
    with pytest.raises(KeyError, match="unknown key 'loss.nope'"):
        configs.load(RLConfig, None, ["loss.nope=1"])
    with pytest.raises(ValueError, match="key=value"):
        configs.load(RLConfig, None, ["steps"])


@pytest.mark.parametrize("old,new", [("engine_dtype=bfloat16", "engine.dtype"), ("rollout.policy=pd-multiplex", "engine.policy"),
                                     ("engine_noise_frac=0.5", "engine.logit_noise_frac")])
def test_renamed_keys_name_their_new_key(tmp_path, old, new):
    from arbor.cluster.config import ClusterRLConfig
    from arbor.train.demo import DemoConfig
    with pytest.raises(KeyError, match=f"'{old.split('=')[0]}' was renamed to '{new}'"):
        configs.load(ClusterRLConfig, None, [old])
    with pytest.raises(KeyError, match=f"'rl.{old.split('=')[0]}' was renamed to 'rl.{new}'"):
        configs.load(DemoConfig, None, [f"rl.{old}"])
    key, value = old.split("=")
    section, _, name = key.rpartition(".")
    f = tmp_path / "c.toml"                 # the same key in a TOML section
    f.write_text((f"[{section}]\n" if section else "") + f'{name} = "{value}"\n')
    with pytest.raises(KeyError, match=f"was renamed to '{new}'"):
        configs.load(RLConfig, f)


def test_engine_section_is_the_engine_config():
    from arbor.train.config import engine_config
    cfg = configs.load(RLConfig, None, ["engine.dtype=bfloat16", "engine.policy=pd-multiplex", "device=cpu",
                                        "rollout.max_context=300", "engine.logit_noise=0.5"])
    engine = engine_config(cfg)
    assert (engine.dtype, engine.policy, engine.logit_noise, engine.max_model_len, engine.device) == \
        ("bfloat16", "pd-multiplex", 0.5, 364, "cpu")
    with pytest.raises(ValueError, match="engine.logit_noise_dist must be one of"):
        configs.load(RLConfig, None, ["engine.logit_noise_dist=laplace"])
    with pytest.raises(ValueError, match="engine.max_model_len is set from rollout.max_context"):
        configs.load(RLConfig, None, ["engine.max_model_len=100"])


def test_transcript_layout_matches_rollout_pieces():
    tok = builtin_tokenizer()
    p = ar.generate_problems(1, seed=0)[0]
    msgs = ar.demonstration(p)
    ids, mask = transcript_ids(tok, msgs)
    # the same ids the collector builds turn by turn: prompt, then model / env pieces
    built = prompt_ids(tok, msgs[:2])
    for m in msgs[2:]:
        built += model_turn_ids(tok, m["content"]) if m["role"] == "assistant" else env_turn_ids(tok, m["content"])
    assert ids == built
    # trained tokens decode to exactly the assistant turns, each closed by <|im_end|>
    trained = tok.decode([t for t, k in zip(ids, mask) if k])
    assert trained == "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
    # whole-string rendering agrees with the piecewise ids for the built-in tokenizer
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(msgs, tokenize=False)


def test_tree_trajectories():
    root = Node(Segment([1, 2, 3], False))
    a = Node(Segment([4, 5], True, [-0.1, -0.2], [0, 0]))
    env = Node(Segment([6], False))
    a1 = Node(Segment([7], True, [-0.3], [1]), reward=1.0)
    a2 = Node(Segment([8, 9], True, [-0.4, -0.5], [1, 1]), reward=0.0)
    b = Node(Segment([10], True, [-0.6], [0]), reward=0.5)
    root.children = [a, b]
    a.children = [env]
    env.children = [a1, a2]
    tree = RolloutTree(root, group=3)
    trajs = tree.trajectories()
    assert [t.tokens for t in trajs] == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8, 9], [1, 2, 3, 10]]
    assert trajs[1].loss_mask == [0, 0, 0, 1, 1, 0, 1, 1]
    assert trajs[1].logp_infer == [0, 0, 0, -0.1, -0.2, 0, -0.4, -0.5]
    assert trajs[1].versions == [-1, -1, -1, 0, 0, -1, 1, 1]
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.5] and {t.group for t in trajs} == {3}
    assert tree.num_tokens() == (19, 10)
    with pytest.raises(ValueError, match="must align"):
        Segment([1, 2], True, [0.0], [0, 0])


def test_first_fit_decreasing():
    lengths = [5, 9, 3, 12, 4, 7]
    bins = first_fit_decreasing(lengths, 12)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert first_fit_decreasing([20], 8) == [[0]]


def test_every_task_demonstration_is_correct_and_env_scores_it():
    import asyncio

    from arbor.tasks.registry import TASKS, get_task
    for name in TASKS:
        task = get_task(name)
        p = task.generate(3, seed=0, split="test")[0]
        demo = task.demonstration(p)
        assert task.is_correct(p, demo[-1]["content"]), name
        if name == "python":
            continue  # its tool runs in the sandbox: covered by tests/test_python_tool.py

        async def play():
            env = task.make_env(p)
            await env.reset()
            reward = None
            for m in demo[2:]:
                if m["role"] == "assistant":
                    obs, reward, done = await env.step(m["content"])
                    if not done:
                        assert obs is not None
            return reward

        assert asyncio.run(play()) == 1.0, name
    with pytest.raises(ValueError, match="unknown task"):
        get_task("chess")
