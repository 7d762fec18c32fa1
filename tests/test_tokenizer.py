import json

import pytest

from arbor.models.tokenizer import SPECIAL_TOKENS, Tokenizer, builtin_tokenizer

TRICKY = [
    "",
    " ",
    "   leading and trailing   ",
    "a  b   c\n\n\nd\n",
    "\n  \n",
    "What is (17 + 25) * 3 - 8?",
    "".join(chr(c) for c in range(32, 127)) + "\n",
    "<tool_call>17+25</tool_call> Answer: -118",
]

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<tool_call>2+3</tool_call>"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "Answer: 5"},
]
EXPECTED_CHAT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>2+3</tool_call><|im_end|>\n"
    "<|im_start|>tool\n5<|im_end|>\n"
    "<|im_start|>assistant\nAnswer: 5<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tok.save(folder)
    return folder


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_layout_and_ids(tok):
    assert tok.vocab_size == 96 + len(SPECIAL_TOKENS)
    assert tok.encode(" ~\n") == [0, 94, 95]
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(96, 104))
    assert tok.eos_token_id == tok.token_id("<|im_end|>")
    assert tok.pad_token_id == tok.token_id("<|endoftext|>")
    assert tok.mask_token_id == tok.token_id("<|mask|>")


def test_special_tokens_not_split(tok):
    for t in SPECIAL_TOKENS:
        assert tok.encode(t) == [tok.token_id(t)]
        assert tok.encode("x" + t + "y") == [tok.token_id("x"), tok.token_id(t), tok.token_id("y")]
    ids = tok.encode("<|im_start|>hi<|im_end|><tool_call>1</tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi<tool_call>1</tool_call>"


def test_chat_template(tok):
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == EXPECTED_CHAT
    assert tok.apply_chat_template(MESSAGES) == tok.encode(EXPECTED_CHAT)
    prompt = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_save_load_round_trip(tok, saved):
    loaded = Tokenizer.load(saved)
    assert loaded.tok.to_str() == tok.tok.to_str()
    for text in TRICKY + [EXPECTED_CHAT]:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert Tokenizer.load(saved / "tokenizer.json").encode(EXPECTED_CHAT) == tok.encode(EXPECTED_CHAT)
    cfg = json.loads((saved / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_transformers_loads_saved_folder(tok, saved):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(saved))
    for text in TRICKY + [EXPECTED_CHAT]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.eos_token_id == tok.eos_token_id and hf.pad_token_id == tok.pad_token_id
    for gen in (False, True):
        text = hf.apply_chat_template(MESSAGES[:2], add_generation_prompt=gen, tokenize=False)
        assert text == tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=gen, tokenize=False)
        ids = hf.apply_chat_template(MESSAGES[:2], add_generation_prompt=gen, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ids == tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=gen)
    assert hf.decode(tok.encode(TRICKY[3])) == TRICKY[3]


def test_builtin_is_deterministic():
    assert builtin_tokenizer().tok.to_str() == builtin_tokenizer().tok.to_str()


def test_unknown_token_raises(tok):
    with pytest.raises(ValueError, match="<nope>"):
        tok.token_id("<nope>")


def test_load_missing_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.load(tmp_path)


def test_ids_are_one_per_character(tok):
    """The documented layout for any text without added tokens: a printable ASCII character c → ord(c) − 32,
    "\\n" → 95, every other character (tab, accents, CJK, emoji) its own "?" (31)."""
    text = "a\tb é ü 中文 😀\r\n\n\t\tx?" + "".join(chr(c) for c in range(32, 127))
    want = [ord(c) - 32 if 32 <= ord(c) < 127 else 95 if c == "\n" else 31 for c in text]
    assert tok.encode(text) == want
