"""Users' datasets through ``arbor.data`` and the chat layout: every file format read through
``datasets``, prompts from text or messages, the assistant-only SFT mask against a hand-made example,
trained ids that are the engine's own (no re-tokenisation), seeded epochs, and each kind of bad input
answered by ``arbor sft`` / ``arbor train`` with exit code 2 and a message naming what was wrong."""

import asyncio
import json

import pytest
import tokenizers
import torch

from arbor.cli import main
from arbor.data.config import DataConfig
from arbor.data.files import load_rows, plain_jsonl
from arbor.data.order import row_index
from arbor.data.prompts import conversation, prompt_messages
from arbor.data.rewards import RewardConfig
from arbor.models import CausalLM, save_model
from arbor.models.presets import preset_config
from arbor.models.tokenizer import SPECIAL_TOKENS, Tokenizer, builtin_tokenizer
from arbor.rollout.chat import ChatLayout
from arbor.tasks.registry import load_task

ROWS = [{"prompt": "What is 2+2?", "answer": "4", "level": 1}, {"prompt": "What is 3*3?", "answer": "9", "level": 2}]


def write(tmp_path, name: str, rows=ROWS):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        import datasets
        ds = datasets.Dataset.from_list(rows)
        {".parquet": ds.to_parquet, ".csv": ds.to_csv}.get(path.suffix, ds.save_to_disk)(str(path))
    return path


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "d.csv", "saved"])
def test_every_format_reads_the_same_rows(tmp_path, name):
    rows = load_rows(str(write(tmp_path, name)))
    assert [{k: r[k] for k in ("prompt", "level")} for r in rows] == [{k: r[k] for k in ("prompt", "level")} for r in ROWS]
    assert [str(r["answer"]) for r in rows] == ["4", "9"]          # CSV reads "4" as an integer column


FLAT = [{"q": "a\u2028b", "n": 1, "x": 0.5, "ok": True}, {"q": "é", "n": -2 ** 40, "x": 2.0, "ok": False}]
NOT_FLAT = {"a missing key": [{"q": "a", "n": 1}, {"q": "b"}], "a null": [{"q": "a"}, {"q": None}],
            "int and float": [{"n": 1}, {"n": 2.5}], "nested": [{"m": [{"role": "user"}]}, {"m": []}],
            "key order": [{"q": "a", "n": 1}, {"n": 2, "q": "b"}], "beyond int64": [{"n": 2 ** 63}],
            "a blank line": None}


@pytest.mark.parametrize("case", ["flat", *NOT_FLAT])
def test_jsonl_read_without_datasets_only_where_datasets_gives_the_same_rows(tmp_path, case):
    import datasets
    path = write(tmp_path, "d.jsonl", FLAT if case == "flat" else NOT_FLAT[case] or FLAT)
    if case == "a blank line":
        path.write_text(path.read_text().replace("\n", "\n\n", 1))
    fast = plain_jsonl(path)
    assert (fast is not None) == (case == "flat")
    try:
        via_datasets = datasets.load_dataset("json", data_files=str(path), split="train").to_list()
    except Exception:               # datasets cannot read it either: load_rows says so (test_bad_files_are_named)
        return
    assert load_rows(str(path)) == via_datasets
    if fast is not None:
        assert fast == via_datasets and [list(r) for r in fast] == [list(r) for r in via_datasets]


def test_a_saved_dataset_dict_picks_its_split(tmp_path):
    import datasets
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:1]), test=datasets.Dataset.from_list(ROWS[1:]))
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(str(tmp_path / "dd"))[0]["prompt"] == ROWS[0]["prompt"]
    assert load_rows(str(tmp_path / "dd"), "data.eval", split="test")[0]["prompt"] == ROWS[1]["prompt"]
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\] and none is 'validation'"):
        load_rows(str(tmp_path / "dd"), split="validation")


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="data.train: no such file or folder: .*nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"unknown format '.txt'.*expected a .jsonl, .json, .parquet or .csv"):
        load_rows(str(tmp_path / "d.txt"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="not one saved by datasets"):
        load_rows(str(tmp_path / "folder"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_rows(str(tmp_path / "empty.jsonl"))


def test_prompts_from_text_or_messages_with_a_system_message():
    assert prompt_messages({"q": "Hi"}, "q", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hi"}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert prompt_messages({"q": msgs}, "q", "ignored: the row has one") == msgs
    with pytest.raises(ValueError, match=r"row 3, column 'q': .*got NoneType"):
        prompt_messages({"q": None}, "q", index=3)
    with pytest.raises(ValueError, match=r"no such column; its columns are \['prompt'\]"):
        prompt_messages({"prompt": "x"}, "q")
    assert conversation({"prompt": "Q", "completion": "A"})[-1] == {"role": "assistant", "content": "A"}
    with pytest.raises(ValueError, match="must end with an assistant message"):
        conversation({"messages": msgs})


def _zephyr_tokenizer() -> Tokenizer:
    """The built-in character vocabulary with a non-ChatML template (turn markers, eos "</s>")."""
    tok = builtin_tokenizer().tok
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in ("<|user|>", "<|assistant|>", "<|system|>", "</s>")])
    template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
    return Tokenizer(tok, eos_token="</s>", chat_template=template)


def test_sft_trains_assistant_turns_only_against_a_hand_made_example():
    tok = _zephyr_tokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    ids, mask = ChatLayout(tok).transcript_ids(msgs)
    e, eos = tok.encode, [tok.token_id("</s>")]
    want = [(e("<|system|>\nS</s>\n<|user|>\nQ1</s>\n<|assistant|>\n"), 0), (e("A1") + eos, 1),
            (e("\n<|user|>\nQ2</s>\n<|assistant|>\n"), 0), (e("A2") + eos, 1)]
    assert ids == [t for piece, _ in want for t in piece]
    assert mask == [m for piece, m in want for _ in piece]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = builtin_tokenizer()
    tok.chat_template = "{{ messages[-1]['content'] }}"      # renders only the last message
    from arbor.models.tokenizer import compile_template
    tok._template = compile_template(tok.chat_template)
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatLayout(tok).transcript_ids([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                                        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "B"}])


def _merging_tokenizer() -> Tokenizer:
    """A BPE vocabulary in which "\\n" merges with every following character: re-tokenising the text of a
    trajectory joins the prompt's final "\\n" with the model's first character into one token."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(chars)}
    merges = [("\n", c) for c in chars if c != "\n"]
    vocab.update({"\n" + c: len(vocab) + i for i, c in enumerate(chars) if c != "\n"})
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    bpe.decoder = tokenizers.decoders.Fuse()
    bpe.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(bpe)


def test_trained_ids_are_the_engines_even_where_re_tokenising_would_merge_them(one_thread):
    """Multi-turn rollouts on a random model with a merging BPE vocabulary: every trajectory's ids are
    the pieces the engine saw (prompt, sampled turns, env turns), its log-probs are the engine's for
    those ids, and re-tokenising the text would have given other ids (the test has teeth)."""
    from arbor.engine import AsyncLLMEngine, EngineConfig
    from arbor.rollout.collector import Collector, RolloutConfig
    from arbor.train.run import sampling_factory
    from tests.float64_ref import engine_gap
    tok = _merging_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(preset_config("tiny", tok)).eval()
    engine = AsyncLLMEngine(model, EngineConfig(max_model_len=256), tokenizer=tok)
    collector = Collector(engine, tok, RolloutConfig(max_turn_tokens=6, max_context=200, branch=[4], temperature=1.0,
                                                     end_on_truncation=False), sampling_factory(tok, False))
    rows = [{"prompt": f"Say {c}.", "answer": c} for c in "abcd"]

    class Echo:
        """Two model turns: the first is answered by a user message, the second ends the episode."""
        def __init__(self):
            self.turns = 0

        async def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        async def step(self, message):
            self.turns += 1
            return ("next", 0.0, False) if self.turns == 1 else (None, float("a" in message["content"]), True)

        def fork(self):
            twin = Echo()
            twin.turns = self.turns
            return twin

    async def go():
        pool = [e for g, row in enumerate(rows) for e in await collector.start(Echo(), row, g, row, 0)]
        trees, _, _ = await collector.run_iteration(pool, 0)
        return trees

    trees = asyncio.run(go())
    layout = ChatLayout(tok)
    trajs = []
    for tree in trees:
        for t in tree.trajectories():
            assert t.tokens[:t.prompt_len] == layout.prompt_ids([{"role": "user", "content": tree.task["prompt"]}])
            assert 0 in t.loss_mask[t.prompt_len:] and 1 in t.loss_mask       # a masked env turn between model turns
            trajs.append(t)
    g, bound = engine_gap(model, trajs)
    assert g <= bound, f"the trained ids are not the engine's: log-prob gap {g:.3g} > {bound:.3g}"
    merged = [t for t in trajs if tok.encode(tok.decode(t.tokens)) != t.tokens]
    assert merged, "no trajectory whose re-tokenised text differs: the vocabulary does not test anything"


def test_rows_come_in_seeded_epochs():
    n = 7
    first = [row_index(k, n, seed=3) for k in range(n)]
    second = [row_index(k, n, seed=3) for k in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second      # each row once per epoch
    assert first == [row_index(k, n, seed=3) for k in range(n)]                        # a pure function of k
    assert first != [row_index(k, n, seed=4) for k in range(n)]
    assert [row_index(k, n, 3, shuffle=False) for k in range(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_long_prompts_are_dropped_and_counted_never_truncated(tmp_path):
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (5, 500, 6)]
    path = write(tmp_path, "d.jsonl", rows)
    task = load_task(task="", data=DataConfig(train=str(path)), reward=RewardConfig(fns=["exact"]), tools=[], env="",
                     seed=0, n_train=0, n_eval=0, tokenizer=builtin_tokenizer(), max_prompt_tokens=100)
    assert [len(r["prompt"]) for r in task.train] == [5, 6]
    assert task.dropped == {"data.train": {"invalid": 0, "too_long": 1}}
    assert any("dropped 1 of 3 rows (1 with a prompt longer than 100 tokens" in n for n in task.notes)
    with pytest.raises(ValueError, match="no rows left after dropping 3 too long"):
        load_task(task="", data=DataConfig(train=str(path)), reward=RewardConfig(fns=["exact"]), tools=[], env="",
                  seed=0, n_train=0, n_eval=0, tokenizer=builtin_tokenizer(), max_prompt_tokens=3)


# ---- bad input through the CLI: exit code 2 and a message naming what was wrong -------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("m") / "tiny"
    save_model(CausalLM(preset_config("tiny", tok)), folder, tokenizer=tok)
    return folder


def cli(capsys, *words) -> str:
    assert main(list(words)) == 2
    return capsys.readouterr().err


def test_cli_refuses_bad_user_input(tmp_path, model_dir, capsys):
    data = write(tmp_path, "d.jsonl")
    train = ["train", f"model={model_dir}", f"out={tmp_path / 'rl'}", "steps=1", f"data.train={data}"]
    assert "no such file or folder" in cli(capsys, "train", f"model={model_dir}", "data.train=missing.jsonl",
                                           'reward.fns=["exact"]')
    (tmp_path / "d.xlsx").write_text("x")
    assert "unknown format '.xlsx'" in cli(capsys, "sft", f"data.train={tmp_path / 'd.xlsx'}", "train.steps=1")
    err = cli(capsys, *train, "data.prompt_key=question", 'reward.fns=["exact"]')
    assert "data.prompt_key='question'" in err and "its columns are ['answer', 'level', 'prompt']" in err
    assert "no rows left" in cli(capsys, *train, "data.max_prompt_tokens=2", 'reward.fns=["exact"]')
    assert "no reward: set reward.fns" in cli(capsys, *train)
    (tmp_path / "r.py").write_text("import not_a_module\n")
    assert "importing" in cli(capsys, *train, f'reward.fns=["{tmp_path / "r.py"}:f"]')
    (tmp_path / "w.py").write_text("def f(x):\n    return 1.0\n")
    assert "has parameters (x)" in cli(capsys, *train, f'reward.fns=["{tmp_path / "w.py"}:f"]')
    (tmp_path / "t.py").write_text("def search(q: str) -> str:\n    return q\n")
    assert "docstring" in cli(capsys, *train, 'reward.fns=["exact"]', f'tools=["{tmp_path / "t.py"}:search"]')


def test_template_errors_are_named(tmp_path, capsys):
    tok = builtin_tokenizer()
    tok.chat_template = "{{ messages[0]['content'].upper() }}{{ raise_exception('no system turn allowed') }}"
    from arbor.models.tokenizer import compile_template
    tok._template = compile_template(tok.chat_template)
    with pytest.raises(ValueError, match="chat template failed to render: TemplateError: no system turn allowed"):
        ChatLayout(tok).prompt_ids([{"role": "user", "content": "x"}])
    plain = Tokenizer(builtin_tokenizer().tok, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="does not render tools"):
        plain.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {}}])

