"""Agent episodes without a server: trajectories from recorded calls, prompts that continue a call,
and the ``agent`` config's checks."""

import json

import pytest

from arbor import configs
from arbor.cluster.config import load_train_config
from arbor.models.tokenizer import builtin_tokenizer
from arbor.rollout.agent_config import load_agent
from arbor.rollout.agent_prompt import continued_prompt, normalize
from arbor.rollout.agent_record import CallRecord, episode_trees
from arbor.rollout.chat import ChatLayout
from arbor.train.config import RLConfig


def call(prompt, sampled, version=0, text=""):
    return CallRecord(list(prompt), list(sampled), [-0.5 - 0.01 * i for i in range(len(sampled))],
                      [version] * len(sampled), finish_reason="stop", text=text)


def test_calls_that_extend_each_other_make_one_trajectory():
    a = call([1, 2, 3], [10, 11])
    b = call([1, 2, 3, 10, 11, 4, 5], [12, 13, 14], version=1)      # tool tokens 4, 5 between the turns
    c = call(b.prompt_ids + b.token_ids + [6], [15])
    trees = episode_trees([a, b, c], 2.5, {}, group=7)
    assert len(trees) == 1
    [t] = trees[0].trajectories()
    assert t.tokens == c.prompt_ids + c.token_ids
    sampled = {1 + 2 + 1, 1 + 2 + 2} | {7 + 1, 7 + 2, 7 + 3} | {11 + 1}        # 1-based positions of sampled ids
    assert [i + 1 for i, m in enumerate(t.loss_mask) if m] == sorted(sampled)
    assert [x for x, m in zip(t.logp_infer, t.loss_mask) if m] == a.logprobs + b.logprobs + c.logprobs
    assert [v for v, m in zip(t.versions, t.loss_mask) if m] == [0, 0, 1, 1, 1, 0]
    assert (t.reward, t.group, t.prompt_len) == (2.5, 7, 3)


def test_rewritten_history_shares_only_the_common_prefix():
    a = call([1, 2, 3], [10, 11])
    b = call([1, 2, 3, 10, 11, 4], [12])
    rewrite = call([1, 2, 3, 10, 9], [13, 14])       # cuts a's answer after one token and writes its own
    fresh = call([50, 51], [16])                     # shares nothing: a tree of its own
    for i, c in enumerate([a, b, rewrite, fresh]):
        c.id = str(i)
    trees = episode_trees([a, b, rewrite, fresh], 1.0, {"2": 0.25}, group=0)
    assert len(trees) == 2
    trajs = trees[0].trajectories()
    assert [t.tokens for t in trajs] == [b.prompt_ids + b.token_ids, rewrite.prompt_ids + rewrite.token_ids]
    assert [t.reward for t in trajs] == [1.0, 0.25]  # the per-call reward of call "2" on its leaf
    assert trajs[0].loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert trajs[1].loss_mask == [0, 0, 0, 1, 0, 1, 1]    # the kept token of a's answer is still a model token
    assert trajs[1].logp_infer[3] == a.logprobs[0]
    assert trees[1].trajectories()[0].tokens == [50, 51, 16]
    total, compact = trees[0].num_tokens()
    assert (total, compact) == (14, 10)              # the shared prefix [1, 2, 3, 10] counted once


def test_a_repeated_prompt_branches_at_its_end():
    a, b = call([1, 2], [3, 4]), call([1, 2], [5])
    [tree] = episode_trees([a, b], 1.0, {}, group=0)
    assert [t.tokens for t in tree.trajectories()] == [[1, 2, 3, 4], [1, 2, 5]]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {}}}]


def test_a_call_that_echoes_the_reply_continues_the_sampled_ids():
    tok = builtin_tokenizer()
    layout = ChatLayout(tok, TOOLS)
    first = [{"role": "user", "content": "add 1 and 2"}]
    prompt = layout.prompt_ids(first)
    reply = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    # sampled ids the tokenizer would never produce from the text: proof that they are reused, not re-encoded
    sampled = [5, 6, 7, tok.eos_token_id]
    prev = CallRecord(prompt, sampled, [0.0] * 4, [0] * 4, finish_reason="stop", messages=[normalize(m) for m in first],
                      reply=normalize(reply), tools_key=json.dumps(TOOLS, sort_keys=True))
    echoed = {**reply, "refusal": None, "tool_calls": [{**reply["tool_calls"][0], "function": {"name": "add",
                                                                                               "arguments": {"a": 1}}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    messages = first + [echoed, tool]
    ids = continued_prompt([prev], messages, TOOLS, "", tok)
    assert ids == prompt + sampled + layout.env_turn_ids(first + [echoed], [tool])
    cut = CallRecord(**{**vars(prev), "token_ids": [5, 6], "logprobs": [0.0] * 2, "versions": [0] * 2})
    assert continued_prompt([cut], messages, TOOLS, "", tok)[len(prompt) + 2] == tok.eos_token_id   # cut: eos added
    rewritten = first + [{"role": "assistant", "content": "something else"}, tool]
    assert continued_prompt([prev], rewritten, TOOLS, "", tok) is None
    assert continued_prompt([prev], messages, None, "", tok) is None              # other tools: rendered afresh
    assert continued_prompt([prev], first, TOOLS, "", tok) is None                # no reply in the history


def test_agent_config_shorthand_and_checks(tmp_path):
    cfg = configs.load(RLConfig, None, ["agent=my_agent.py:run", "agent.timeout_s=5"])
    assert (cfg.agent.fn, cfg.agent.timeout_s) == ("my_agent.py:run", 5.0)
    with pytest.raises(ValueError, match="agent.timeout_s must be > 0"):
        configs.load(RLConfig, None, ["agent=my_agent.py:run", "agent.timeout_s=0"])
    with pytest.raises(ValueError, match="two ways to roll out"):
        configs.load(RLConfig, None, ["agent=my_agent.py:run", "env=my_env.py:Env"])
    with pytest.raises(ValueError, match=r"rollout.branch=\[4, 2\]"):
        configs.load(RLConfig, None, ["agent=my_agent.py:run", "rollout.branch=[4, 2]"])
    with pytest.raises(ValueError, match="does not run on cluster.backend=ray"):
        load_train_config(None, ["agent=my_agent.py:run", "cluster=ray"])
    f = tmp_path / "agents.py"
    f.write_text("def sync_run(client, row):\n    return 1.0\n"
                 "async def one_arg(client):\n    return 1.0\n"
                 "async def run(client, row):\n    return 1.0\n"
                 "NOT_A_FUNCTION = 3\n")
    assert load_agent(f"{f}:run").__name__ == "run"
    with pytest.raises(ValueError, match="is not async"):
        load_agent(f"{f}:sync_run")
    with pytest.raises(ValueError, match="does not take two arguments"):
        load_agent(f"{f}:one_arg")
    with pytest.raises(ValueError, match="not a function"):
        load_agent(f"{f}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="no file"):
        load_agent(f"{tmp_path}/missing.py:run")
    with pytest.raises(ValueError, match="has no|missing"):
        load_agent(f"{f}:absent")
