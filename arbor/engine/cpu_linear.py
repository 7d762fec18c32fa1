"""Linear layers with oneDNN pre-packed weights, for the engine on CPU.

``pack_linears(model, fp32)`` gives a bfloat16 CPU model (and a float32 one when ``fp32``) packed
compute copies of its linear weights, in oneDNN's blocked layout (no per-call re-layout of the
weight):

- q/k/v projections of each attention layer, and gate/up of each SwiGLU MLP, become one fused
  GEMM each (``FusedLinear`` on the module's ``fused_qkv`` / ``fused_gate_up``; the outputs
  are split back);
- every other ``nn.Linear`` becomes a ``PackedLinear``: the same object and ``weight``
  parameter, plus a non-persistent packed buffer;
- every MoE ``Experts`` module becomes a ``PackedExperts``: in bfloat16 where the routed C kernel
  runs (``arbor.kernels.cpu_moe``), its weights packed for that kernel, which serves every
  inference call; otherwise each expert's gate/up and down matrices kept packed for oneDNN (training
  keeps the parameters).

Every attention and MLP module of a packed copy is marked ``engine_owned``: its float32 forwards
may then run the fused element-wise C ops too (``arbor.kernels.cpu_ops``; last-bit differences).
State-dict names and ``update_weights`` are unchanged; the parameters stay the source of truth
and ``repack(model)`` refreshes every packed copy after they change in place. In bfloat16 the
outputs are bit-identical to ``F.linear`` (same dot products, column by column). In float32
``F.linear`` is MKL's GEMM and oneDNN's sums in another order (last-bit differences). Costs one
more copy of the linear weights; saves the per-call re-layout of each weight. Where PyTorch lacks
oneDNN, or its packed bfloat16 GEMM would not match ``F.linear`` exactly on this CPU, nothing is
packed.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from arbor.kernels import cpu_moe
from arbor.models.attention import SoftmaxAttention
from arbor.models.layers import MLP, silu_mul
from arbor.models.moe import Experts

_OPS = ("_reorder_linear_weight", "_linear_pointwise")
BATCH_HINT = 16   # oneDNN picks its blocking for this many rows (a decode batch); any row count works
DENSE_MAX_TOKENS = 16   # without the routed kernel, PackedExperts.dense serves MoE steps of at most this many tokens


@cache
def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN's packed linear exists here and gives what ``F.linear`` gives: exactly in bfloat16
    (on CPUs without native bfloat16 the two may take different GEMMs; then nothing is packed),
    up to summation order in float32."""
    if not (torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in _OPS)):
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen).to(dtype)
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    try:
        packed = _pack(w)
        return all(same(_linear(x, packed, None), F.linear(x, w))
                   for x in (torch.randn(n, 64, generator=gen).to(dtype) for n in (1, 5, 16, 40)))
    except RuntimeError:
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def _linear(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    def repack(self) -> None:
        self.register_buffer("packed_weight", _pack(self.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed_weight, self.bias)


class FusedLinear:
    """Several linears over the same input as one packed GEMM; → their outputs, split. Not a
    module: the source linears keep the parameters."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.repack()

    def repack(self) -> None:
        self.packed = _pack(torch.cat([m.weight for m in self.linears]))
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([m.bias.detach() for m in self.linears]) if has_bias else None

    def __call__(self, x: torch.Tensor):
        return _linear(x, self.packed, self.bias).split(self.sizes, -1)


class PackedExperts(Experts):
    """Experts with packed copies for inference (``serve``; under autograd: the parameters):
    - bfloat16 with the routed kernel (``cpu_moe``): every call, each token through its k experts
      only (k of E experts' FLOPs per token, one call);
    - otherwise oneDNN: all experts as two GEMMs (``dense``) for steps of at most
      ``DENSE_MAX_TOKENS`` tokens, one packed GEMM pair per expert (``grouped``) above."""

    def repack(self) -> None:
        gate_up, down = self.gate_up_proj, self.down_proj
        self.routed = None
        if gate_up.dtype == torch.bfloat16 and cpu_moe.supports(gate_up.shape[2], down.shape[2]):
            self.routed = (cpu_moe.pack_vnni(gate_up), cpu_moe.pack_vnni(down))
            self.packed = self.packed_all = None
            return
        self.packed = [(_pack(gu), _pack(d)) for gu, d in zip(gate_up.unbind(0), down.unbind(0))]
        e, i2, d = gate_up.shape
        self.packed_all = (_pack(gate_up.reshape(e * i2, d)), _pack(down.permute(1, 0, 2).reshape(d, e * i2 // 2)))

    def serve(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """``dispatch_experts(x, ids, weights, self)`` by the fastest packed path, or None (under
        autograd, or many tokens without the routed kernel: ``grouped`` then serves)."""
        if torch.is_grad_enabled():
            return None
        if self.routed is not None:
            return cpu_moe.routed_experts(x, ids, weights, *self.routed)
        return self.dense(x, ids, weights) if x.shape[0] <= DENSE_MAX_TOKENS else None

    def route_and_serve(self, x: torch.Tensor, gate: nn.Module, top_k: int, norm_topk_prob: bool):
        """``MoE.route`` + ``dispatch_experts`` with the routed kernel doing the router's softmax and
        top-k too (one call after the router GEMM instead of six small ops): → (y, ids, probs), or None
        under autograd or without the routed kernel."""
        if torch.is_grad_enabled() or self.routed is None or x.dtype != torch.bfloat16:
            return None
        return cpu_moe.route_and_run(x, gate(x), top_k, norm_topk_prob, *self.routed)

    def dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``dispatch_experts`` for a few tokens as two GEMMs over every expert:
        ``h = silu(x G_eᵀ) · (x U_eᵀ)`` for all e at once, ``y = [w_e · h_e]_e · [D_e]_eᵀ`` with
        w_e the token's routing weight for e (0 where not routed) — Σ_j w_j · E_{ids_j}(x) by
        linearity, in another summation order. A decode step of T tokens otherwise runs ~2 small
        GEMMs per touched expert plus sorting and scattering, each call dominated by its overhead;
        the dense pair computes E / k times the FLOPs of the routed rows, and is used while
        T ≤ ``DENSE_MAX_TOKENS``, where those FLOPs cost less than the per-expert calls they replace."""
        t = x.shape[0]
        gate_up, down = self.packed_all
        e, i = self.num_experts, self.down_proj.shape[2]
        gu = _linear(x, gate_up, None).view(t, e, 2 * i)
        h = silu_mul(gu[..., :i].reshape(t * e, i), gu[..., i:].reshape(t * e, i), engine_owned=True).view(t, e, i)
        w = torch.zeros(t, e, dtype=x.dtype).scatter_(1, ids, weights.to(x.dtype))
        return _linear((h * w[..., None]).view(t, e * i), down, None)

    def grouped(self, xs: list[torch.Tensor]) -> torch.Tensor | None:
        """``Experts.grouped`` through the packed copies (under autograd, or with the routed
        kernel's packing only: the parameters)."""
        if torch.is_grad_enabled() or self.packed is None:
            return super().grouped(xs)
        out = []
        for (gate_up, down), x in zip(self.packed, xs):
            if x.shape[0]:
                gate, up = _linear(x, gate_up, None).chunk(2, dim=-1)
                out.append(_linear(silu_mul(gate, up, engine_owned=True), down, None))
        return torch.cat(out) if out else None


def _fusable(linears) -> bool:
    return len({m.bias is None for m in linears}) == 1


def pack_linears(model: nn.Module, fp32: bool = False) -> int:
    """Pack a bfloat16 (or, with ``fp32``, float32) CPU model's linears in place; → how many
    linears (0 when not applicable)."""
    dtypes = (torch.bfloat16, torch.float32) if fp32 else (torch.bfloat16,)
    if model.dtype not in dtypes or model.device.type != "cpu" or not available(model.dtype):
        return 0
    fused = set()
    for m in model.modules():
        if isinstance(m, (SoftmaxAttention, MLP)):
            m.engine_owned = True          # the fused element-wise C ops may serve float32 too (cpu_ops)
        if isinstance(m, SoftmaxAttention) and _fusable(group := [m.q_proj, m.k_proj, m.v_proj]):
            m.fused_qkv = FusedLinear(group)
        elif isinstance(m, MLP) and _fusable(group := [m.gate_proj, m.up_proj]):
            m.fused_gate_up = FusedLinear(group)
        else:
            continue
        fused.update(map(id, group))
    rest = [m for m in model.modules() if type(m) is nn.Linear and id(m) not in fused]
    for m in rest:
        m.__class__ = PackedLinear
        m.repack()
    experts = [m for m in model.modules() if type(m) is Experts]
    for m in experts:
        m.__class__ = PackedExperts
        m.repack()
    return len(rest) + len(fused) + sum(2 * m.gate_up_proj.shape[0] for m in experts)


def repack(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedExperts)):
            m.repack()
        for f in (getattr(m, "fused_qkv", None), getattr(m, "fused_gate_up", None)):
            if f is not None:
                f.repack()
