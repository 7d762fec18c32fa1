"""Config loading, token layout of chats, rollout-tree trajectories, packing."""

import pytest

from arbor import configs
from arbor.models.tokenizer import builtin_tokenizer
from arbor.data.tools import tool_from_function
from arbor.rollout.chat import ChatLayout
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
    tools = [tool_from_function(ar.calc).schema]
    layout = ChatLayout(tok, tools)
    ids, mask = layout.transcript_ids(msgs)
    # the same ids the collector builds turn by turn: prompt, then model turns as text + eos, env pieces
    built, history = layout.prompt_ids(msgs[:2]), msgs[:2]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        text = layout.render(msgs[:i + 1])[len(layout.render(msgs[:i], True)):].split("<|im_end|>")[0]
        built += layout.model_turn_ids(text)
        history = msgs[:i] + [{"role": "assistant", "content": text}]
        if k + 1 < len(turns):
            built += layout.env_turn_ids(history, msgs[i + 1:turns[k + 1]])
    assert ids == built
    # trained tokens decode to exactly the assistant turns (tool calls as the template writes them)
    trained = tok.decode([t for t, k in zip(ids, mask) if k])
    calls = "".join(f'<tool_call>{{"name":"calc","arguments":{{"expr":"{s}"}}}}</tool_call><|im_end|>' for s in p.steps)
    assert trained == calls + f"Answer: {p.answer}<|im_end|>"
    # whole-string rendering agrees with the piecewise ids for the built-in tokenizer
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(msgs, tokenize=False, tools=tools)


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
    """Each built-in example, loaded through the public path (rows + tools + reward specs), scores its
    own demonstration 1.0 when the demonstration is played through its environment."""
    import asyncio

    from arbor.data.config import DataConfig
    from arbor.data.rewards import RewardConfig
    from arbor.models.tool_calls import parser_for
    from arbor.tasks.registry import BUILTINS, load_task
    tok = builtin_tokenizer()
    parser = parser_for(tok)
    for name in BUILTINS:
        if name == "python":
            continue  # its tool runs in the sandbox: covered by tests/test_python_tool.py
        task = load_task(task=name, data=DataConfig(), reward=RewardConfig(), tools=[], env="", seed=0, n_train=3, n_eval=3)
        row = task.eval[0]
        layout = ChatLayout(tok, [t.schema for t in task.tools] or None)

        async def play():
            env = task.make_env()
            await env.reset(row)
            reward = None
            for i, m in enumerate(row["messages"]):
                if m["role"] == "assistant" and i >= 2:
                    text = layout.render(row["messages"][:i + 1])[len(layout.render(row["messages"][:i], True)):]
                    text = text.split("<|im_end|>")[0]
                    turn = parser.parse(text)
                    msg = {"role": "assistant", "content": turn.content, "tool_calls": [c.openai() for c in turn.calls]}
                    obs, reward, done = await env.step(msg)
                    if not done:
                        assert obs and obs[0]["content"] == row["messages"][i + 1]["content"]
            return reward

        assert asyncio.run(play()) == 1.0, name
    with pytest.raises(ValueError, match="unknown task"):
        load_task(task="chess", data=DataConfig(), reward=RewardConfig(), tools=[], env="", seed=0, n_train=1, n_eval=1)
