"""A request's token sequence through the engine, and the ``Completion`` handed back.

Invariants: ``token_ids = prompt + output``; the KV (or recurrent state) of
``token_ids[:num_computed_tokens]`` is in the cache; ``num_cached_tokens ≤ num_computed_tokens``
counts the prefix-cache hits at admission; ``block_table`` covers every token that has been
scheduled; ``logprobs[i]`` is log p(output[i]) under the engine's logits (see ``sampler``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count

import torch

from arbor.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Completion:
    """One sample of one request. ``logprobs[i] = log_softmax(logits.float())[token_ids[i]]`` (temperature
    1, unfiltered; see ``sampler``); ``top_logprobs[i]`` maps the top ids to the same values. ``routed_experts`` [num_moe_layers, len(token_ids), k]: row i is
    the routing of output token i when it was fed back; the last token is never fed, its row is −1.
    ``ttft`` and ``latency`` are seconds from arrival to first token and to finish."""
    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    text: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    routed_experts: torch.Tensor | None = None
    num_cached_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    _ids = count()

    def __init__(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                 stop_ids: frozenset[int], max_tokens: int):
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index, self.params = request_id, index, params
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.stop_ids, self.max_tokens = stop_ids, max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.state_slot: int | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None
        self.routing: torch.Tensor | None = None   # [num_moe_layers, max_len, k] by position, −1 = not fed
        self.finish_reason: str | None = None
        self.text_end: int | None = None
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.arrival = time.perf_counter()
        self.first_token_time = self.finish_time = self.last_token_time = None
        self.num_reported = 0       # output tokens a front end has passed on (``rank_front``)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet computed (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top)
        self.last_token_time = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    def record_routing(self, start: int, ids: torch.Tensor) -> None:
        """ids [num_moe_layers, n, k]: routing of the tokens at positions start..start+n−1."""
        if self.routing is None:
            size = self.num_prompt_tokens + self.max_tokens
            self.routing = torch.full((ids.shape[0], size, ids.shape[2]), -1, dtype=ids.dtype)
        self.routing[:, start:start + ids.shape[1]] = ids

    def check_stop(self) -> str | None:
        """'stop' on a stop id, 'length' at max_tokens; stop strings are checked by the engine."""
        if self.token_ids[-1] in self.stop_ids:
            return "stop"
        if self.num_output_tokens >= self.max_tokens:
            return "length"
        return None

    def completion(self, tokenizer=None) -> Completion:
        """A snapshot (lists copied) that stays valid while the sequence runs on."""
        out = self.output_ids
        text = None
        if tokenizer is not None:
            shown = out[:-1] if self.finish_reason == "stop" and out and out[-1] in self.stop_ids else out
            text = tokenizer.decode(shown)[:self.text_end]
        routed = None
        if self.routing is not None:
            routed = self.routing[:, self.num_prompt_tokens:len(self.token_ids)].clone()
        end = self.finish_time or time.perf_counter()
        return Completion(
            self.request_id, self.index, self.token_ids[:self.num_prompt_tokens], out, list(self.logprobs),
            self.finish_reason, text, None if self.top_logprobs is None else list(self.top_logprobs), routed,
            self.num_cached_tokens, None if self.first_token_time is None else self.first_token_time - self.arrival,
            end - self.arrival if self.finish_reason else None)
