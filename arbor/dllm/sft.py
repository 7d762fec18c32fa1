"""Masked-diffusion SFT of a block-diffusion LM (LLaDA's bound, per block, plus editing supervision).

An example is ``prompt ‖ response`` at absolute positions 0…; the response is the answer followed by
stop tokens up to the task's ``gen_length``. Each training sample mirrors one decoding step:
pick a block b that holds response tokens, keep the sequence up to the end of b (later blocks are
invisible to b), leave earlier blocks clean (at inference they are finished), and noise b's
response tokens:

    t ~ U(0, 1],  p = (1 − ε)·t + ε  (ε = 1e-3);  each response token of b is masked w.p. p;
    each still-visible one is replaced by a random response-alphabet token w.p. ``corrupt_prob``.

Loss (LLaDA masked-diffusion bound, made edit-aware as in LLaDA2.1):
    L = mean over samples of  [ Σ_masked (1/p)·CE  +  visible_weight·Σ_visible CE ] / L_b
with L_b the number of response tokens in block b; visible tokens (clean or corrupted) are
supervised towards the clean token, which is what T2T editing needs to fire correctly.

``reference_prompt`` is the "Reference answer: …" prefix TAD's teacher reads; a fraction
``reference_fraction`` of training samples uses it, padded to whole blocks so the response has the
same block layout with and without the reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from arbor.models import CausalLM, ModelConfig
from arbor.models.rows import take_rows
from arbor.tasks.registry import DIFFUSION_TASKS
from arbor.train.loop import BatchTrainer
from arbor.train.optim import OptimConfig
from arbor.train.run_log import LogConfig, RunLog

TASKS = DIFFUSION_TASKS                  # the one task registry's block-diffusion tasks
EPS = 1e-3


@dataclass
class DiffusionModelConfig:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    block_size: int = 64                 # every built-in task's response fits in one block


@dataclass
class DiffusionTrainConfig:
    """`arbor dllm-train`'s recipe; the defaults are the base model of `arbor bench dllm`."""
    out: str = "runs/dllm"               # HF-layout folder written (metrics.jsonl, checkpoint/ inside)
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    train_per_task: int = 4000
    steps: int = 2500
    batch_size: int = 48
    corrupt_prob: float = 0.1
    visible_weight: float = 1.0
    reference_fraction: float = 0.2
    seed: int = 0
    log_every: int = 50
    checkpoint_every: int = 250          # steps between resumable checkpoints in out/checkpoint (0: none)
    device: str = "cpu"
    model: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=50))
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.steps >= 1, "steps", "must be ≥ 1"), (self.batch_size >= 1, "batch_size", "must be ≥ 1"),
              (all(t in TASKS for t in self.tasks) and self.tasks, "tasks", f"must be a non-empty list of {sorted(TASKS)}"),
              (self.train_per_task >= 1, "train_per_task", "must be ≥ 1"), (self.log_every >= 1, "log_every", "must be ≥ 1"),
              (0 <= self.corrupt_prob <= 1, "corrupt_prob", "must be in [0, 1]"),
              (0 <= self.reference_fraction <= 1, "reference_fraction", "must be in [0, 1]"))


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    response: list[int]                  # answer + stop tokens, gen_length long
    reference_prompt: list[int]          # the TAD teacher's prompt


def reference_prompt(tokenizer, prompt_ids: list[int], answer: str, block_size: int) -> list[int]:
    """``"Reference answer: ANSWER"`` + spaces + ``"\\n"`` (a whole number of blocks) + prompt."""
    head = tokenizer.encode(f"Reference answer: {answer}")
    pad = (-(len(head) + 1)) % block_size
    return head + tokenizer.encode(" ") * pad + tokenizer.encode("\n") + list(prompt_ids)


def task_examples(tokenizer, task: str, n: int, seed: int, split: str, block_size: int):
    """(problems, examples) of one built-in task."""
    mod = TASKS[task]
    problems = mod.generate(n, seed=seed, split=split)
    out = []
    for p in problems:
        prompt, answer = tokenizer.encode(p.prompt), tokenizer.encode(p.answer)
        if len(answer) >= mod.GEN_LENGTH:
            raise ValueError(f"{task}: answer {p.answer!r} does not fit gen_length {mod.GEN_LENGTH}")
        response = answer + [tokenizer.eos_token_id] * (mod.GEN_LENGTH - len(answer))
        out.append(Example(prompt, response, reference_prompt(tokenizer, prompt, p.answer, block_size)))
    return problems, out


def build_model(tokenizer, cfg: DiffusionModelConfig, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    mc = ModelConfig(architecture="ArborBlockDiffusionForCausalLM", vocab_size=tokenizer.vocab_size,
                     hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     mask_token_id=tokenizer.mask_token_id, block_size=cfg.block_size,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     max_position_embeddings=512)
    return CausalLM(mc)


def noised_sample(ex_prompt: list[int], response: list[int], rng: random.Random, block_size: int, mask_id: int,
                  noise_ids: list[int], corrupt_prob: float, visible_weight: float):
    """One training sample → (input ids, target ids, loss weights), all [end of block b]."""
    P = len(ex_prompt)
    first, last = P // block_size, (P + len(response) - 1) // block_size
    b = rng.randint(first, last)
    start, end = max(P, b * block_size), min((b + 1) * block_size, P + len(response))
    ids = list(ex_prompt) + list(response[:end - P])
    targets, weights = list(ids), [0.0] * end
    p = (1 - EPS) * (1.0 - rng.random()) + EPS
    n = end - start
    for i in range(start, end):
        if rng.random() < p:
            ids[i], weights[i] = mask_id, 1.0 / (p * n)
        else:
            if rng.random() < corrupt_prob:
                ids[i] = rng.choice(noise_ids)
            weights[i] = visible_weight / n
    return ids, targets, weights


class PaddedBlockAttention:
    """``BlockDiffusionAttention`` computed as one padded batch (one SDPA call instead of one per
    sequence): the same outputs for every real token, faster for many short training sequences."""
    cu_seqlens = None

    def __init__(self, lengths: list[int], block_size: int, device=None):
        self.lengths, L = list(lengths), max(lengths)
        pos = torch.arange(L, device=device)
        self.valid = pos[None, :] < torch.tensor(self.lengths, device=device)[:, None]      # [N, L]
        starts = torch.tensor([0] + self.lengths[:-1], device=device).cumsum(0)
        self.index = (starts[:, None] + pos[None, :]).clamp(max=sum(self.lengths) - 1)      # [N, L]
        block = pos // block_size
        self.mask = ((block[None, :] <= block[:, None])[None] & self.valid[:, None, :])[:, None]
        self._pos = pos

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def positions(self) -> torch.Tensor:
        return torch.cat([self._pos[:n] for n in self.lengths])

    def attend(self, layer_idx, q, k, v, scale):
        pad = lambda x: take_rows(x, self.index)                                                          # [N, L, H, D]
        out = F.scaled_dot_product_attention(pad(q).transpose(1, 2), pad(k).transpose(1, 2), pad(v).transpose(1, 2),
                                             attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)[self.valid]


def diffusion_loss(model, samples) -> torch.Tensor:
    """Mean over samples of the weighted CE of ``noised_sample`` outputs (weights carry 1/p and 1/L_b)."""
    dev = model.device
    ids = torch.tensor([t for s in samples for t in s[0]], device=dev)
    targets = torch.tensor([t for s in samples for t in s[1]], device=dev)
    weights = torch.tensor([w for s in samples for w in s[2]], device=dev)
    attn = PaddedBlockAttention([len(s[0]) for s in samples], model.config.block_size, dev)
    hidden = model(ids, attn).hidden
    rows = weights.nonzero().squeeze(-1)
    ce = F.cross_entropy(model.logits(hidden[rows]).float(), targets[rows], reduction="none")
    return (ce * weights[rows]).sum() / len(samples)


def train_diffusion(model, examples: list[Example], cfg: DiffusionTrainConfig, on_log=None, until=None,
                    checkpoint_dir=None, run_log=None) -> list[dict]:
    """Masked-diffusion SFT in place (see module docstring), resuming from ``checkpoint_dir`` when it
    holds a checkpoint (``arbor.train.loop.BatchTrainer``); returns the logged metrics."""
    mask_id, B = model.config.mask_token_id, model.config.block_size
    noise_ids = sorted({t for e in examples for t in e.response})

    def step(rng) -> dict:
        batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
        samples = [noised_sample(e.reference_prompt if rng.random() < cfg.reference_fraction else e.prompt,
                                 e.response, rng, B, mask_id, noise_ids, cfg.corrupt_prob, cfg.visible_weight)
                   for e in batch]
        loss = diffusion_loss(model, samples)
        loss.backward()
        return {"loss": loss.detach(), "tokens": sum(len(s[0]) for s in samples)}

    return BatchTrainer(model, cfg, step).run(on_log, until, checkpoint_dir, run_log)


def train_from_config(cfg: DiffusionTrainConfig, out_dir=None, on_log=None):
    """Build the tokenizer, data and model; train; save an HF-layout folder to ``out_dir`` (default
    ``cfg.out``; resumable: checkpoints go to ``out_dir/checkpoint`` every ``cfg.checkpoint_every``
    steps, rows to ``out_dir/metrics.jsonl``)."""
    out_dir = out_dir or cfg.out or None
    from arbor.models import save_model
    from arbor.models.tokenizer import builtin_tokenizer
    tok = builtin_tokenizer()
    examples = []
    for i, task in enumerate(cfg.tasks):
        examples += task_examples(tok, task, cfg.train_per_task, cfg.seed + i, "train", cfg.model.block_size)[1]
    model = build_model(tok, cfg.model, cfg.seed).to(cfg.device)
    run_log = None if out_dir is None else RunLog(out_dir, cfg, cfg.steps, cfg.log, name="dllm-train")
    history = train_diffusion(model, examples, cfg, on_log,
                              checkpoint_dir=None if out_dir is None else Path(out_dir) / "checkpoint", run_log=run_log)
    if out_dir is not None:
        save_model(model, out_dir, tokenizer=tok)
    return model, tok, history
