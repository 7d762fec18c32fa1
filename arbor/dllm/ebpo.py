"""Likelihood estimators and the clipped objective of RL on block-diffusion LMs: LLaDA2.1's EBPO, its
per-block variant, ESPO's sequence-level ELBO ratio and the one-step mean-field estimate of d1 /
diffu-GRPO. ``dllm.estimator`` picks one; each gives log-likelihood *units*, and ``ebpo_loss`` takes
one clipped ratio per unit.

A sample is a prompt x (P tokens, absolute positions 0…P−1) and a response y (L tokens after it);
block b covers absolute positions [b·B, (b+1)·B) and the response blocks are b0 = ⌊P/B⌋ … ⌊(P+L−1)/B⌋.

Block ELBOs (``elbo_blocks``): a step's noise is N masks per sample with a weight w_{n,s} each. For
each n, one forward over every sample's [noisy ⊕ clean] sequence:

    noisy = x ⊕ y_n from block b0 on (the response tokens of mask n replaced by [MASK]; prompt never),
    clean = x ⊕ y   up to the start of the last response block (the keys later noisy blocks need),

both at their absolute positions, with the block-causal mask M (BD3-LM): a noisy token of block b
sees the noisy tokens of block b and the clean tokens of blocks < b; a clean token of block b sees
the clean tokens of blocks ≤ b. So a noisy block computes exactly what the decoder computes for
that block (finished blocks clean, this block noisy), and one forward gives every block's

    ELBO_b = Σ_n w_{n,s} Σ_{i ∈ b, masked in n} log p_θ(y_i | z_n, x; M)

(the mask token is excluded from the softmax, as in the decoder). The same masks serve θ and θ_old
(drawn once per step), so every ratio is exactly 1 at θ = θ_old. ``elbo_blocks_loop`` computes the
same value one block and one mask at a time (the decoder's view: clean prefix ⊕ noisy block under
``BlockDiffusionAttention``); the tests hold the two equal.

``ebpo`` — LLaDA2.1 (arXiv 2602.08676), as transcribed in the project's spec (specs/diffusion.md; the
paper's own text was not reachable from here): one ratio per *sequence*, the sum of the block-level
ELBO contributions, clipped once:

    J = E[ min(ρ·Â, clip(ρ, 1 − ε_low, 1 + ε_high)·Â) ]
    log ρ(y|x) ≈ Σ_n w_n Σ_b [ log p_θ(y^b | z_n, x; M) − log p_θold(y^b | z_n, x; M) ]

with ``draw_noise``: levels t_n (``dllm.levels``, default 0.25, 0.5, 0.75, 1.0; each response token
masked w.p. t_n) and w_n = 1/(N·t_n), an N-point quadrature of LLaDA's E_{t~U(0,1]}[(1/t)·Σ_masked
log p] (the paper publishes neither; these are our choice).

``ebpo_block`` — the per-block variant: r_b = exp(ELBO_b(θ) − ELBO_b(θ_old))
clipped per block, averaged over the sample's blocks. With every response inside one block (Countdown
at block 64) it equals ``ebpo``.

``espo`` — ESPO (Ou et al., arXiv 2512.03759, and its code ML-GSAI/ESPO): the sequence ELBO, one
ratio per sequence with per-token normalisation,

    ρ(y|x) = exp( (ELBO_θ(y|x) − ELBO_θold(y|x)) / L ),

its ELBO estimated as ESPO's code does (``draw_espo_noise``): per draw, x ∈ {0…L} masked tokens
(stratified over the step's samples: u_s = (u_0 + s/S) mod 1, x = ⌊u_s·(L+1)⌋), chosen uniformly,
weight (L+1)/x, and the antithetic draw that masks the complement with weight (L+1)/(L−x), the pair
averaged: an unbiased estimate of LLaDA's bound Σ_{l=1..L} (1/l)·E_{|M|=l}[Σ_{i∈M} log p(y_i | y_M̄)].
Here the ELBO is the block-diffusion model's (the sum of its block ELBOs, as in ``ebpo``).

``mean_field`` (``mean_field_logprobs``, d1): one forward of x̃ ⊕ [mask]^L, x̃ = the prompt with each
token masked w.p. ``prompt_mask_prob`` (the same draw for θ and θ_old); the per-token log p(y_i) is
the log-likelihood proxy and the ratio is per token.

``ebpo_loss`` is the PPO surrogate of ``arbor.train.losses.policy_loss`` (asymmetric clip ε_low,
ε_high, optional dual clip; no mismatch correction) over the units — sequences (``ebpo``, ``espo``),
blocks (``ebpo_block``), tokens (``mean_field``) — averaged per sample over its units, then over samples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from arbor.models import BlockDiffusionAttention
from arbor.models.rows import take_rows
from arbor.train.config import EBPO_ESTIMATORS as ESTIMATORS
from arbor.train.losses import LossConfig, policy_loss



@dataclass
class Noise:
    """One step's noise draws: per draw n, per sample s, a bool mask over the response (True = masked)
    and its weight w_{n,s}; ``prompt_masks`` per sample over the prompt (mean field); ``levels`` the
    masking levels t_n of EBPO's quadrature (empty for ESPO's per-sample draws)."""
    levels: list[float]
    response_masks: list[list[torch.Tensor]]
    prompt_masks: list[torch.Tensor]
    weights: list[list[float]]

    def select(self, idx: list[int]) -> "Noise":
        """The draws of samples ``idx`` (a mini-batch), in that order."""
        return replace(self, response_masks=[[m[i] for i in idx] for m in self.response_masks],
                       prompt_masks=[self.prompt_masks[i] for i in idx],
                       weights=[[w[i] for i in idx] for w in self.weights])


def level_weights(levels) -> list[float]:
    return [1.0 / (len(levels) * t) for t in levels]


def draw_noise(prompt_lens: list[int], response_lens: list[int], levels, prompt_mask_prob: float = 0.15,
               seed: int = 0) -> Noise:
    """EBPO's draws: at level t_n every response token masked w.p. t_n, weight w_n = 1/(N·t_n)."""
    g = torch.Generator().manual_seed(seed)
    resp = [[torch.rand(n, generator=g) < t for n in response_lens] for t in levels]
    prompt = [torch.rand(n, generator=g) < prompt_mask_prob for n in prompt_lens]
    return Noise(list(levels), resp, prompt, [[w] * len(response_lens) for w in level_weights(levels)])


def draw_espo_noise(prompt_lens: list[int], response_lens: list[int], num_mc: int = 2, seed: int = 0) -> Noise:
    """ESPO's draws (module docstring): ``num_mc`` stratified draws per sample, each followed by its
    antithetic complement, so 2·``num_mc`` masks; weights (L+1)/(2·x·num_mc) and (L+1)/(2·(L−x)·num_mc)
    (0 where a mask is empty)."""
    g = torch.Generator().manual_seed(seed)
    S, masks, weights = len(response_lens), [], []
    for _ in range(num_mc):
        u0 = float(torch.rand((), generator=g, dtype=torch.float64))
        draw, comp, w, wc = [], [], [], []
        for s, L in enumerate(response_lens):
            x = min(int(((u0 + s / S) % 1.0) * (L + 1)), L)
            m = torch.zeros(L, dtype=torch.bool)
            m[torch.randperm(L, generator=g)[:x]] = True
            draw.append(m)
            comp.append(~m)
            w.append((L + 1) / (2 * x * num_mc) if x else 0.0)
            wc.append((L + 1) / (2 * (L - x) * num_mc) if x < L else 0.0)
        masks += [draw, comp]
        weights += [w, wc]
    return Noise([], masks, [torch.zeros(n, dtype=torch.bool) for n in prompt_lens], weights)


class NoisyCleanAttention:
    """[noisy ⊕ clean] sequences as one padded SDPA batch with the mask of the module docstring.
    ``pos`` and ``noisy`` are per-sequence [n] tensors (absolute position, noisy-copy flag)."""
    cu_seqlens = None

    def __init__(self, pos: list[torch.Tensor], noisy: list[torch.Tensor], block_size: int, device=None):
        self.lengths = [len(p) for p in pos]
        N, L = len(pos), max(self.lengths)
        self._pos = torch.cat(pos).to(device)
        r = torch.arange(L, device=device)
        self.valid = r[None, :] < torch.tensor(self.lengths, device=device)[:, None]
        starts = torch.tensor([0] + self.lengths[:-1], device=device).cumsum(0)
        self.index = (starts[:, None] + r[None, :]).clamp(max=sum(self.lengths) - 1)
        mask = torch.zeros(N, L, L, dtype=torch.bool, device=device)
        for i, (p, z) in enumerate(zip(pos, noisy)):
            b, z = (p // block_size).to(device), z.to(device)
            bq, bk, zq, zk = b[:, None], b[None, :], z[:, None], z[None, :]
            m = (zq & zk & (bk == bq)) | (zq & ~zk & (bk < bq)) | (~zq & ~zk & (bk <= bq))
            mask[i, :len(p), :len(p)] = m
            mask[i, len(p):, 0] = True            # padding queries: any key (their rows are dropped)
        self.mask = mask[:, None]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def positions(self) -> torch.Tensor:
        return self._pos

    def attend(self, layer_idx, q, k, v, scale):
        pad = lambda x: take_rows(x, self.index).transpose(1, 2)
        dtype = q.dtype
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=self.mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)[self.valid].to(dtype)


def _logp(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.logits(hidden).float() if hidden.dtype != torch.float64 else model.logits(hidden)
    logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == model.config.mask_token_id,
                                float("-inf"))
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def _blocks(P: int, L: int, B: int) -> tuple[int, int]:
    return P // B, (P + L - 1) // B


def elbo_blocks(model, prompts: list[list[int]], responses: list[list[int]], noise: Noise):
    """→ (ELBO [S, U], valid [S, U]): per sample, per response block (U = most blocks of any sample),
    one forward per draw of ``noise`` (see module docstring)."""
    dev, B, mask_id = model.device, model.config.block_size, model.config.mask_token_id
    S = len(prompts)
    spans = [_blocks(len(x), len(y), B) for x, y in zip(prompts, responses)]
    U = max(bl - b0 + 1 for b0, bl in spans)
    total = None
    for n, w in enumerate(noise.weights):
        ids, pos, noisy, rows, targets, units = [], [], [], [], [], []
        offset = 0
        for s, (x, y) in enumerate(zip(prompts, responses)):
            P, T = len(x), len(x) + len(y)
            b0, bl = spans[s]
            clean = torch.tensor(list(x) + list(y), dtype=torch.long)
            z = clean.clone()
            m = noise.response_masks[n][s]
            z[P:][m] = mask_id
            s0, c_end = b0 * B, bl * B
            ids.append(torch.cat([z[s0:T], clean[:c_end]]))
            pos.append(torch.cat([torch.arange(s0, T), torch.arange(c_end)]))
            noisy.append(torch.cat([torch.ones(T - s0, dtype=torch.bool), torch.zeros(c_end, dtype=torch.bool)]))
            at = torch.nonzero(m).squeeze(-1) + P                      # absolute positions of masked tokens
            rows.append(offset + at - s0)
            targets.append(clean[at])
            units.append(s * U + at // B - b0)
            offset += len(ids[-1])
        attn = NoisyCleanAttention(pos, noisy, B, dev)
        hidden = model(torch.cat(ids).to(dev), attn).hidden
        rows, targets, units = (torch.cat(v).to(dev) for v in (rows, targets, units))
        lp = _logp(model, hidden[rows], targets)
        level = torch.zeros(S * U, dtype=lp.dtype, device=dev).index_add(0, units, lp)
        level = level * torch.tensor(w, dtype=lp.dtype, device=dev).repeat_interleave(U)
        total = level if total is None else total + level
    valid = torch.tensor([[u <= bl - b0 for u in range(U)] for b0, bl in spans], device=dev)
    return total.view(S, U), valid


def elbo_blocks_loop(model, prompts, responses, noise: Noise):
    """The reference: ``elbo_blocks`` one sample, draw and block at a time, each block as the decoder
    sees it (clean prefix ⊕ noisy block, ``BlockDiffusionAttention``). → (ELBO [S, U], valid [S, U])."""
    dev, B, mask_id = model.device, model.config.block_size, model.config.mask_token_id
    spans = [_blocks(len(x), len(y), B) for x, y in zip(prompts, responses)]
    U = max(bl - b0 + 1 for b0, bl in spans)
    out = torch.zeros(len(prompts), U, dtype=torch.float64, device=dev)
    for n, ws in enumerate(noise.weights):
        for s, (x, y, w) in enumerate(zip(prompts, responses, ws)):
            P, T = len(x), len(x) + len(y)
            clean = torch.tensor(list(x) + list(y), dtype=torch.long, device=dev)
            masked = torch.zeros(T, dtype=torch.bool, device=dev)
            masked[P:] = noise.response_masks[n][s].to(dev)
            b0, bl = spans[s]
            for b in range(b0, bl + 1):
                end = min((b + 1) * B, T)
                ids = clean[:end].clone()
                blk = torch.zeros(end, dtype=torch.bool, device=dev)
                blk[b * B:] = True
                sel = masked[:end] & blk
                ids[sel] = mask_id
                hidden = model(ids, BlockDiffusionAttention.from_lengths([end], B, dev)).hidden
                at = sel.nonzero().squeeze(-1)
                out[s, b - b0] += w * float(_logp(model, hidden[at], clean[at]).sum()) if len(at) else 0.0
    valid = torch.tensor([[u <= bl - b0 for u in range(U)] for b0, bl in spans], device=dev)
    return out, valid


def mean_field_logprobs(model, prompts, responses, noise: Noise):
    """d1's one-step estimate → (log p [S, Lmax], valid [S, Lmax]): the response all masked, the
    prompt masked by ``noise.prompt_masks``, one forward, block-causal mask."""
    from arbor.dllm.sft import PaddedBlockAttention
    dev, B, mask_id = model.device, model.config.block_size, model.config.mask_token_id
    ids, rows, targets, units, offset = [], [], [], [], 0
    Lmax = max(len(y) for y in responses)
    for s, (x, y) in enumerate(zip(prompts, responses)):
        xp = torch.tensor(x, dtype=torch.long)
        xp[noise.prompt_masks[s]] = mask_id
        ids.append(torch.cat([xp, torch.full((len(y),), mask_id, dtype=torch.long)]))
        rows.append(offset + len(x) + torch.arange(len(y)))
        targets.append(torch.tensor(y, dtype=torch.long))
        units.append(s * Lmax + torch.arange(len(y)))
        offset += len(ids[-1])
    attn = PaddedBlockAttention([len(i) for i in ids], B, dev)
    hidden = model(torch.cat(ids).to(dev), attn).hidden
    rows, targets, units = (torch.cat(v).to(dev) for v in (rows, targets, units))
    lp = _logp(model, hidden[rows], targets)
    out = torch.zeros(len(prompts) * Lmax, dtype=lp.dtype, device=dev).index_add(0, units, lp)
    valid = torch.tensor([[i < len(y) for i in range(Lmax)] for y in responses], device=dev)
    return out.view(len(prompts), Lmax), valid


def unit_logprobs(model, prompts, responses, noise: Noise, estimator: str = "ebpo"):
    """The estimator's log-likelihood units → (logp [S, U], valid [S, U]): the sequence ELBO Σ_b ELBO_b
    (``ebpo``, U = 1), the block ELBOs (``ebpo_block``), the sequence ELBO ÷ L (``espo``, U = 1), the
    per-token log p (``mean_field``, U = longest response)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if estimator == "mean_field":
        return mean_field_logprobs(model, prompts, responses, noise)
    elbo, valid = elbo_blocks(model, prompts, responses, noise)
    if estimator == "ebpo_block":
        return elbo, valid
    seq = elbo.sum(1, keepdim=True)                        # invalid blocks hold exact zeros
    if estimator == "espo":
        seq = seq / torch.tensor([[max(1, len(y))] for y in responses], dtype=seq.dtype, device=seq.device)
    return seq, torch.ones_like(seq, dtype=torch.bool)


def ebpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor,
              cfg: LossConfig, num_seqs: int | None = None):
    """The clipped surrogate over units (module docstring) → (loss, stats of ``policy_loss``).
    logp, logp_old, valid [S, U]; advantages [S]; ``num_seqs``: samples the mean is over (default S)."""
    S, U = logp.shape
    seq = torch.arange(S, device=logp.device)[:, None].expand(S, U)[valid]
    lp, old = logp[valid], logp_old.detach()[valid]
    adv = advantages.to(logp.device, lp.dtype)[seq]
    cfg = replace(cfg, correction="none", kl_coef=0.0, agg="sequence")     # a unit is not a token
    return policy_loss(lp, old, old, adv, torch.ones_like(lp), seq, num_seqs or S, cfg)
