"""Linear layers with oneDNN pre-packed weights, for the engine on CPU.

``pack_linears(model, fp32)`` gives a bfloat16 CPU model (and a float32 one when ``fp32``) packed
compute copies of its linear weights, in oneDNN's blocked layout (no per-call re-layout of the
weight):

- q/k/v projections of each attention layer, and gate/up of each SwiGLU MLP, become one fused
  GEMM each (``FusedLinear`` on the module's ``fused_qkv`` / ``fused_gate_up``; the outputs
  are split back);
- every other ``nn.Linear`` becomes a ``PackedLinear``: the same object and ``weight``
  parameter, plus a non-persistent packed buffer;
- every MoE ``Experts`` module becomes a ``PackedExperts``: its weights packed for the paths a step
  may take — the routed C kernel (bfloat16, ``arbor.kernels.cpu_moe``), per-expert oneDNN GEMMs over
  the routed rows (bfloat16; float32 runs ``torch._grouped_mm`` on the parameters), all experts as two
  dense GEMMs — and each step served by the path a measured cost model (``step_costs``) finds
  cheapest (training keeps the parameters).

Every attention, MLP and RMSNorm module of a packed copy is marked ``engine_owned``: its float32 forwards
may then run the fused element-wise C ops too (``arbor.kernels.cpu_ops``; last-bit differences); its
rotary embedding reads cos/sin from a table (``Rotary.table``).
Steps of at most ``cpu_small_linear.MAX_ROWS`` rows (decoding) run the packed and fused linears
through the few-row C kernel instead, where ``small_linear_serves`` says it is the faster one (its own
packed copy; ``arbor.kernels.cpu_small_linear``).

State-dict names and ``update_weights`` are unchanged; the parameters stay the source of truth
and ``repack(model)`` refreshes every packed copy after they change in place. In bfloat16 oneDNN's
outputs are bit-identical to ``F.linear`` (same dot products, column by column); the few-row kernel
sums each column in k order (one bfloat16 step apart near a rounding boundary). In float32
``F.linear`` is MKL's GEMM and oneDNN's sums in another order (last-bit differences). Costs one
more copy of the linear weights (two with the few-row kernel); saves the per-call re-layout of each
weight. Where PyTorch lacks oneDNN, or its packed bfloat16 GEMM would not match ``F.linear`` exactly
on this CPU, nothing is packed.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from arbor.kernels import cpu_moe, cpu_small_linear
from arbor.models.attention import SoftmaxAttention
from arbor.models.layers import MLP, Linear, RMSNorm, Rotary, silu_mul
from arbor.models.moe import MoE, Experts

_OPS = ("_reorder_linear_weight", "_linear_pointwise")
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
BATCH_HINT = 16   # oneDNN picks its blocking for this many rows (a decode batch); any row count works


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


def small_linear_serves(dtype: torch.dtype) -> bool:
    """Decode-sized steps (≤ ``cpu_small_linear.MAX_ROWS`` rows) of this dtype run the few-row C kernel:
    wherever it builds, except bfloat16 on CPUs with AMX, whose tiles serve oneDNN's GEMM (not
    measured against the kernel there). ``arbor bench engine --shape 0.6b`` measures the choice."""
    return cpu_small_linear.supports(dtype) and not (dtype == torch.bfloat16 and AMX)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def _linear(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack_small(weight: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    """The few-row kernel's copy of ``weight`` where ``wanted`` and it serves (``small_linear_serves``),
    else None."""
    return cpu_small_linear.pack(weight) if wanted and small_linear_serves(weight.dtype) and \
        cpu_small_linear.packable(weight) else None


def _linear_by_rows(x, packed, small, bias):
    """Steps of at most ``cpu_small_linear.MAX_ROWS`` rows through the few-row kernel (when packed for
    it), larger ones through oneDNN."""
    if small is not None and x.numel() <= cpu_small_linear.MAX_ROWS * x.shape[-1]:
        return cpu_small_linear.linear(x, small, bias)
    return _linear(x, packed, bias)


class PackedLinear(nn.Linear):
    few_rows = True   # set by ``pack_linears``: decode-sized steps may take the few-row kernel

    def repack(self) -> None:
        self.register_buffer("packed_weight", _pack(self.weight), persistent=False)
        self.register_buffer("small_weight", _pack_small(self.weight, self.few_rows), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_by_rows(x, self.packed_weight, self.small_weight, self.bias)


class FusedLinear:
    """Several linears over the same input as one packed GEMM; → their outputs, split. Not a
    module: the source linears keep the parameters."""

    def __init__(self, linears: list[nn.Linear], few_rows: bool = True):
        self.linears, self.few_rows = linears, few_rows
        self.sizes = [m.out_features for m in linears]
        self.repack()

    def repack(self) -> None:
        weight = torch.cat([m.weight for m in self.linears])
        self.packed, self.small = _pack(weight), _pack_small(weight, self.few_rows)
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([m.bias.detach() for m in self.linears]) if has_bias else None

    def __call__(self, x: torch.Tensor):
        return _linear_by_rows(x, self.packed, self.small, self.bias).split(self.sizes, -1)


# The MoE step cost model (``step_costs``), fitted to the paths timed by ``arbor bench engine-profile
# --shape moe32|moe64`` (``moe_paths_ms``; hidden 128 and 1024, 8–64 experts, 1–512 tokens, 2 threads) on
# two machines: an Intel Xeon with AMX, where oneDNN's bfloat16 GEMMs run on AMX tiles, and an AMD EPYC
# with AVX-512 BF16 and no AMX, where they run on vdpbf16ps as the routed C kernel does. A path streams
# the weights of the experts it touches and computes its rows, the slower of the two bounds it, plus
# its element-wise work (silu · up, weighting) and a fixed cost per call. Relative figures matter (they
# pick a path).
BANDWIDTH = 50e9                    # bytes/s of expert weights streamed from memory
FLOPS = {"routed": 2.0e11 if AMX else 6.5e11,                 # the routed C kernel (vdpbf16ps)
         "dense": {torch.bfloat16: 2.0e12 if AMX else 8.0e11, torch.float32: 3.0e11},   # oneDNN, one large GEMM
         "grouped": {torch.bfloat16: 7.0e11 if AMX else 4.5e11, torch.float32: 3.0e11}}  # per-expert GEMMs
CALL_S = {torch.bfloat16: 40e-6, torch.float32: 12e-6}   # per expert of the grouped path (oneDNN / _grouped_mm)
ELEMENT_S = 1e-9                    # per element of h (silu · up, weighting) in PyTorch


def step_costs(t: int, k: int, e: int, d: int, i: int, touched: int, dtype: torch.dtype, routed: bool) -> dict:
    """Estimated seconds of one MoE step of t tokens, top-k of e experts (hidden d, intermediate i), of
    which ``touched`` receive a token, by each path: ``dense`` (every expert on every token: t · e rows,
    all e experts' weights, one large GEMM pair), ``grouped`` (each touched expert on its routed rows
    only: t · k rows, a GEMM pair per expert) and, with the kernel, ``routed`` (the same rows and weights
    in one call, at the kernel's lower FLOP rate). The routed-rows / total ratio k / e decides dense
    against the others: dense computes e / k times the FLOPs and streams every expert, which wins only
    where the per-expert calls it saves cost more (few experts, small matrices)."""
    unit, size = 3 * d * i, torch.finfo(dtype).bits // 8

    def cost(experts, rows, flops, call):
        return max(experts * unit * size / BANDWIDTH, 2 * rows * unit / flops) + call

    out = {"dense": cost(e, t * e, FLOPS["dense"][dtype], 25e-6 + t * e * i * ELEMENT_S),
           "grouped": cost(touched, t * k, FLOPS["grouped"][dtype], touched * CALL_S[dtype] + t * k * i * ELEMENT_S)}
    if routed:
        out["routed"] = cost(touched, t * k, FLOPS["routed"], 0)
    return out


STEP_TOKENS = [2 ** n for n in range(13)]     # step sizes (tokens) a path must win at to be packed


def expected_touched(t: int, k: int, e: int) -> int:
    """Experts receiving a token of t, k of e each, under uniform routing: e · (1 − (1 − k/e)^t)."""
    return round(e * (1 - (1 - k / e) ** t))


class PackedExperts(Experts):
    """Experts with packed copies for inference (``serve``; under autograd: the parameters). Each step
    takes the path ``step_costs`` finds cheapest for its token count and routing:
    - ``routed``: bfloat16 with the routed kernel (``cpu_moe``): each token through its k experts only,
      one call (decode-sized steps);
    - ``grouped``: each expert that received tokens on its routed rows, as a GEMM pair:
      ``torch._grouped_mm`` over all experts at once (``grouped_mm``); where PyTorch lacks it, oneDNN
      packed per expert (``serve`` returns None and ``dispatch_experts`` calls ``grouped``);
    - ``dense``: all experts as two GEMMs over every token (few experts and tiny matrices)."""

    top_k = 1   # the MoE's k, set by ``pack_linears``

    def repack(self, every_path: bool = False) -> None:
        """Packs a copy of the weights only for the paths that win at some step size of ``STEP_TOKENS``
        under uniform routing (with skewed routing fewer experts are touched, which favours the routed
        and grouped paths, never dense): a real MoE model keeps one packed copy beside its parameters,
        not three. ``grouped`` needs none where ``torch._grouped_mm`` reads the parameters.
        ``every_path``: pack for every path (tests that force each one)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        e, i2, d = gate_up.shape
        kernel = gate_up.dtype == torch.bfloat16 and cpu_moe.supports(d, i2 // 2)
        self.routed, self.packed_all = kernel, True        # (candidates while the winners are found)
        wins = {"routed", "grouped", "dense"} if every_path else \
            {self.path(t, self.top_k, expected_touched(t, self.top_k, e)) for t in STEP_TOKENS}
        self.routed = (cpu_moe.pack_vnni(gate_up), cpu_moe.pack_vnni(down)) if kernel and "routed" in wins else None
        self.packed = None if self.gmm_ok() or "grouped" not in wins else \
            [(_pack(gu), _pack(d)) for gu, d in zip(gate_up.unbind(0), down.unbind(0))]
        self.packed_all = (_pack(gate_up.reshape(e * i2, d)), _pack(down.permute(1, 0, 2).reshape(d, e * i2 // 2))) \
            if "dense" in wins else None

    def gmm_ok(self) -> bool:
        """The grouped path runs ``torch._grouped_mm`` where PyTorch has it: in float32 faster than
        per-expert oneDNN calls; in bfloat16 within 10 % of them at a fixed routing, and in the engine,
        where every step routes other row counts, much faster (oneDNN builds a kernel per GEMM shape):
        ``arbor bench engine --shape moe32``, mixed256 bf16."""
        return hasattr(torch, "_grouped_mm")

    def path(self, t: int, k: int, touched: int) -> str:
        """The cheapest path by ``step_costs`` among those packed (``grouped`` always runs)."""
        e, i2, d = self.gate_up_proj.shape
        costs = step_costs(t, k, e, d, i2 // 2, touched, self.gate_up_proj.dtype, bool(self.routed))
        if not self.packed_all:
            del costs["dense"]
        return min(costs, key=costs.get)

    def serve(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """``dispatch_experts(x, ids, weights, self)`` by the path ``step_costs`` picks, or None (under
        autograd, or ``grouped`` without ``torch._grouped_mm``: ``dispatch_experts`` then calls ``grouped``)."""
        if torch.is_grad_enabled():
            return None
        touched = int(torch.bincount(ids.reshape(-1), minlength=self.num_experts).count_nonzero())
        path = self.path(x.shape[0], ids.shape[1], touched)
        if path == "routed":
            return cpu_moe.routed_experts(x, ids, weights, *self.routed)
        if path == "dense":
            return self.dense(x, ids, weights)
        return self.grouped_mm(x, ids, weights) if self.gmm_ok() else None

    def route_and_serve(self, x: torch.Tensor, gate: nn.Module, top_k: int, norm_topk_prob: bool):
        """``MoE.route`` + ``dispatch_experts`` with the routed kernel doing the router's softmax and
        top-k too (one call after the router GEMM instead of six small ops): → (y, ids, probs), or None
        under autograd, without the routed kernel, or where the cost model expects another path to win
        (the experts it will touch estimated as under uniform routing)."""
        if torch.is_grad_enabled() or self.routed is None or x.dtype != torch.bfloat16:
            return None
        if self.path(x.shape[0], top_k, expected_touched(x.shape[0], top_k, self.num_experts)) != "routed":
            return None
        return cpu_moe.route_and_run(x, gate(x), top_k, norm_topk_prob, *self.routed)

    def dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``dispatch_experts`` as two GEMMs over every expert:
        ``h = silu(x G_eᵀ) · (x U_eᵀ)`` for all e at once, ``y = [w_e · h_e]_e · [D_e]_eᵀ`` with
        w_e the token's routing weight for e (0 where not routed) — Σ_j w_j · E_{ids_j}(x) by
        linearity, in another summation order; e / k times the FLOPs of the routed rows."""
        t = x.shape[0]
        gate_up, down = self.packed_all
        e, i = self.num_experts, self.down_proj.shape[2]
        gu = _linear(x, gate_up, None).view(t, e, 2 * i)
        h = silu_mul(gu[..., :i].reshape(t * e, i), gu[..., i:].reshape(t * e, i), engine_owned=True).view(t, e, i)
        w = torch.zeros(t, e, dtype=x.dtype).scatter_(1, ids, weights.to(x.dtype))
        return _linear((h * w[..., None]).view(t, e * i), down, None)

    def grouped_mm(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``dispatch_experts`` with one ``torch._grouped_mm`` per matrix over every expert's routed rows
        (sorted by expert), reading the parameters in place (no copy)."""
        k, i = ids.shape[1], self.down_proj.shape[2]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        offs = torch.bincount(flat, minlength=self.num_experts).cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(x[token], self.gate_up_proj.detach().transpose(1, 2), offs=offs)
        h = silu_mul(gu[:, :i].contiguous(), gu[:, i:].contiguous(), engine_owned=True)
        y = torch._grouped_mm(h, self.down_proj.detach().transpose(1, 2), offs=offs)
        return torch.zeros_like(x).index_add_(0, token, y * weights.reshape(-1)[order, None].to(x.dtype))

    def grouped(self, xs: list[torch.Tensor]) -> torch.Tensor | None:
        """``Experts.grouped`` through the packed copies (under autograd, or in float32 where
        ``grouped_mm`` serves: the parameters)."""
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


def pack_linears(model: nn.Module, fp32: bool = False, few_rows: bool = True) -> int:
    """Pack a bfloat16 (or, with ``fp32``, float32) CPU model's linears in place; → how many
    linears (0 when not applicable). ``few_rows``: decode-sized steps may take the few-row kernel."""
    dtypes = (torch.bfloat16, torch.float32) if fp32 else (torch.bfloat16,)
    if model.dtype not in dtypes or model.device.type != "cpu" or not available(model.dtype):
        return 0
    fused = set()
    if isinstance(rotary := getattr(model, "rotary", None), Rotary):
        rotary.cached = True               # decode steps read cos/sin rows from a table
    for m in model.modules():
        if isinstance(m, (SoftmaxAttention, MLP, RMSNorm)):
            m.engine_owned = True          # the fused element-wise C ops may serve float32 too (cpu_ops)
        if isinstance(m, SoftmaxAttention) and _fusable(group := [m.q_proj, m.k_proj, m.v_proj]):
            m.fused_qkv = FusedLinear(group, few_rows)
        elif isinstance(m, MLP) and _fusable(group := [m.gate_proj, m.up_proj]):
            m.fused_gate_up = FusedLinear(group, few_rows)
        else:
            continue
        fused.update(map(id, group))
    rest = [m for m in model.modules() if type(m) in (nn.Linear, Linear) and id(m) not in fused]
    for m in rest:
        m.__class__ = PackedLinear
        m.few_rows = few_rows
        m.repack()
    experts = [m.experts for m in model.modules() if isinstance(m, MoE) and type(m.experts) is Experts]
    for m in model.modules():
        if isinstance(m, MoE) and type(m.experts) is Experts:
            m.experts.__class__ = PackedExperts
            m.experts.top_k = m.top_k
            m.experts.repack()
    return len(rest) + len(fused) + sum(2 * m.gate_up_proj.shape[0] for m in experts)


def repack(model: nn.Module) -> None:
    """Refresh every packed copy from the parameters; ``model.packed_generation`` counts the refreshes
    (holders of packed tensors' addresses, ``decode_stack``, re-read them when it moves)."""
    model.packed_generation = getattr(model, "packed_generation", 0) + 1
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedExperts)):
            m.repack()
        for f in (getattr(m, "fused_qkv", None), getattr(m, "fused_gate_up", None)):
            if f is not None:
                f.repack()
