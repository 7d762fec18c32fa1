"""The ``data`` and ``eval`` sections of ``arbor sft`` / ``arbor train``: where the user's rows come
from and how a row becomes a prompt (``arbor.data.files``, ``arbor.data.prompts``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from arbor.configs import check


@dataclass
class DataConfig:
    train: str = ""              # the training rows: .jsonl / .json / .parquet / .csv, or a folder saved by HF datasets
    eval: str = ""               # held-out rows (same formats), evaluated every eval_every steps
    prompt_key: str = "prompt"   # a text column, or a column of OpenAI-format messages (system optional)
    messages_key: str = "messages"       # arbor sft: a whole conversation per row (assistant turns are trained)
    completion_key: str = "completion"   # arbor sft: … or prompt_key + this (text, or assistant messages)
    system: str = ""             # a system message put first in every prompt that has none
    max_prompt_tokens: int = 0   # longer prompts are dropped and counted (0: the rollout's context minus one turn)
    template_kwargs: dict = field(default_factory=dict)   # extra chat-template variables, e.g. {enable_thinking = false}
    shuffle: bool = True         # a fresh seeded order every epoch (else file order)

    def validate(self) -> None:
        check(self, (self.max_prompt_tokens >= 0, "max_prompt_tokens", "must be ≥ 0 (0: derived from the context)"),
              (bool(self.prompt_key), "prompt_key", "must name a column"),
              (bool(self.messages_key), "messages_key", "must name a column"),
              (bool(self.completion_key), "completion_key", "must name a column"))


@dataclass
class EvalConfig:
    samples: int = 1             # completions per held-out row: accuracy is pass@1 over them, pass@k any-correct
    temperature: float = 1.0     # sampling temperature when samples > 1 (one sample: greedy)
    table_rows: int = 4          # sample completions shown in the run log (OUT/samples.jsonl, TensorBoard text, W&B table)

    def validate(self) -> None:
        check(self, (self.samples >= 1, "samples", "must be ≥ 1"), (self.temperature >= 0, "temperature", "must be ≥ 0"),
              (self.table_rows >= 0, "table_rows", "must be ≥ 0"))
