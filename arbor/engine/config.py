"""``EngineConfig``: every engine knob, with defaults that work on a laptop CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arbor.models.config import torch_dtypes

DTYPES = torch_dtypes()
NOISE_DISTS = ("normal", "cauchy")


@dataclass
class EngineConfig:
    """KV pool size: ``num_blocks`` if given, else ``kv_memory_fraction`` of free GPU memory (CUDA)
    or ``kv_cache_bytes`` (CPU), capped at what ``max_num_seqs`` sequences of ``max_model_len``
    tokens need. ``max_model_len`` is clipped to the pool, so one sequence always fits.
    ``logit_noise`` adds noise of scale σ (``logit_noise_dist``: normal N(0, σ²), or heavy-tailed
    cauchy) to the logits of a ``logit_noise_frac`` fraction of sampled positions, before sampling
    and log-probs (to simulate an engine whose numerics differ from the trainer's).
    ``state_snapshots``: recurrent-state snapshots kept at block boundaries so that prefix caching
    also serves models with linear-attention layers (each holds every linear layer's state; 0 turns
    prefix caching off for such models).
    ``policy``: a name of ``arbor.engine.policies.POLICIES``; each policy refuses (``check``) the
    settings it cannot run with. ``pd_segment_layers``: layers per prefill segment under
    ``pd-multiplex`` — a decode step may run at every segment boundary (a segment's tokens: the
    prefill epoch, ≤ ``max_num_batched_tokens``). ``pd_threads``: "P,D", the CPU threads of the
    prefill and of the decode worker, which run concurrently under the two P/D policies (a budget is
    exact for GEMMs and Arbor's C kernels; ATen's element-wise ops follow P's: ``arbor.kernels.threads``).
    ``layer_kv``: layer-wise KV over two tiers (``arbor.engine.policies.layerkv``): a device tier of
    ``device_kv_blocks`` layer-blocks (default: the pool above, in layer-blocks) and a host tier of
    ``host_kv_blocks`` blocks (default: the pool above); ``policy="layerkv"`` adds
    SLO-aware admission to ``mixed`` (``tpot_slo``, ``ttft_slo`` in seconds, safety factor
    ``slo_safety`` ≥ 1 on the predicted prefill time; ``arbor.engine.policies.slo_admission``).
    ``share_weights``: a module already in the engine's dtype and device is served as is (the
    caller's tensors; weight updates move nothing); False: the engine keeps its own copy, which it
    may pack (below); None (the default): True here; ``arbor train`` decides by the model's size
    (``arbor.train.config.engine_shares``). ``fp32_gemm``: the float32 linears of an engine-owned CPU copy — ``onednn``:
    oneDNN pre-packed weights (steps of ≤ 64 rows: the few-row kernel ``arbor.kernels.cpu_small_linear``)
    and the fused C ops of ``arbor.kernels.cpu_ops`` (q/k-norm + RoPE, silu · mul); sums in another
    order than ``F.linear`` and the PyTorch ops, so logits differ in the last bits | ``exact``:
    ``F.linear`` and the PyTorch ops. bfloat16 copies are always packed (``arbor.engine.cpu_linear``).
    ``few_row_kernel``: packed linears serve decode-sized steps by the few-row kernel where it is the
    faster one here (``cpu_linear.small_linear_serves``), at the cost of one more copy of the dense
    linear weights; False keeps one packed copy (oneDNN's) for every step."""
    block_size: int = 16                # tokens per KV block
    num_blocks: int | None = None       # KV blocks in the pool (None: from kv_memory_fraction or kv_cache_bytes)
    kv_memory_fraction: float = 0.5     # CUDA: share of free GPU memory the KV pool may take
    kv_cache_bytes: int = 256 << 20     # CPU: bytes the KV pool may take
    max_num_seqs: int = 256             # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens per step (the scheduler's budget)
    max_model_len: int = 4096           # longest prompt + completion (clipped to the pool and the model)
    policy: str = "mixed"               # scheduling policy: a name in arbor.engine.policies.POLICIES
    pd_segment_layers: int = 1          # pd-multiplex: layers per prefill segment
    pd_threads: str = "1,1"             # pd-multiplex, pd-global-enqueue: CPU threads of the prefill and decode workers
    enable_prefix_caching: bool = True  # reuse the KV of shared prompt prefixes
    state_snapshots: int = 64           # recurrent-state snapshots for prefix caching of linear-attention models
    dtype: str = "float32"              # float32 | bfloat16 | float16 (of the served copy)
    device: str = "cpu"                 # cpu | cuda | cuda:N | mps
    seed: int = 0                       # sampling and logit-noise seed
    logit_noise: float = 0.0            # σ of the noise added to logits (0: none)
    logit_noise_dist: str = "normal"    # normal | cauchy
    logit_noise_frac: float = 1.0       # fraction of sampled positions that get noise
    progress: bool = False              # a progress bar in generate()
    layer_kv: bool = False              # layer-wise KV over a device and a host tier (LayerKV)
    device_kv_blocks: int | None = None # layer_kv: device-tier size in layer-blocks
    host_kv_blocks: int | None = None   # layer_kv: host-tier size in blocks
    tpot_slo: float | None = None       # layerkv policy: time-per-output-token SLO, seconds
    ttft_slo: float | None = None       # layerkv policy: time-to-first-token SLO, seconds
    slo_safety: float = 1.2             # layerkv policy: safety factor (≥ 1) on the predicted prefill time
    share_weights: bool | None = None   # serve a module in this dtype and device as is (unset: yes; arbor train: by size)
    fp32_gemm: str = "onednn"           # float32 linears of an engine-owned CPU copy: onednn | exact
    few_row_kernel: bool = True         # CPU, packed linears: steps of <= 64 rows through the C kernel (+1 weight copy)

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"engine dtype must be one of {sorted(DTYPES)}, got '{self.dtype}'")
        return DTYPES[self.dtype]

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        wanted = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        budget = self.kv_cache_bytes
        if torch.device(self.device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            budget = int(free * self.kv_memory_fraction)
        return max(1, min(wanted, budget // max(1, bytes_per_block)))

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first knob that no engine can run with (a count ≤ 0 would leave the
        scheduler with nothing it may schedule: a busy loop that never finishes a request)."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_bytes",
                     "pd_segment_layers"):
            _positive_int(name, getattr(self, name))
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2 (a prompt token and an answer), "
                             f"got {self.max_model_len}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")
        if not isinstance(self.state_snapshots, int) or self.state_snapshots < 0:
            raise ValueError(f"EngineConfig.state_snapshots must be an integer >= 0, got {self.state_snapshots!r}")
        if not self.logit_noise >= 0:
            raise ValueError(f"EngineConfig.logit_noise must be >= 0, got {self.logit_noise!r}")
        if self.logit_noise_dist not in NOISE_DISTS:
            raise ValueError(f"EngineConfig.logit_noise_dist must be one of {NOISE_DISTS}, got {self.logit_noise_dist!r}")
        if not 0 <= self.logit_noise_frac <= 1:
            raise ValueError(f"EngineConfig.logit_noise_frac must be in [0, 1], got {self.logit_noise_frac!r}")
        from arbor.engine.policies import policy_class
        from arbor.engine.policies.pd_runtime import parse_pd_threads
        policy = policy_class(self.policy)
        parse_pd_threads(self.pd_threads)
        self._validate_layer_kv()
        policy.check(self)
        if self.share_weights is not None and not isinstance(self.share_weights, bool):
            raise ValueError(f"EngineConfig.share_weights must be true or false, got {self.share_weights!r}")
        if not isinstance(self.few_row_kernel, bool):
            raise ValueError(f"EngineConfig.few_row_kernel must be true or false, got {self.few_row_kernel!r}")
        if self.fp32_gemm not in ("onednn", "exact"):
            raise ValueError(f"EngineConfig.fp32_gemm must be 'onednn' or 'exact', got {self.fp32_gemm!r}")
        self.torch_dtype

    def _validate_layer_kv(self) -> None:
        if not isinstance(self.layer_kv, bool):
            raise ValueError(f"EngineConfig.layer_kv must be true or false, got {self.layer_kv!r}")
        for name in ("device_kv_blocks", "host_kv_blocks"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.device_kv_blocks is not None and self.device_kv_blocks < 2:
            raise ValueError("EngineConfig.device_kv_blocks must be >= 2 (a layer-block for the layer that "
                             f"computes and one for the next layer's prefetch), got {self.device_kv_blocks}")
        for name in ("tpot_slo", "ttft_slo"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"EngineConfig.{name} must be a number of seconds > 0 (or None), got {value!r}")
        safety = self.slo_safety
        if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not safety >= 1:
            raise ValueError(f"EngineConfig.slo_safety must be a number >= 1, got {self.slo_safety!r}")

    def check_device(self) -> torch.device:
        """The engine's device, or ValueError when this process cannot use it (e.g. "cuda" without CUDA)."""
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"EngineConfig.device '{self.device}' is not a device torch knows: {e}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"EngineConfig.device is '{self.device}' but CUDA is not available here "
                                 f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                                 "use device='cpu'")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"EngineConfig.device is '{self.device}' but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
        elif dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"EngineConfig.device is '{self.device}' but MPS is not available here; use device='cpu'")
        return dev


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
