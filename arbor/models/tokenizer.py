"""Tokenizer wrapper: a `tokenizers.Tokenizer` plus eos/pad tokens and a Jinja2 chat template.

Invariants:
- `encode(text)` never adds special tokens; special-token strings inside `text` map to their
  single ids (they are never split), so `encode(apply_chat_template(m, tokenize=False))
  == apply_chat_template(m)`.
- The chat template is rendered exactly as HF transformers renders it (sandboxed Jinja2,
  `trim_blocks`, `lstrip_blocks`), so a folder written by `save` gives identical ids and
  strings in `transformers.AutoTokenizer.from_pretrained(folder)`.
- `builtin_tokenizer()` is a pure function of this file: the same tokenizer.json every build.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2
import jinja2.meta
import tokenizers
from datetime import datetime
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<|mask|>",
]
# Tool tags are added tokens that are never split but, as in Qwen's tokenizers, are not
# "special": decode(..., skip_special_tokens=True) keeps them so tool calls stay parseable.
NON_SPECIAL_TAGS = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}

# ChatML, with tools as Qwen-style templates take them: the schemas' names and parameters in the
# system turn, calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the parser
# `arbor.models.tool_calls` picks for this template), results as "tool" turns.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}{% endif %}"
    "Tools:{% for t in tools %} {{ t['function']['name'] }}({{ t['function']['parameters']['properties'] | join(',') }})"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\":' + (f['name'] | tojson) + ',\"arguments\":' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson(separators=(',', ':'))) }}"
    "{{ '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# How transformers' ``tokenizer.parse_response`` (its ``response_template``, transformers ≥ 5.13) reads a turn
# the template above renders: content, then any <tool_call>{json}</tool_call>, up to <|im_end|>. ``save``
# writes it beside that template, so the folder's tool calls parse in transformers and TRL's tool loop.
CHATML_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

DEFAULT_MODEL_MAX_LENGTH = 32768


def _token_str(value) -> str | None:
    """tokenizer_config.json stores tokens either as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter: plain ``json.dumps`` (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def reads_tools(source: str) -> bool:
    """Whether the Jinja template ``source`` reads a ``tools`` variable (renders tool schemas)."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def compile_template(source: str):
    """The Jinja2 environment transformers renders chat templates in (sandboxed, ``trim_blocks``,
    ``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer`; see module docstring for invariants."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_token: str = "<|im_end|>",
                 pad_token: str = "<|endoftext|>", chat_template: str = CHATML_TEMPLATE,
                 model_max_length: int = DEFAULT_MODEL_MAX_LENGTH, bos_token: str | None = None):
        self.tok = tok
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token = bos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.eos_token_id = self.token_id(eos_token)
        self.pad_token_id = self.token_id(pad_token)
        self.mask_token_id = tok.token_to_id("<|mask|>")
        self._template = compile_template(chat_template)

    # ---------------------------------------------------------------- load / save
    @classmethod
    def load(cls, path) -> "Tokenizer":
        """Load a folder holding tokenizer.json (+ optional tokenizer_config.json and
        chat_template.jinja), or a tokenizer.json file path."""
        path = Path(path)
        folder, tok_file = (path.parent, path) if path.is_file() else (path, path / "tokenizer.json")
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}: a model folder needs the HF tokenizer file "
                                    f"(tokenizer.json, as transformers' save_pretrained writes it) next to config.json")
        tok = tokenizers.Tokenizer.from_file(str(tok_file))
        kwargs = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            for key in ("eos_token", "pad_token", "bos_token"):
                if _token_str(cfg.get(key)):
                    kwargs[key] = _token_str(cfg[key])
            if isinstance(cfg.get("chat_template"), str):
                kwargs["chat_template"] = cfg["chat_template"]
            if isinstance(cfg.get("model_max_length"), int):
                kwargs["model_max_length"] = cfg["model_max_length"]
        jinja_file = folder / "chat_template.jinja"
        if "chat_template" not in kwargs and jinja_file.is_file():
            kwargs["chat_template"] = jinja_file.read_text()
        if "pad_token" not in kwargs and "eos_token" in kwargs and tok.token_to_id("<|endoftext|>") is None:
            kwargs["pad_token"] = kwargs["eos_token"]
        return cls(tok, **kwargs)

    def save(self, folder) -> None:
        """Write tokenizer.json and an HF-compatible tokenizer_config.json into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(folder / "tokenizer.json"))
        added = self.tok.get_added_tokens_decoder()
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            **({"bos_token": self.bos_token} if self.bos_token else {}),
            "chat_template": self.chat_template,
            **({"response_template": CHATML_RESPONSE_TEMPLATE} if self.chat_template == CHATML_TEMPLATE else {}),
            "model_max_length": self.model_max_length,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {
                str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip,
                         "normalized": t.normalized, "single_word": t.single_word, "special": t.special}
                for i, t in sorted(added.items())
            },
            "additional_special_tokens": [t.content for _, t in sorted(added.items())
                                          if t.special and t.content not in (self.eos_token, self.pad_token)],
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    # ---------------------------------------------------------------- ids
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (ids are 0..vocab_size-1)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        tid = self.tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return tid

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- chat
    @property
    def supports_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (renders tool schemas)."""
        return reads_tools(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None, **template_kwargs) -> list[int] | str:
        """Render ``messages`` (OpenAI-format dicts: role, content, optional tool_calls) with the chat
        template as transformers does: ``tools`` (OpenAI function schemas), ``add_generation_prompt``,
        the special tokens, and extra template variables (``enable_thinking=False``, …); with
        ``tokenize``, return ``encode(rendered)``. A template that fails raises ValueError naming
        the error (an undefined variable names the variable)."""
        if tools and not self.supports_tools:
            raise ValueError("this model's chat template does not render tools (it never reads a `tools` variable); "
                             "use a model whose template does (Qwen2.5/Qwen3, Llama 3.1, Arbor's built-in), or no tools")
        variables = {"eos_token": self.eos_token, "pad_token": self.pad_token, "bos_token": self.bos_token or "",
                     **template_kwargs}
        try:
            text = self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
        except (TypeError, AttributeError, KeyError) as e:
            raise ValueError(f"the chat template failed to render ({type(e).__name__}: {e}); check the messages' "
                             "fields (role, content, tool_calls) and data.template_kwargs") from None
        return self.encode(text) if tokenize else text


def builtin_tokenizer() -> Tokenizer:
    """Character-level tokenizer for Arbor's built-in tasks.

    Id layout (vocab_size 104):
      0..94   the printable ASCII characters chr(32)..chr(126), id = ord(c) - 32
      95      "\\n"
      96..103 SPECIAL_TOKENS in list order (<|endoftext|>=96, <|im_start|>=97, <|im_end|>=98,
              <tool_call>=99, </tool_call>=100, <tool_response>=101, </tool_response>=102,
              <|mask|>=103)
    Any other character (tab, non-ASCII) encodes to the id of "?" (31).
    decode(encode(s)) == s for every string of printable ASCII and newlines.
    The model is a BPE without merges or pre-tokenizer: the text between added tokens is split into its
    characters (each unknown one its own "?"), the same ids as splitting per character into a
    WordLevel model, at half the encoding time.
    """
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(chars + SPECIAL_TOKENS)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="?", fuse_unk=False))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS if t not in NON_SPECIAL_TAGS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in SPECIAL_TOKENS if t in NON_SPECIAL_TAGS])
    return Tokenizer(tok)
