"""Per-request sampling knobs (the vLLM names), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 = greedy. Filters apply to the temperature-scaled distribution in the order
    top-k → top-p → min-p; ``seed`` gives the request its own ``torch.Generator`` so its tokens do
    not depend on what else is batched with it (sample j of ``n`` uses ``seed + j``).
    The engine stops at the model's EOS ids (unless ``ignore_eos``), at ``stop_token_ids`` and
    at ``stop`` strings (text is cut before the stop string; needs a tokenizer).
    ``final_only`` (vLLM's ``RequestOutputKind.FINAL_ONLY``): a streaming front end hands over only each
    sample's final snapshot, not one per token (a caller that needs only the result saves a wake-up
    and a snapshot per token; a front end may still send more, which a caller must accept)."""
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0                # top-k log-probs per token (0 = off)
    return_routed_experts: bool = False
    final_only: bool = False         # stream only each sample's final snapshot

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [(self.n >= 1, "n", "must be >= 1"), (self.temperature >= 0, "temperature", "must be >= 0"),
                  (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
                  (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"), (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
                  (self.max_tokens >= 1, "max_tokens", "must be >= 1"), (self.logprobs >= 0, "logprobs", "must be >= 0")]
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
        checks += [(whole(getattr(self, k)), k, "must be a whole number") for k in ("n", "top_k", "max_tokens", "logprobs")]
        checks += [(isinstance(self.final_only, bool), "final_only", "must be true or false")]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
