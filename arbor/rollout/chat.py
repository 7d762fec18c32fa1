"""Token layout of multi-turn chats, shared by SFT and RL so both train exactly what the engine saw.

A conversation is  prompt · (model turn · env turn)* · model turn  where

- prompt      = chat template of the system/user messages + "<|im_start|>assistant\\n"
- model turn  = the sampled tokens, ending with the end-of-turn token "<|im_end|>" (trained)
- env turn    = "\\n<|im_start|>{role}\\n{content}<|im_end|>\\n<|im_start|>assistant\\n" (not trained)

Each piece is tokenized on its own and the ids are concatenated, never re-tokenized as a
whole, so the ids of turn t+1's prompt start with exactly the ids of turn t's.
"""

from __future__ import annotations


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def env_turn_ids(tokenizer, content: str, role: str = "tool") -> list[int]:
    return tokenizer.encode(f"\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n")


def model_turn_ids(tokenizer, content: str) -> list[int]:
    return tokenizer.encode(content) + [tokenizer.eos_token_id]


def transcript_ids(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """A full demonstration → (ids, loss_mask), mask 1 on assistant tokens (incl. "<|im_end|>").

    messages: leading system/user messages, then alternating assistant / tool (or user) turns,
    ending with an assistant turn."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or messages[-1]["role"] != "assistant":
        raise ValueError("a demonstration needs at least one assistant turn and must end with one")
    ids = prompt_ids(tokenizer, messages[:first])
    mask = [0] * len(ids)
    for m in messages[first:]:
        if m["role"] == "assistant":
            piece = model_turn_ids(tokenizer, m["content"])
            ids += piece
            mask += [1] * len(piece)
        else:
            piece = env_turn_ids(tokenizer, m["content"], m["role"])
            ids += piece
            mask += [0] * len(piece)
    return ids, mask
