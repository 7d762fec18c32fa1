"""The two workloads of ``arbor bench rl``, as tasks the RL trainer runs, and the default model folder.

``trl`` — TRL's own GRPO shape: ``prompts`` short prompts (a chat-templated one-line instruction) ×
``samples`` samples × ``new_tokens`` new tokens (EOS ignored), one model turn, reward = the share
of letters a…j in the output (dense, so advantages are non-zero).

``agentic`` — a shared system prompt of ``system_tokens`` tokens + a short task; ``turns`` model
turns of ``new_tokens`` tokens each (EOS ignored); after every model turn but the last a tool
answers with ``tool_min``–``tool_max`` tokens (length drawn from a hash of the turn's text, so a
run is reproducible); the rollout branches [4, 2] (4 children at the first model turn, 2 at the
second): 8 trajectories per group sharing their prefixes as a tree. The reward is scored on the
last turn as above.

Token counts are exact for a character-level tokenizer (the built-in one) and approximate (±1
word) for a sub-word one: text is grown word by word until it encodes to the wanted length.
"""

from __future__ import annotations

import copy
import random
import zlib
from dataclasses import dataclass

from arbor.rollout.environment import StepResult

LETTERS = "abcdefghij"
WORDS = ("tool", "agent", "file", "search", "result", "query", "status", "value", "error", "index", "shell",
         "python", "return", "output", "check", "plan", "answer", "step", "read", "write")


def score(text: str) -> float:
    """Share of the output's characters in a…j: dense and cheap, the same for Arbor and TRL."""
    return sum(c in LETTERS for c in text) / max(1, len(text))


def text_of_tokens(tok, n: int, seed: int) -> str:
    """Words drawn with ``seed`` until the text encodes to ``n`` tokens (exact for a character-level
    tokenizer: trimmed character by character at the end)."""
    rng = random.Random(seed)
    text = ""
    while len(tok.encode(text)) < n:
        text += rng.choice(WORDS) + " "
    while len(tok.encode(text)) > n and len(text) > 1:
        text = text[:-1]
    return text


@dataclass(frozen=True)
class Workload:
    """One shape of RL step. ``branch``: the rollout tree's fan-out per model turn."""
    name: str
    prompts: int               # groups per step
    branch: tuple[int, ...]
    new_tokens: int            # per model turn
    turns: int = 1
    system_tokens: int = 0
    tool_min: int = 64
    tool_max: int = 256

    @property
    def samples(self) -> int:
        n = 1
        for b in self.branch:
            n *= b
        return n

    @property
    def model_tokens(self) -> int:
        """Trained (model) tokens per trajectory."""
        return self.turns * self.new_tokens

    @property
    def max_context(self) -> int:
        return self.system_tokens + 64 + self.turns * (self.new_tokens + self.tool_max + 32) + 64


def workload(name: str, prompts: int | None = None, new_tokens: int | None = None, system_tokens: int | None = None) -> Workload:
    """The named workload with the issue's defaults, any of them overridden."""
    if name == "trl":
        return Workload("trl", prompts or 8, (4,), new_tokens or 32)
    if name == "agentic":
        return Workload("agentic", prompts or 2, (4, 2), new_tokens or 64, turns=3,
                        system_tokens=512 if system_tokens is None else system_tokens)
    raise ValueError(f"unknown workload {name!r}: trl or agentic")


@dataclass(frozen=True)
class Problem:
    index: int
    question: str


class BenchEnvironment:
    """``turns`` model turns of exactly ``max_turn_tokens`` tokens (EOS ignored); a tool answers
    every turn but the last; reward on the last turn."""
    ignore_eos = True

    def __init__(self, w: Workload, tok, system: str):
        self.w, self.tok, self.system = w, tok, system
        self.max_turn_tokens = w.new_tokens
        self.problem, self.turns = None, 0

    async def reset(self, row: dict) -> list[dict]:
        self.problem, self.turns = Problem(row["index"], row["prompt"]), 0
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.problem.question}]

    async def step(self, message: dict) -> StepResult:
        action = message["content"]
        self.turns += 1
        if self.turns >= self.w.turns:
            return StepResult(None, score(action), True)
        h = zlib.crc32(f"{self.problem.index}/{self.turns}/{action}".encode())
        n = random.Random(h).randint(self.w.tool_min, self.w.tool_max)
        return StepResult([{"role": "tool", "content": text_of_tokens(self.tok, n, h)}], 0.0, False)

    def score(self, message: dict) -> float:
        return score(message["content"])

    def fork(self) -> "BenchEnvironment":
        return copy.copy(self)


def questions(n: int, seed: int = 0) -> list[str]:
    """Short one-line instructions (TRL's shape: ~10 characters)."""
    rng = random.Random(f"bench-rl/{seed}")
    return [f"Say {rng.choice(LETTERS)} {rng.randint(2, 9)}x." for _ in range(n)]


def make_task(w: Workload, tok, n: int = 4096, seed: int = 0):
    """→ a ``tasks.registry.Task`` whose rows are this workload's prompts."""
    from arbor.tasks.registry import Task
    system = text_of_tokens(tok, w.system_tokens, 512) if w.system_tokens else ""
    rows = [{"prompt": q, "index": i} for i, q in enumerate(questions(n, seed))]
    return Task(f"bench-{w.name}", rows, rows, lambda: BenchEnvironment(w, tok, system))


def prompt_texts(w: Workload, tok, n: int, seed: int = 0) -> list[str]:
    """The chat-templated prompt strings of the first ``n`` problems (what TRL is given: the same ids)."""
    from arbor.rollout.chat import prompt_ids
    import asyncio
    task = make_task(w, tok, n, seed)
    return [tok.decode(prompt_ids(tok, asyncio.run(task.make_env().reset(row)))) for row in task.train]


def default_model(folder, seed: int = 0):
    """Write the tiny Qwen3 (hidden 256, 4 layers, built-in character tokenizer, random init) to
    ``folder`` as an HF folder that both Arbor and transformers load; → the folder."""
    import torch
    from arbor.models import CausalLM, ModelConfig
    from arbor.models.checkpoint import save_model
    from arbor.models.tokenizer import builtin_tokenizer
    tok = builtin_tokenizer()
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=-(-tok.vocab_size // 64) * 64, hidden_size=256,
                      intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    save_model(CausalLM(cfg), folder, tokenizer=tok)
    return folder
