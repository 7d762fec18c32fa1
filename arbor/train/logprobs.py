"""Per-token log-probs of packed sequences under the trainer's model.

For a packed call over sequences s (tokens x_0..x_{L-1} each), the result is flat [T] aligned
with the tokens: entry t holds log π(x_t | x_<t) for t ≥ 1 and 0 at each sequence's first
token (which has no prediction). Log-softmax runs in float32 (float64 for a float64 model) in row
chunks, so a [T, V] float32 tensor never exists whole for a large vocabulary.

``spec`` (``arbor.models.sampling.SamplingSpec``) gives the log-probs of the distribution the
rollout sampled from (logits / T, truncated as the engine truncated); None is the model's own
distribution. ``entropy``: a list that receives the per-token entropy of that distribution (no
gradient, for metrics) — per chunk from ``gather_logprobs``; ``packed_logprobs`` leaves one tensor
in it aligned with its log-probs (the entropy of the distribution each token was drawn from).

The head. Where ``model.logits`` is a plain ``lm_head`` (``CausalLM.logits``: an ``nn.Linear``
without bias, tied to the embedding or not — not a ``LoRALinear``) and ``spec`` is at most a
temperature, ``LogprobHead`` computes the log-probs and their gradients chunk by chunk and keeps
O(T) for the backward, not the [T, V] log-softmax and logits autograd would keep (2.5–2.8 GiB of
peak RSS at Qwen3-0.6B's shape and 2048 tokens, ``arbor bench train-memory``); anything else
(top-k / top-p / min-p, a LoRA or biased head, another ``logits``) runs the plain chunked path.
Both give the same values and gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from arbor.kernels import fp32_gemm
from arbor.models import CausalLM, VarlenAttention
from arbor.models.layers import Linear
from arbor.models.sampling import SamplingSpec
from arbor.train.losses import router_aux_loss

CHUNK_BYTES = 256 << 20    # the fused head's float32 [rows, V] per chunk: 441 rows at V = 151,936


class LogprobHead(torch.autograd.Function):
    """logp_i = z_i[y_i] − logsumexp(z_i) with z_i = (W h_i) / t, the matmul in the compute dtype c (the
    autocast dtype, else W's; float64 is never autocast) and z in float32 (float64 for a float64 model) —
    what ``spec.logprobs(lm_head(h))`` gathers. Its gradient, with G = (g ⊙ (onehot(y) − softmax(z))) / t
    (∂logp_i / ∂z_i = onehot(y_i) − softmax(z_i)) rounded to c:

        ∂h = G W,   ∂W = Gᵀ h   (∂W only when W requires grad)

    Invariant: nothing [T, V] is saved, and beyond the saved tensors the head holds the buffers of one chunk
    of ``rows`` · V logits. ``eager`` (W frozen, h requires grad — LoRA): the forward, in chunks of rows, forms
    D_i = (onehot(y_i) − softmax(z_i)) W / t (G at g = 1) and saves D [T, D] alone; backward is ∂h = g ⊙ D.
    Else saved are h [T, D], W (the parameter itself, no copy), y [T] and logsumexp(z) [T]; backward
    recomputes z in chunks of the vocabulary (softmax from the saved logsumexp), so each row of ∂W is
    written once — one matmul more than autograd's path. A tied W (the embedding's) gets ∂W added to the
    embedding's gradient by autograd."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, rows: int, dtype, entropy, eager: bool):
        with torch.autocast(hidden.device.type, enabled=False):
            w, wide = weight.to(dtype), torch.promote_types(dtype, torch.float32)
            out = hidden.new_empty(hidden.shape[0], dtype=wide)
            lse, d = torch.empty_like(out), torch.empty_like(hidden) if eager else None
            for s in range(0, hidden.shape[0], rows):
                y = targets[s:s + rows]
                z = _scaled_logits(hidden[s:s + rows].to(dtype), w, wide, temperature)
                out[s:s + rows] = z.gather(1, y[:, None])[:, 0]
                top = z.amax(-1, keepdim=True)
                shifted = z.sub_(top)                                            # z − max z
                p = shifted.exp() if entropy is not None else shifted.exp_()
                total = p.sum(-1, keepdim=True)
                lse[s:s + rows] = (top + total.log())[:, 0]
                out[s:s + rows] -= lse[s:s + rows]
                if entropy is None and not eager:
                    continue
                p.div_(total)                                                    # softmax(z)
                if entropy is not None:
                    logp = shifted.sub_(total.log())
                    entropy.append(-(p * logp.masked_fill(p == 0, 0.0)).sum(-1))
                if eager:
                    at = torch.arange(len(y), device=y.device)
                    d[s:s + rows] = fp32_gemm.mm(_logit_grad(p, at, y, out.new_ones(len(y)), temperature, dtype), w)
        ctx.save_for_backward(*((d,) if eager else (hidden, weight, targets, lse)))
        ctx.temperature, ctx.rows, ctx.dtype, ctx.eager = temperature, rows, dtype, eager
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.eager:
            (d,) = ctx.saved_tensors
            return g[:, None].to(d.dtype) * d, None, None, None, None, None, None, None
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        (n, vocab), t, dtype = (hidden.shape[0], weight.shape[0]), ctx.temperature, ctx.dtype
        cols = max(1, ctx.rows * vocab // max(1, n))                 # the forward's chunk of rows · V logits
        with torch.autocast(hidden.device.type, enabled=False):
            h, g, every = hidden.to(dtype), g.to(lse.dtype), torch.arange(n, device=hidden.device)
            gh = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if need_h else None
            gw = torch.empty_like(weight) if need_w else None
            for v in range(0, vocab, cols):
                w = weight[v:v + cols].to(dtype)
                p = _scaled_logits(h, w, lse.dtype, t).sub_(lse[:, None]).exp_()       # softmax(z)[:, v:v+cols]
                hit = (targets >= v) & (targets < v + cols)
                grad = _logit_grad(p, every[hit], targets[hit] - v, g, t, dtype)
                if need_h:
                    gh += fp32_gemm.mm(grad, w)
                if need_w:
                    fp32_gemm.mm_into(gw[v:v + cols], grad.t(), h)
        return gh.to(hidden.dtype) if need_h else None, gw, None, None, None, None, None, None


def _logit_grad(p: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, g: torch.Tensor, temperature: float,
                dtype) -> torch.Tensor:
    """G = g ⊙ (onehot − p) / t in ``dtype`` (``LogprobHead``) with the one-hot entries at (rows, cols) and g [N]
    per row of p; overwrites ``p``."""
    grad = p.mul_(-g[:, None])
    grad.index_put_((rows, cols), g[rows], accumulate=True)
    return (grad.div_(temperature) if temperature != 1.0 else grad).to(dtype)


def _scaled_logits(h: torch.Tensor, w: torch.Tensor, wide: torch.dtype, temperature: float) -> torch.Tensor:
    z = fp32_gemm.mm(h, w.t()).to(wide)
    return z / temperature if temperature != 1.0 else z


def fused_temperature(model, spec) -> float | None:
    """The temperature ``LogprobHead`` applies for ``model`` and ``spec``, or None where it would not compute
    ``spec.logprobs(model.logits(h))`` exactly (module docstring) and the plain path must run."""
    head = getattr(model, "lm_head", None)
    plain_logits = getattr(getattr(model, "logits", None), "__func__", None) is CausalLM.logits
    if not plain_logits or type(head) not in (nn.Linear, Linear) or head.bias is not None:
        return None
    if spec is None:
        return 1.0
    if not isinstance(spec, SamplingSpec) or spec.top_k > 0 or spec.top_p < 1 or spec.min_p > 0:
        return None
    return float(spec.temperature) if spec.temperature > 0 else 1.0     # ≤ 0: greedy, the model's own


def head_bytes(rows: int, vocab: int, hidden: int, dtype: torch.dtype, fused: bool = True) -> int:
    """Peak bytes of ``gather_logprobs`` over ``rows`` rows, beyond the weights and their gradient (for the
    memory plan, ``arbor.train.memory_plan``). Fused (``LogprobHead``): one chunk of r = min(rows,
    CHUNK_BYTES / 4V) rows of float32 logits plus their softmax and its compute-dtype copy, r · V · (4 + 2a),
    and the O(T) saved tensors, 4 · rows · hidden (a: the compute dtype's bytes). Plain path: the [rows, V]
    logits (a), their float32 copy when a < 4, the float32 log-softmax autograd saves, and in backward its
    gradient and the logits' (4 each)."""
    a = torch.finfo(dtype).bits // 8
    if fused:
        r = min(rows, max(1, CHUNK_BYTES // (4 * vocab)))
        return r * vocab * (4 + 2 * a) + 4 * rows * hidden
    return rows * vocab * (a + (4 if a < 4 else 0) + 12)


def gather_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 4096, spec=None,
                    entropy: list | None = None) -> torch.Tensor:
    """log π(targets_i | hidden_i) for every row i, in float32 (π: see module docstring); by ``LogprobHead``
    where it applies (chunks of ≤ ``chunk`` rows and ≤ ``CHUNK_BYTES`` of float32 logits), else plainly."""
    temperature = fused_temperature(model, spec)
    if temperature is not None and hidden.shape[0] > 0:
        weight = model.lm_head.weight
        dev = hidden.device.type
        autocast = weight.dtype != torch.float64 and torch.is_autocast_enabled(dev)
        dtype = torch.get_autocast_dtype(dev) if autocast else weight.dtype
        rows = max(1, min(chunk, CHUNK_BYTES // (4 * weight.shape[0])))
        eager = torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
        return LogprobHead.apply(hidden, weight, targets, temperature, rows, dtype, entropy, eager)
    out = []
    for s in range(0, hidden.shape[0], chunk):
        logits = model.logits(hidden[s:s + chunk])
        wide = torch.promote_types(logits.dtype, torch.float32)          # float64 for a float64 model
        logp = spec.logprobs(logits) if spec is not None else logits.to(wide).log_softmax(-1)
        out.append(logp.gather(1, targets[s:s + chunk, None])[:, 0])
        if entropy is not None:
            with torch.no_grad():
                p = logp.exp()
                entropy.append(-(p * logp.masked_fill(p == 0, 0.0)).sum(-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def packed_logprobs(model, seqs: list[list[int]], device=None, routed_experts=None, with_aux: bool = False,
                    spec=None, entropy: list | None = None):
    """→ (logp [T] float32, cu_seqlens [N+1]) for the sequences packed in order, and with
    ``with_aux`` the MoE load-balancing loss (``losses.router_aux_loss``) over their tokens."""
    device = device or model.device
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    attn = VarlenAttention.from_lengths([len(s) for s in seqs], device=device)
    out = model(ids, attn, routed_experts=routed_experts, return_router_probs=with_aux)
    hidden = out.hidden
    # predict token t+1 from position t; the first token of each sequence gets 0
    starts = attn.cu_seqlens[:-1]
    nxt = torch.roll(ids, -1)
    logp_next = gather_logprobs(model, hidden, nxt, spec=spec, entropy=entropy)
    logp = torch.roll(logp_next, 1)
    logp[starts] = 0.0
    if entropy is not None:
        ent = torch.roll(torch.cat(entropy), 1)
        ent[starts] = 0.0
        entropy[:] = [ent]
    if with_aux:
        return logp, attn.cu_seqlens, router_aux_loss(out.router_probs, out.routed_experts)
    return logp, attn.cu_seqlens
