"""The trainer's fused element-wise ops, forward and backward (``train_ops.c``): RMSNorm, q/k-norm + RoPE, the
experts' SwiGLU and the sum of each token's expert outputs, for bfloat16 and float32 tensors (one library per
dtype), and block attention's softmax steps (bfloat16 and float32). Built by ``arbor.kernels.native`` with ``-O3
-march=native -fopenmp`` (no fast-math: ``exp_f32`` rounds by adding and subtracting 1.5 · 2²³), threads from
``thread_budget()``.

PyTorch runs a bfloat16 RMSNorm as a float32 upcast, five element-wise ops and a cast, each a pass over
memory, and autograd saves their intermediates; here each is one pass forward and one backward. The
forwards equal the PyTorch expressions (``layers.rms_norm``, ``moe.RoutedRows``) except where a float32
sum taken in another order rounds to the other bfloat16 neighbour; the backwards keep float32 between
loads and stores where PyTorch rounds ĝ = g · w and t = da · c to bfloat16. In float32 the same passes
replace PyTorch's (a float32 RMSNorm forward + backward is about ten passes over memory with autograd's saved
intermediates): results equal PyTorch's within float32 rounding, in another summation order. CPU tensors of
one dtype, bfloat16 or float32; where the library cannot be built (or ``ARBOR_CPU_KERNELS=0``),
``available()`` is False and callers keep their PyTorch expressions.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.kernels import native
from arbor.kernels.threads import thread_budget


DTYPES = (torch.bfloat16, torch.float32)


@cache
def _lib(dtype: torch.dtype = torch.bfloat16):
    """The library for ``dtype``'s tensors (``-DARBOR_TRAIN_F32``: the float32 build), None where not built."""
    flags = ["-O3", "-march=native", "-fopenmp"] + (["-DARBOR_TRAIN_F32"] if dtype == torch.float32 else [])
    lib = native.build(Path(__file__).with_name("train_ops.c"), flags)
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.rms_norm_fwd.argtypes = [p, p, p, p, i64, i32, f32, i32]
    lib.rms_norm_bwd.argtypes = [p, p, p, p, p, p, i64, i32, i32]
    lib.qk_norm_rope_fwd.argtypes = [p, p, p, p, p, p, p, i64, i32, i32, i32, i32, f32, i32]
    lib.qk_norm_rope_bwd.argtypes = [p, p, p, p, p, p, p, p, p, i64, i32, i32, i32, i32, i32]
    lib.softmax_rows.argtypes = [p, i64, i32, i32, i32, p, p, p, i32]
    lib.exp_rows.argtypes = [p, i64, i32, i32, i32, p, f32, p, p, i32]
    lib.scaled_product.argtypes = [p, p, f32, p, i64, i32]
    lib.shifted_exp_rows.argtypes = [p, i64, i32, i32, i32, p, p, i32]
    lib.softmax_grad_rows.argtypes = [p, p, p, i64, i32, i32]
    lib.sum_rows.argtypes = [p, p, p, i64, i32, i32, i32]
    lib.swiglu_fwd.argtypes = [p, p, p, i64, i32, i32]
    lib.swiglu_bwd.argtypes = [p, p, p, p, p, p, i64, i32, i32]
    for fn in (lib.rms_norm_fwd, lib.rms_norm_bwd, lib.qk_norm_rope_fwd, lib.qk_norm_rope_bwd, lib.softmax_rows,
               lib.exp_rows, lib.scaled_product, lib.shifted_exp_rows, lib.softmax_grad_rows, lib.sum_rows,
               lib.swiglu_fwd, lib.swiglu_bwd):
        fn.restype = None
    return lib


def available(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused ops serve these tensors (None: an absent optional one): all on CPU, of one dtype in
    ``DTYPES``, that dtype's library built."""
    given = [t for t in tensors if t is not None]
    dtype = given[0].dtype if given else None
    return (dtype in DTYPES and all(t.dtype == dtype and t.device.type == "cpu" for t in given)
            and _lib(dtype) is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    """The address of t's first element (t contiguous), None for None."""
    if t is not None and not t.is_contiguous():
        raise ValueError("train_ops takes contiguous tensors")
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · bf16(rmsnorm(x))`` over x's last dim (bf16: rounded; float32: the identity), weight [D];
    differentiable in x and weight."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        d = x.shape[-1]
        rows = x.reshape(-1, d).contiguous()
        y = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32)
        w = weight.contiguous()
        with native.profiled("arbor::rms_norm_fwd"):
            _lib(rows.dtype).rms_norm_fwd(rows.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(),
                                          rows.shape[0], d, eps, thread_budget())
        ctx.save_for_backward(rows, w, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, w, rstd = ctx.saved_tensors
        g = grad.reshape(rows.shape).to(rows.dtype).contiguous()
        dx = torch.empty_like(rows)
        threads = thread_budget()
        parts = torch.zeros(threads, rows.shape[1], dtype=torch.float32)
        with native.profiled("arbor::rms_norm_bwd"):
            _lib(rows.dtype).rms_norm_bwd(rows.data_ptr(), w.data_ptr(), rstd.data_ptr(), g.data_ptr(),
                                          dx.data_ptr(), parts.data_ptr(), rows.shape[0], rows.shape[1], threads)
        return dx.view(ctx.shape), parts.sum(0).to(w.dtype), None


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float) -> torch.Tensor:
    """q [T, Hq, D], k [T, Hk, D], per-head norm weights wq, wk [D], cos/sin [T, R] → [T, Hq + Hk, D]: each
    head RMS-normed then its first R channels rotated (``layers.apply_rope``); differentiable in q, k, wq, wk."""
    return _QkNormRope.apply(q, k, wq, wk, cos, sin, eps)


class _QkNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, wq, wk, cos, sin, eps):
        t, hq, d = q.shape
        x = torch.cat((q, k), 1)
        y = torch.empty_like(x)
        rstd = torch.empty(t, x.shape[1], dtype=torch.float32)
        wq, wk = wq.contiguous(), wk.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        with native.profiled("arbor::qk_norm_rope_fwd"):
            _lib(x.dtype).qk_norm_rope_fwd(x.data_ptr(), wq.data_ptr(), wk.data_ptr(), cos.data_ptr(),
                                           sin.data_ptr(), y.data_ptr(), rstd.data_ptr(), t, x.shape[1], hq, d,
                                           cos.shape[1], eps, thread_budget())
        ctx.save_for_backward(x, wq, wk, cos, sin, rstd)
        ctx.hq = hq
        return y

    @staticmethod
    def backward(ctx, grad):
        x, wq, wk, cos, sin, rstd = ctx.saved_tensors
        t, h, d = x.shape
        g = grad.to(x.dtype).contiguous()
        dx = torch.empty_like(x)
        threads = thread_budget()
        parts = torch.zeros(threads, 2, d, dtype=torch.float32)
        with native.profiled("arbor::qk_norm_rope_bwd"):
            _lib(x.dtype).qk_norm_rope_bwd(x.data_ptr(), wq.data_ptr(), wk.data_ptr(), cos.data_ptr(),
                                           sin.data_ptr(), rstd.data_ptr(), g.data_ptr(), dx.data_ptr(),
                                           parts.data_ptr(), t, h, ctx.hq, d, cos.shape[1], threads)
        dw = parts.sum(0).to(wq.dtype)
        return dx[:, :ctx.hq], dx[:, ctx.hq:], dw[0], dw[1], None, None, None


def softmax_rows(s: torch.Tensor, c: int, visible: torch.Tensor | None,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """s [N, R, e] float32 contiguous (overwritten) → (softmax rows [N, R, e] in ``dtype``, bf16 or float32; lse
    [N, R] float32); columns [c, e) of row r masked where ``visible`` [R, e − c] (bool, the same for every n) is
    False; a row that sees nothing gives 0 and lse 0."""
    n, r, e = s.shape
    probs = torch.empty(s.shape, dtype=dtype)
    lse = torch.empty(n, r, dtype=torch.float32)
    vis = None if visible is None else visible.contiguous()
    with native.profiled("arbor::softmax_rows"):
        _lib(dtype).softmax_rows(_ptr(s), n, r, e, c, _ptr(vis), probs.data_ptr(), lse.data_ptr(), thread_budget())
    return probs, lse


def shifted_exp_rows(s: torch.Tensor, shift: torch.Tensor, c: int, visible: torch.Tensor | None) -> torch.Tensor:
    """s [N, R, e] float32 contiguous → s itself, overwritten by exp(s − shift) (shift [N, R]), masked columns
    (as in ``softmax_rows``) 0."""
    n, r, e = s.shape
    vis = None if visible is None else visible.contiguous()
    shift = shift.contiguous()                # held here: a temporary would be freed before the call
    with native.profiled("arbor::shifted_exp_rows"):
        _lib(torch.float32).shifted_exp_rows(_ptr(s), n, r, e, c, _ptr(vis), _ptr(shift), thread_budget())
    return s


def softmax_grad_rows(p: torch.Tensor, d: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """p, d [N, R, e] float32 contiguous, delta [N, R] → d itself, overwritten by p ∘ (d − delta)."""
    delta = delta.contiguous()
    with native.profiled("arbor::softmax_grad_rows"):
        _lib(torch.float32).softmax_grad_rows(_ptr(p), _ptr(d), _ptr(delta), p.numel() // p.shape[-1], p.shape[-1],
                                              thread_budget())
    return d


def exp_rows(x: torch.Tensor, scale: float, c: int, visible: torch.Tensor | None):
    """x [N, R, e] bf16 contiguous → (P = exp(scale · x) float32, bf16(P)), masked columns (as in
    ``softmax_rows``) 0."""
    n, r, e = x.shape
    p = torch.empty(x.shape, dtype=torch.float32)
    pb = torch.empty(x.shape, dtype=torch.bfloat16)
    vis = None if visible is None else visible.contiguous()
    with native.profiled("arbor::exp_rows"):
        _lib().exp_rows(_ptr(x), n, r, e, c, _ptr(vis), scale, p.data_ptr(), pb.data_ptr(), thread_budget())
    return p, pb


def scaled_product(p: torch.Tensor, d: torch.Tensor, scale: float) -> torch.Tensor:
    """bf16(scale · p ∘ d), p float32 and d bf16 of one shape, contiguous."""
    out = torch.empty(p.shape, dtype=torch.bfloat16)
    with native.profiled("arbor::scaled_product"):
        _lib().scaled_product(_ptr(p), _ptr(d), scale, out.data_ptr(), p.numel(), thread_budget())
    return out


def sum_rows(src: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """src [R, D] contiguous, pos [T, k] int64 → [T, D]: row t = Σ_j src[pos[t, j]], summed in float32 (rounded
    once to src's dtype)."""
    t, k = pos.shape
    out = torch.empty(t, src.shape[1], dtype=src.dtype)
    pos = pos.contiguous()
    if pos.numel() and not 0 <= int(pos.min()) <= int(pos.max()) < src.shape[0]:
        raise IndexError(f"sum_rows: row indices outside 0..{src.shape[0] - 1}")
    with native.profiled("arbor::sum_rows"):
        _lib(src.dtype).sum_rows(_ptr(src), pos.data_ptr(), out.data_ptr(), t, k, src.shape[1], thread_budget())
    return out


def swiglu(h: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """h [R, 2I] contiguous ([gate | up] rows) → ``silu(gate) · up`` [R, I] (bf16: rounded as PyTorch's bf16
    ops round), times weights [R] when given (rounded again, as ``act.mul_(w)``); not differentiable
    (``swiglu_backward`` is its backward)."""
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype)
    with native.profiled("arbor::swiglu_fwd"):
        _lib(h.dtype).swiglu_fwd(_ptr(h), _ptr(weights), out.data_ptr(), rows, inter, thread_budget())
    return out


def swiglu_backward(h: torch.Tensor, weights: torch.Tensor | None, da: torch.Tensor, need_weights: bool,
                    need_output: bool = False):
    """∂ of ``swiglu(h, weights)`` given da [R, I] contiguous → (dh [R, 2I], d weights [R] float32 or None,
    ``swiglu(h, weights)`` itself or None: ``need_output``)."""
    dh = torch.empty_like(h)
    dc = torch.empty(h.shape[0], dtype=torch.float32) if need_weights else None
    out = torch.empty_like(da) if need_output else None
    with native.profiled("arbor::swiglu_bwd"):
        _lib(h.dtype).swiglu_bwd(_ptr(h), _ptr(weights), _ptr(da), dh.data_ptr(), _ptr(dc), _ptr(out), h.shape[0],
                                 h.shape[1] // 2, thread_budget())
    return dh, dc, out
