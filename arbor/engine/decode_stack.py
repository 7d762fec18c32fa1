"""A decode step of a dense model (Qwen3, Llama, Qwen2, Mistral layers) in one C call
(``arbor/kernels/decode_stack.c``).

A small model's decode step on CPU is mostly Python: ~60 module calls and kernel launches of a few µs
each (about 1 ms a step at hidden 128, 4 layers, one sequence), far more than its arithmetic. The engine's
packed copy already runs each op as a C function (``cpu_ops``, ``cpu_small_linear``, ``cpu_attention``);
``DecodeStack`` hands those functions' addresses and every layer's weights to one C routine that calls
them in the modules' order, so the hidden states are the module path's bit for bit.

It serves a step when (``for_model`` / ``serves``): the model is the engine's packed CPU copy (float32 or
bfloat16) whose every layer is softmax attention (with q/k-norm as Qwen3, or without as Llama, Qwen2,
Mistral; not gated) and a dense SwiGLU MLP,
every linear has the few-row kernel's weights (``cpu_linear.small_linear_serves``), and the step is
decodes only (≤ ``cpu_small_linear.MAX_ROWS``, the paged decode kernel's metadata). Anything else takes
``CausalLM.forward_segments``. ``ARBOR_CPU_KERNELS=0`` turns it off with the other kernels.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.engine.cpu_linear import FusedLinear, PackedLinear
from arbor.engine.kv.paged import KVCache, PagedAttention
from arbor.kernels import cpu_attention, cpu_ops, cpu_small_linear, native
from arbor.kernels.threads import thread_budget
from arbor.models.attention import SoftmaxAttention
from arbor.models.layers import MLP

FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


@cache
def _lib():
    lib = native.build(Path(__file__).parents[1] / "kernels" / "decode_stack.c", FLAGS)
    if lib is None:
        return None
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.decode_stack.argtypes = [p, p, p, p, p, i32, p, p, p, p, p, p, f32, f32]
    lib.decode_stack.restype = ctypes.c_int
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class DecodeStack:
    def __init__(self, model, kv: KVCache, layer_map: dict[int, int]):
        self.model, self.kv, self.layer_map = model, kv, layer_map
        cfg, f32 = model.config, model.dtype == torch.float32
        ops, small = cpu_ops._lib(), cpu_small_linear.load_kernel()
        fns = [ops.rms_norm_f32 if f32 else ops.rms_norm, small.small_linear_f32 if f32 else small.small_linear_bf16,
               ops.qk_norm_rope_f32 if f32 else ops.qk_norm_rope, cpu_attention.load_kernel(),
               ops.silu_mul_f32 if f32 else ops.silu_mul, ops.rope_f32 if f32 else ops.rope]
        self.fns = torch.tensor([_address(f) for f in fns], dtype=torch.int64)
        attn = model.model.layers[0].self_attn
        self.dims = (cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, cfg.rotary_dim,   # the model's
                     model.model.layers[0].mlp.down_proj.in_features, kv.block_size, int(not f32), len(layer_map))
        self.eps, self.scale = model.model.norm.eps, attn.scale
        self._pointers = None       # (model.packed_generation, the layers' pointer table)

    @classmethod
    def for_model(cls, model, kv: KVCache, layer_map: dict[int, int]) -> "DecodeStack | None":
        """A stack for this model when it qualifies (module docstring), else None."""
        if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16) or _lib() is None:
            return None
        if not (cpu_ops._lib() and cpu_attention.supports(model.device, model.dtype)):
            return None
        layers, eps = model.model.layers, model.model.norm.eps
        for layer in layers:
            a, m = getattr(layer, "self_attn", None), layer.mlp
            if layer.is_linear or layer.is_moe or type(a) is not SoftmaxAttention or type(m) is not MLP:
                return None
            if a.gated or not (a.engine_owned and m.engine_owned):
                return None
            fused = (a.fused_qkv, m.fused_gate_up)
            if not all(isinstance(f, FusedLinear) and f.small is not None for f in fused):
                return None
            if not all(isinstance(p, PackedLinear) and p.small_weight is not None for p in (a.o_proj, m.down_proj)):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm)
            if any(n is not None and (n.zero_centred or not n.engine_owned or n.eps != eps) for n in norms):
                return None
        if model.model.norm.zero_centred or not model.model.norm.engine_owned or not model.rotary.cached:
            return None
        return cls(model, kv, layer_map)

    def serves(self, attn, rows: int) -> bool:
        """Whether this step is one the stack runs: decodes only, few enough rows, over ``kv``."""
        return (type(attn) is PagedAttention and attn.cache is self.kv and attn.decode_kernel is not None
                and attn.prefill_kernel is None and not attn.chunks and attn.num_decodes == rows
                and 0 < rows <= cpu_small_linear.MAX_ROWS)

    def _layer_pointers(self) -> torch.Tensor:
        """Each layer's weights and KV, in ``decode_stack.c``'s order; read again after each ``repack``
        (a weight update), which replaces the packed weights."""
        generation = getattr(self.model, "packed_generation", 0)
        if self._pointers is not None and self._pointers[0] == generation:
            return self._pointers[1]
        rows = []
        for i, layer in enumerate(self.model.model.layers):
            a, m, c = layer.self_attn, layer.mlp, self.layer_map[i]
            rows += [_ptr(layer.input_layernorm.weight), _ptr(a.fused_qkv.small), _ptr(a.fused_qkv.bias),
                     _ptr(a.q_norm and a.q_norm.weight), _ptr(a.k_norm and a.k_norm.weight), _ptr(self.kv.k[c]),
                     _ptr(self.kv.v[c]),
                     _ptr(a.o_proj.small_weight), _ptr(a.o_proj.bias), _ptr(layer.post_attention_layernorm.weight),
                     _ptr(m.fused_gate_up.small), _ptr(m.fused_gate_up.bias), _ptr(m.down_proj.small_weight),
                     _ptr(m.down_proj.bias)]
        self._pointers = generation, torch.tensor(rows, dtype=torch.int64)
        return self._pointers[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """→ the final-norm hidden states [T, hidden] of ``CausalLM.forward``, for a step ``serves`` accepts."""
        model = self.model
        x = model.model.embed_tokens(input_ids)
        cos, sin = model.rotary(positions, x.dtype)
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)
        tables, ctx = attn.decode_kernel
        dims = torch.tensor((*self.dims, tables.shape[1], thread_budget()), dtype=torch.int32)   # + the step's
        layers = self._layer_pointers()
        if _lib().decode_stack(self.fns.data_ptr(), layers.data_ptr(), model.model.norm.weight.data_ptr(),
                               x.data_ptr(), out.data_ptr(), x.shape[0], attn.slot_mapping.data_ptr(),
                               tables.data_ptr(), ctx.data_ptr(), cos.data_ptr(), sin.data_ptr(), dims.data_ptr(),
                               self.eps, self.scale):
            raise MemoryError("decode_stack: could not allocate its buffers")
        return out
