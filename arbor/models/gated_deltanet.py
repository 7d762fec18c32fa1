"""Gated DeltaNet, the linear-attention layer of Qwen3-Next, in pure PyTorch.

Computes the same function as transformers' ``Qwen3NextGatedDeltaNet`` (to float rounding), on packed
variable-length sequences with explicit per-sequence state.

The gated delta rule, per value head, with state S_t ∈ R^{dk×dv} (S_0 = initial state):

    S'_t = exp(g_t) · S_{t-1}                      gated decay, g_t ≤ 0
    u_t  = β_t · (v_t − S'_tᵀ k_t)                 delta-rule correction ∈ R^dv
    S_t  = S'_t + k_t u_tᵀ
    o_t  = scale · S_tᵀ q_t,   scale = dk^-½

i.e. S_t = exp(g_t) S_{t-1} + β_t k_t (v_t − exp(g_t) S_{t-1}ᵀ k_t)ᵀ. q_t and k_t are
L2-normalised by the layer (x / sqrt(Σx² + 1e-6)), and each key head serves
num_v_heads / num_k_heads consecutive value heads. The rule runs in float32 (float64 for
float64 inputs); the recurrent state is kept in that dtype.

Invariants: a token with β = 0 and g = 0 leaves S unchanged, which is what makes
zero-padding at the end of a sequence harmless. The short causal convolution in front of
the rule needs the previous K−1 inputs of each sequence, carried in ``LinearState.conv``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.layers import Linear


@dataclass
class LinearState:
    """Per-sequence state of one Gated DeltaNet layer after some prefix of tokens.

    conv:      [N, conv_dim, K-1]  the last K-1 conv inputs of each sequence (zeros before the
               start), in the activation dtype; channels ordered [q heads, k heads, v heads]
    recurrent: [N, num_v_heads, head_k_dim, head_v_dim]  S_t, float32 (float64 for float64 models)
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


def _rule_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check_rule_shapes(q, k, v, g, beta, initial_state) -> None:
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    if T == 0:
        raise ValueError("the gated delta rule needs at least one token (T = 0)")
    expected = {"k": (k, (B, T, H, dk)), "v": (v, (B, T, H, dv)), "g": (g, (B, T, H)), "beta": (beta, (B, T, H))}
    if initial_state is not None:
        expected["initial_state"] = (initial_state, (B, H, dk, dv))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} given q {tuple(q.shape)}, got {tuple(tensor.shape)}")


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """Token-by-token gated delta rule (reference and decode form).

    q, k: [B, T, H, dk] (L2-normalised, one head per value head), v: [B, T, H, dv],
    g: [B, T, H] log decay ≤ 0, beta: [B, T, H], initial_state: [B, H, dk, dv] or None (zeros).
    Returns out [B, T, H, dv] (dtype of v) and the final state [B, H, dk, dv] (float32/64).
    """
    _check_rule_shapes(q, k, v, g, beta, initial_state)
    B, T, H, dk = q.shape
    dtype, out_dtype = _rule_dtype(q), v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q * dk**-0.5
    S = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(T):
        S = S * g[:, t, :, None, None].exp()
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    out = torch.stack(outs, 1)
    return out.to(out_dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size=64):
    """Chunkwise-parallel gated delta rule; same arguments and results as the recurrent form.

    The sequence is cut into chunks of C = chunk_size tokens (the last one zero-padded, which
    leaves the state unchanged). Within a chunk, with γ_i = Σ_{j≤i} g_j the cumulative log
    decay from the chunk start, S the state entering the chunk, and rows of Q, K, V the tokens:

        D_ij = exp(γ_i − γ_j) for j ≤ i, else 0                    pairwise decay
        A_ij = β_i D_ij k_i·k_j for j < i, else 0                  strictly lower triangular
        U    = (I + A)⁻¹ (diag(β) V − diag(β e^γ) K S)             rows are the u_t of the chunk
        O    = scale · (diag(e^γ) Q S + (D ⊙ Q Kᵀ) U)
        S   ← e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ U

    (I + A)⁻¹ is applied by one unit-lower-triangular solve per chunk, so the only Python
    loop is over chunks. Differentiable w.r.t. all inputs including initial_state.
    """
    _check_rule_shapes(q, k, v, g, beta, initial_state)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    dtype, out_dtype = _rule_dtype(q), v.dtype
    pad = -T % chunk_size

    def chunks(x):  # [B, T, H, d] -> [B, H, n, C, d], zero-padded at the end
        x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
        return x.reshape(B, -1, chunk_size, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v = chunks(q) * dk**-0.5, chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])  # [B,H,n,C], [B,H,n,C,1]
    gamma = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    D = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta
    A = (k_beta @ k.transpose(-1, -2)) * D  # the diagonal is ignored by the unit-triangular solve
    rhs = torch.cat([v * beta, k_beta * gamma[..., None].exp()], -1)
    W, Y = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    QK = (q @ k.transpose(-1, -2)) * D
    q_read = q * gamma[..., None].exp()
    k_write = k * (gamma[..., -1:] - gamma)[..., None].exp()
    chunk_decay = gamma[..., -1, None, None].exp()

    S = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.to(dtype)
    outs = []
    for i in range(q.shape[2]):
        U = W[:, :, i] - Y[:, :, i] @ S
        outs.append(q_read[:, :, i] @ S + QK[:, :, i] @ U)
        S = S * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ U
    out = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, -1, H, dv)[:, :T]
    return out.to(out_dtype), S


def causal_conv1d(x, weight, conv_state=None, lengths=None):
    """Depthwise causal convolution followed by SiLU, continuing from a conv state.

    x: [B, C, T], weight: [C, K], conv_state: [B, C, K-1] the K-1 inputs before x (None = zeros).
    y[b, c, t] = silu(Σ_j weight[c, j] · x̃[b, c, t + j]) with x̃ = concat(conv_state, x) along time.
    Returns y [B, C, T] and the new state: the last K-1 entries of x̃, or, when x is right-padded
    and lengths [B] gives each row's valid length, the last K-1 entries of x̃ before that length.
    """
    B, C, T = x.shape
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, C, K - 1)
    elif tuple(conv_state.shape) != (B, C, K - 1):
        raise ValueError(f"conv_state must have shape {(B, C, K - 1)}, got {tuple(conv_state.shape)}")
    xx = torch.cat([conv_state.to(x.dtype), x], -1)
    y = F.silu(F.conv1d(xx, weight.to(x.dtype)[:, None], groups=C))
    if lengths is None:
        return y, xx[..., T:]
    index = lengths[:, None] + torch.arange(K - 1, device=x.device)
    return y, xx.gather(-1, index[:, None, :].expand(B, C, K - 1))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (the FLA / HF convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """y = weight · x / sqrt(mean(x²) + eps) · silu(z), normalised in float32 (float64 for float64; HF Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.to(_rule_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(z.to(h.dtype))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next linear-attention layer on packed sequences with explicit state.

    x → in_proj_qkvz, in_proj_ba → (q, k, v) → causal conv + SiLU → L2-norm q, k →
    gated delta rule with β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias) →
    GatedRMSNorm(o, z) → out_proj. Parameter names and shapes match HF, so checkpoints load
    by name. Initialisation follows HF: dt_bias = 1, A_log = log U(0.01, 16).
    """

    def __init__(self, hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel, eps, chunk_size=64):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.hidden_size, self.chunk_size = hidden_size, chunk_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)

    def _project(self, x):
        """Split the projections in HF's per-key-head interleaved layout.

        in_proj_qkvz rows, per key head: [q (dk), k (dk), v (r·dv), z (r·dv)]; in_proj_ba rows,
        per key head: [b (r), a (r)]; r = num_v_heads / num_k_heads value heads per key head.
        """
        T, Hk, r = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(T, Hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], -1)
        b, a = self.in_proj_ba(x).view(T, Hk, 2 * r).split([r, r], -1)
        return q, k, v.reshape(T, -1, dv), z.reshape(T, -1, dv), b.reshape(T, -1), a.reshape(T, -1)

    def _check(self, x, cu_seqlens, state):
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != x.shape[0]:
            raise ValueError(f"cu_seqlens must run from 0 to len(x) = {x.shape[0]}, got {cu[0]}..{cu[-1]}")
        lengths = [e - s for s, e in zip(cu, cu[1:])]
        if min(lengths) < 1:
            raise ValueError(f"every sequence needs at least one token, cu_seqlens = {cu}")
        if state is not None:
            N = len(lengths)
            for name, shape in [("conv", (N, self.conv_dim, self.conv_kernel - 1)),
                                ("recurrent", (N, self.num_v_heads, self.head_k_dim, self.head_v_dim))]:
                if tuple(getattr(state, name).shape) != shape:
                    raise ValueError(f"state.{name} must have shape {shape} for {N} sequences, "
                                     f"got {tuple(getattr(state, name).shape)}")
        return max(lengths)

    def conv_inputs(self, x: torch.Tensor):
        """x [T, hidden] → (mixed [T, conv_dim]: the conv's inputs, channels [q heads, k heads, v heads];
        z [T, Hv, dv]; b, a [T, Hv]): every projection of the layer's input, one row per token."""
        q, k, v, z, b, a = self._project(x)
        return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], -1), z, b, a

    def rule_inputs(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Conv outputs [T, conv_dim] and b, a → the rule's per-token (q, k, v, g, β): q, k L2-normalised
        (one head per value head), β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias)."""
        T, dtype, r = mixed.shape[0], _rule_dtype(mixed), self.num_v_heads // self.num_k_heads
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = (l2norm(t.to(dtype).view(T, self.num_k_heads, -1)).repeat_interleave(r, 1) for t in (q, k))
        g = -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias)
        return q, k, v.reshape(T, self.num_v_heads, self.head_v_dim), g, b.sigmoid()

    def rule(self, q, k, v, g, beta, cu_seqlens: torch.Tensor, initial_state=None):
        """The gated delta rule over packed sequences (rows cu_seqlens[i]:cu_seqlens[i+1]) from their
        initial recurrent states (None = zeros) → (o [T, Hv, dv], S [N, Hv, dk, dv]). One token per
        sequence: the recurrent form; otherwise right-padded with β = g = 0 (state-preserving) and the
        chunk form, its grid starting at each sequence start."""
        pad, unpad, decode, _ = _packing(cu_seqlens.to(q.device), q.shape[0])
        if decode:
            o, S = recurrent_gated_delta_rule(*map(pad, (q, k, v, g, beta)), initial_state)
        else:
            o, S = chunk_gated_delta_rule(*map(pad, (q, k, v, g, beta)), initial_state, self.chunk_size)
        return unpad(o), S

    def output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rule outputs o [T, Hv, dv] and gates z → y [T, hidden] = out_proj(GatedRMSNorm(o, z))."""
        return self.out_proj(self.norm(o.to(dtype), z).flatten(1))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, state: LinearState | None = None):
        """x: [T, hidden] packed tokens; sequence i is x[cu_seqlens[i]:cu_seqlens[i+1]], each ≥ 1 token.

        state: each sequence's state before these tokens (None = zeros). Returns y [T, hidden]
        and the state after each sequence's last token (``rule`` says which form runs).
        """
        self._check(x, cu_seqlens, state)
        cu_seqlens = cu_seqlens.to(x.device)
        pad, unpad, decode, lengths = _packing(cu_seqlens, x.shape[0])
        mixed, z, b, a = self.conv_inputs(x)
        mixed, conv_state = causal_conv1d(pad(mixed).transpose(1, 2), self.conv1d.weight[:, 0],
                                          None if state is None else state.conv, None if decode else lengths)
        q, k, v, g, beta = self.rule_inputs(unpad(mixed.transpose(1, 2)), b, a)
        o, S = self.rule(q, k, v, g, beta, cu_seqlens, None if state is None else state.recurrent)
        return self.output(o, z, x.dtype), LinearState(conv_state, S)


def _packing(cu_seqlens: torch.Tensor, T: int):
    """→ (pad: [T, ...] → [N, L, ...] right-padded with zeros, unpad: its inverse, decode: every
    sequence one token (then pad is [T, 1, ...]), lengths [N])."""
    N = cu_seqlens.numel() - 1
    lengths = cu_seqlens.diff()
    decode = T == N
    if decode:
        return (lambda t: t[:, None]), (lambda t: t[:, 0]), True, lengths
    L = int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(N, device=cu_seqlens.device), lengths, output_size=T)
    pos = torch.arange(T, device=cu_seqlens.device) - cu_seqlens[seq]
    return (lambda t: t.new_zeros(N, L, *t.shape[1:]).index_put((seq, pos), t)), (lambda t: t[seq, pos]), False, lengths
