"""Token layout of multi-turn chats from the model's own chat template, shared by SFT and RL so that
both train exactly what the engine saw.

A conversation is  prompt · (model turn · env turn)* · model turn, each piece tokenized on its own and
the ids concatenated, never re-tokenized as a whole, so the ids of turn t+1's prompt start with
exactly the ids of turn t's (and a model turn's ids are the ones the engine sampled):

- prompt      = render(messages before the first assistant turn, add_generation_prompt)
- model turn  = the assistant's text up to and including the end-of-turn token (eos) — trained
- env turn    = what the template renders after that eos up to the next generation prompt: the
                rest of the assistant turn (e.g. ChatML's "\\n"), the observation messages and
                the next "<|im_start|>assistant\\n" — not trained

An env turn is found as a difference of two renderings: render(history + observation, add_generation_prompt)
must start with render(history). A template that rewrites earlier turns when a message is added
(e.g. one that drops earlier reasoning after a new user message) cannot be laid out token-exactly:
``ChatLayout`` raises a ValueError saying so, rather than train on ids the engine never saw.
"""

from __future__ import annotations


class ChatLayout:
    """The pieces of one chat under ``tokenizer``'s template with ``tools`` (OpenAI function schemas
    offered to the model, or None) and extra template variables ``template_kwargs``."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        self.tok, self.tools, self.kwargs = tokenizer, tools or None, dict(template_kwargs or {})

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                            tools=self.tools, **self.kwargs)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self.render(messages, True))

    def model_turn_ids(self, content: str) -> list[int]:
        """A model turn written by hand: its text, then the end-of-turn token."""
        return self.tok.encode(content) + [self.tok.eos_token_id]

    def _turn_end(self, history: list[dict]) -> tuple[str, int, int]:
        """(render(history), where its last assistant turn starts, where it ends: after the eos)."""
        before = self.render(history[:-1], True)
        text = self.render(history)
        if not text.startswith(before):
            raise ValueError(_REWRITES)
        eos = text.rfind(self.tok.eos_token)
        end = eos + len(self.tok.eos_token) if eos >= len(before) else len(text)
        return text, len(before), end

    def env_turn_ids(self, history: list[dict], observation: list[dict]) -> list[int]:
        """The ids after the model's eos up to the next generation prompt; ``history`` ends with the
        assistant turn the model just wrote, ``observation`` are the messages that answer it."""
        text, _, end = self._turn_end(history)
        after = self.render(history + observation, True)
        if not after.startswith(text):
            raise ValueError(_REWRITES)
        return self.tok.encode(text[end:] + after[len(text):])

    def transcript_ids(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """A whole conversation → (ids, loss_mask): mask 1 exactly on the assistant turns' tokens
        (their text and end-of-turn token), 0 on the prompt and every other message."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or messages[-1]["role"] != "assistant":
            raise ValueError("a conversation needs at least one assistant turn and must end with one")
        ids = self.prompt_ids(messages[:first])
        mask = [0] * len(ids)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for k, i in enumerate(turns):
            if k:
                piece = self.env_turn_ids(messages[:turns[k - 1] + 1], messages[turns[k - 1] + 1:i])
                ids, mask = ids + piece, mask + [0] * len(piece)
            text, start, end = self._turn_end(messages[:i + 1])
            piece = self.tok.encode(text[start:end])
            ids, mask = ids + piece, mask + [1] * len(piece)
        return ids, mask


_REWRITES = ("the chat template renders earlier turns differently once a later message is added (e.g. it drops "
             "earlier reasoning after a new user message), so the conversation cannot be laid out token for token "
             "as the engine sampled it; use a template that renders each turn once (or data.template_kwargs that "
             "make it do so)")


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
    return ChatLayout(tokenizer, tools, template_kwargs).prompt_ids(messages)


def transcript_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                   **template_kwargs) -> tuple[list[int], list[int]]:
    return ChatLayout(tokenizer, tools, template_kwargs).transcript_ids(messages)
