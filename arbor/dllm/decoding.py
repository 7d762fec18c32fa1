"""Block-diffusion decoding: LLaDA2.1 joint threshold decoding with token editing, and baselines.

The response (``gen_length`` positions right after the prompt, all ``<|mask|>`` at the start) is
decoded block by block; block b covers absolute positions [b·B, (b+1)·B), so the first block may
start inside the prompt's tail, whose tokens are never changed. Each step is one forward pass over
the current block (finished blocks come from the exact KV cache of ``diffusion_cache``), giving
``p, x̂ = max / argmax softmax(logits)`` at every block position (the mask token never predicted); with
``temperature`` T > 0, x̂ is sampled from softmax(logits / T) instead and p is softmax(logits)[x̂]
(RL rollouts; one seeded generator per decode, so a batch's samples are reproducible).

``method="editing"`` (LLaDA2.1, joint M2T + T2T):
    M2T: every masked position with p > threshold gets x̂; if none passes, the single most
         confident masked position does;
    T2T: every already-decoded non-prompt position of the block with x̂ ≠ current token and
         p > editing_threshold gets x̂ (``editing_threshold=None``: never; 0.0: whenever x̂ differs);
    once no mask remains: up to ``max_post_steps`` edit-only steps, stopping after the first one
    that changes nothing; then the block is committed (its K/V written on the next forward).
``method="threshold"`` (Fast-dLLM): commit the top masked token plus every masked token with
    p ≥ threshold; no editing.
``method="low_confidence"`` (LLaDA): ``steps_per_block`` steps per block, each committing the
    k highest-confidence masked tokens, k from LLaDA's even split of the block's masks.

Decoding stops after the block holding the first stop token (or at ``gen_length``). Every forward
pass, edit-only ones included, is counted in ``DecodeResult.forwards``, of which
``edit_only_forwards`` started with no mask left in their block (so ``forwards − edit_only_forwards``
is the number of M2T steps, and with editing on every block costs at least one of each);
``num_tokens`` counts the response tokens before the first stop token, so TPF = num_tokens / forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from arbor.dllm.cache import BlockCacheAttention, SeqKVCache
from arbor.models.attention import BlockDiffusionAttention

METHODS = ("editing", "threshold", "low_confidence")
MODES = ("quality", "speed", "threshold")    # the named decoding modes (``mode_config``)


@dataclass
class DecodeConfig:
    method: str = "editing"
    threshold: float = 0.7               # M2T confidence threshold τ
    editing_threshold: float | None = 0.5  # T2T threshold; None = editing off
    max_post_steps: int = 16             # edit-only steps after a block has no mask left
    block_size: int | None = None        # None: the model's config.block_size
    steps_per_block: int = 8             # low_confidence only
    gen_length: int = 32
    use_cache: bool = True               # False: re-forward prompt + all blocks every step
    record: bool = False                 # keep the response state after every step
    temperature: float = 0.0             # > 0: x̂ sampled from softmax(logits / T) (RL rollouts); 0: argmax
    seed: int = 0                        # the sampling generator's seed (temperature > 0)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.gen_length <= 0 or self.steps_per_block <= 0 or self.max_post_steps < 0:
            raise ValueError("gen_length and steps_per_block must be positive, max_post_steps ≥ 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")


def quality(**kw) -> DecodeConfig:
    """LLaDA2.1 Quality mode: τ = 0.7, editing 0.5, 16 post steps, block 32."""
    return DecodeConfig(**{"method": "editing", "threshold": 0.7, "editing_threshold": 0.5,
                           "max_post_steps": 16, "block_size": 32, **kw})


def speed(**kw) -> DecodeConfig:
    """LLaDA2.1 Speed mode: τ = 0.5, edit whenever the prediction changes, 16 post steps, block 32."""
    return DecodeConfig(**{"method": "editing", "threshold": 0.5, "editing_threshold": 0.0,
                           "max_post_steps": 16, "block_size": 32, **kw})


def mode_config(mode: str, **kw) -> DecodeConfig:
    """A named mode at the model's own block size (``block_size=None`` unless given): ``quality`` and
    ``speed`` are LLaDA2.1's presets, ``threshold`` is Fast-dLLM threshold decoding at τ = 0.7 with no
    editing. What ``arbor generate --diffusion --mode``, ``arbor serve`` and EBPO rollouts decode with."""
    kw = {"block_size": None, **kw}
    if mode == "quality":
        return quality(**kw)
    if mode == "speed":
        return speed(**kw)
    if mode == "threshold":
        return DecodeConfig(**{"method": "threshold", "threshold": 0.7, "editing_threshold": None, **kw})
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


@dataclass
class DecodeResult:
    tokens: list[int]                    # the gen_length response positions (stop token included)
    num_tokens: int                      # response tokens before the first stop token
    forwards: int                        # forward passes this sequence took part in
    edits: int                           # T2T changes applied
    edit_only_forwards: int = 0          # forwards whose block held no mask (post steps)
    sequence: list[int] = field(default_factory=list)              # prompt + response, final
    trajectory: list[torch.Tensor] = field(default_factory=list)   # response after each step

    @property
    def tpf(self) -> float:
        return self.num_tokens / max(1, self.forwards)


@dataclass
class _Seq:
    ids: torch.Tensor                    # [P + gen_length]
    prompt_len: int
    block: int                           # index of the block being decoded
    cache: SeqKVCache = field(default_factory=SeqKVCache)
    forwards: int = 0
    edits: int = 0
    post_steps: int = 0
    edit_only_forwards: int = 0
    lc_step: int = 0                     # low_confidence: step inside the block
    lc_masks: int = 0                    # low_confidence: masks at the block's start
    done: bool = False
    trajectory: list = field(default_factory=list)


def transfer_counts(num_masked: int, steps: int) -> list[int]:
    """LLaDA's schedule: split ``num_masked`` over ``steps`` as evenly as possible, larger first
    (steps that would transfer 0 are dropped)."""
    base, extra = divmod(num_masked, steps)
    return [c for c in (base + (i < extra) for i in range(steps)) if c > 0]


class DiffusionDecoder:
    """Decode a batch of prompts (token-id lists) with one ``DecodeConfig``; see module docstring."""

    def __init__(self, model, cfg: DecodeConfig, stop_token_ids: list[int] | None = None):
        if not model.config.is_block_diffusion:
            raise ValueError(f"diffusion decoding needs a block-diffusion model, got {model.config.architecture}")
        self.model, self.cfg = model, cfg
        self.mask_id = model.config.mask_token_id
        self.block_size = cfg.block_size or model.config.block_size
        self.stop_ids = list(stop_token_ids if stop_token_ids is not None else model.config.stop_token_ids)
        self.model_calls = 0
        self.generator = None
        if cfg.temperature > 0:
            self.generator = torch.Generator(model.device).manual_seed(cfg.seed)

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_block=None) -> list[DecodeResult]:
        """``on_block(i, tokens, done)`` (optional) runs each time prompt i's current block is
        committed: ``tokens`` = its response so far (committed blocks, cut before the first stop
        token; a prefix of every later call's), ``done`` = its decoding has ended. An exception it
        raises ends the whole decode."""
        dev = self.model.device
        seqs = []
        for p in prompts:
            if not p:
                raise ValueError("every prompt needs at least one token")
            ids = torch.tensor(list(p) + [self.mask_id] * self.cfg.gen_length, dtype=torch.long, device=dev)
            seqs.append(_Seq(ids, len(p), len(p) // self.block_size))
        while active := [i for i, s in enumerate(seqs) if not s.done]:
            conf, pred = self._forward([seqs[i] for i in active])
            for i, c, x in zip(active, conf, pred):
                s, block = seqs[i], seqs[i].block
                s.forwards += 1
                self._step(s, c, x)
                if self.cfg.record:
                    s.trajectory.append(s.ids[s.prompt_len:].clone())
                if on_block is not None and s.block != block:
                    on_block(i, self._committed(s), s.done)
        return [self._result(s) for s in seqs]

    def _committed(self, s: _Seq) -> list[int]:
        tokens = s.ids[s.prompt_len:s.block * self.block_size].tolist()
        return tokens[:next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))]

    def _bounds(self, s: _Seq) -> tuple[int, int]:
        start = s.block * self.block_size
        return start, min(start + self.block_size, s.ids.shape[0])

    def _forward(self, seqs: list[_Seq]):
        """One forward pass over every active sequence's current block → per-sequence (p, x̂) [L]."""
        self.model_calls += 1
        spans = [self._bounds(s) for s in seqs]
        if self.cfg.use_cache:
            segs = [s.ids[s.cache.length:end] for s, (_, end) in zip(seqs, spans)]
            offsets = [start - s.cache.length for s, (start, _) in zip(seqs, spans)]   # = tokens to write
            attn = BlockCacheAttention([s.cache for s in seqs], [len(x) for x in segs], offsets, self.block_size)
            positions = attn.positions(self.model.device)
        else:
            segs = [s.ids[:end] for s, (_, end) in zip(seqs, spans)]
            attn = BlockDiffusionAttention.from_lengths([len(x) for x in segs], self.block_size, self.model.device)
            positions, offsets = None, [start for start, _ in spans]
        hidden = self.model(torch.cat(segs), attn, positions=positions).hidden
        if self.cfg.use_cache:
            attn.finish()
        rows, seg_start = [], 0
        for seg, offset, (start, end) in zip(segs, offsets, spans):
            rows.append(torch.arange(seg_start + offset, seg_start + offset + end - start, device=hidden.device))
            seg_start += len(seg)
        rows = torch.cat(rows)
        logits = self.model.logits(hidden[rows]).float()
        logits[:, self.mask_id] = float("-inf")
        probs = logits.softmax(-1)
        if self.generator is None:
            conf, pred = probs.max(-1)
        else:                                   # sampled x̂; p = its probability under the model
            pred = torch.multinomial((logits / self.cfg.temperature).softmax(-1), 1, generator=self.generator)[:, 0]
            conf = probs.gather(-1, pred[:, None])[:, 0]
        sizes = [end - start for start, end in spans]
        return conf.split(sizes), pred.split(sizes)

    # ------------------------------------------------------------------ one step's rule
    def _step(self, s: _Seq, conf: torch.Tensor, pred: torch.Tensor) -> None:
        start, end = self._bounds(s)
        cur = s.ids[start:end]
        editable = torch.arange(start, end, device=cur.device) >= s.prompt_len
        masked = cur == self.mask_id
        had_mask = bool(masked.any())
        unmask = self._unmask(s, conf, masked) if had_mask else torch.zeros_like(masked)
        edit = torch.zeros_like(masked)
        if self.cfg.method == "editing" and self.cfg.editing_threshold is not None:
            edit = ~masked & editable & (pred != cur) & (conf > self.cfg.editing_threshold)
        change = unmask | edit
        cur[change] = pred[change]
        s.edits += int(edit.sum())
        if had_mask and bool((cur == self.mask_id).any()):
            return
        if self.cfg.method == "editing" and self.cfg.editing_threshold is not None:
            if had_mask:                       # masks just ran out: edit-only steps follow
                if self.cfg.max_post_steps > 0:
                    return
            else:
                s.post_steps += 1
                s.edit_only_forwards += 1
                if bool(edit.any()) and s.post_steps < self.cfg.max_post_steps:
                    return
        self._commit(s, end)

    def _unmask(self, s: _Seq, conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        c = torch.where(masked, conf, torch.full_like(conf, -1.0))
        top = torch.zeros_like(masked)
        if self.cfg.method == "low_confidence":
            if s.lc_step == 0:
                s.lc_masks = int(masked.sum())
            counts = transfer_counts(s.lc_masks, self.cfg.steps_per_block)
            k = counts[s.lc_step] if s.lc_step < len(counts) else int(masked.sum())
            s.lc_step += 1
            top[c.topk(min(k, int(masked.sum()))).indices] = True
            return top
        top[c.argmax()] = True
        if self.cfg.method == "threshold":
            return top | (masked & (conf >= self.cfg.threshold))
        passed = masked & (conf > self.cfg.threshold)
        return passed if bool(passed.any()) else top

    def _commit(self, s: _Seq, end: int) -> None:
        s.post_steps = s.lc_step = 0
        s.block += 1
        response = s.ids[s.prompt_len:end]
        stopped = any(bool((response == t).any()) for t in self.stop_ids)
        s.done = stopped or end >= s.ids.shape[0]

    def _result(self, s: _Seq) -> DecodeResult:
        tokens = s.ids[s.prompt_len:].tolist()
        n = next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
        return DecodeResult(tokens, n, s.forwards, s.edits, s.edit_only_forwards, s.ids.tolist(), s.trajectory)


def diffusion_generate(model, prompts: list[list[int]], cfg: DecodeConfig | None = None,
                       stop_token_ids: list[int] | None = None, **overrides) -> list[DecodeResult]:
    """Python API: decode ``prompts`` (lists of token ids) with ``cfg`` (default ``quality()``)."""
    cfg = replace(cfg or quality(), **overrides)
    return DiffusionDecoder(model, cfg, stop_token_ids).generate(prompts)


def generate_text(model, tokenizer, prompts: list[str], cfg: DecodeConfig | None = None, **overrides):
    """Strings in, (text before the stop, DecodeResult) pairs out."""
    stop = [tokenizer.eos_token_id]
    results = diffusion_generate(model, [tokenizer.encode(p) for p in prompts], cfg, stop, **overrides)
    return [(tokenizer.decode(r.tokens[:r.num_tokens]), r) for r in results]


def trajectory_lines(trajectory, mask_id: int, tok) -> list[str]:
    """One line per recorded forward (``DecodeConfig.record``): the response state (``_`` a mask, ``·``
    a stop token), and how many masks it filled and tokens it edited."""
    shown = lambda t: "_" if t == mask_id else "·" if t == tok.eos_token_id else tok.decode([t])
    before = trajectory[0].clone().fill_(mask_id) if trajectory else None      # the response starts all masked
    lines = []
    for i, state in enumerate(trajectory, 1):
        was_masked = before == mask_id
        filled, edited = int((was_masked & (state != mask_id)).sum()), int((~was_masked & (state != before)).sum())
        lines.append(f"  step {i:3d}  {''.join(shown(t) for t in state.tolist())}  +{filled} unmasked, {edited} edited")
        before = state
    return lines
