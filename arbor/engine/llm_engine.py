"""``LLMEngine``: requests in, completions out — scheduler, model runner and sampler in one loop.

``step()`` is the scheduling policy's (``arbor.engine.policies``): schedule → forward(s) → sample →
append / stop checks → free finished sequences; ``run_batch`` is the one forward-and-sample that
every policy's step is made of. A request with ``n`` samples becomes n sequences; samples after
the first wait until the first one's prompt KV is computed, then share it through the prefix cache.

Distributed (``ctx`` with ``ep_size`` > 1): attention is data-parallel — each rank has its own
requests, KV and scheduler — and the experts are split over the EP group. Every ``step()`` then runs
exactly one forward, an idle one (``idle_forward``) when this rank has nothing scheduled, so the
ranks' expert all-to-alls line up; ``generate`` steps until no rank has work (one MAX all-reduce
per step on the control group).

``lock`` (reentrant) guards the scheduler, block manager, state cache, sampler and counters: the P/D
policies step a prefill and a decode worker concurrently, each forward outside the lock and each
schedule and post-forward (commit, sample, append, stop) inside it.
"""

from __future__ import annotations

import copy
import functools
import logging
import numbers
import threading
import time
from itertools import count
from pathlib import Path

import torch

from arbor.engine.block_manager import BlockManager
from arbor.engine.config import EngineConfig
from arbor.engine.cpu_linear import pack_linears, repack
from arbor.engine.model_runner import ModelRunner
from arbor.engine.kv.paged import KVCache
from arbor.engine.policies import policy_class
from arbor.engine.sampler import Sampler
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.scheduler import Scheduler
from arbor.engine.sequence import Completion, Sequence

log = logging.getLogger(__name__)

_LONG_TEXT = 4096       # characters above which a text is tokenized with the GIL released


def _check_text(text, what: str) -> None:
    """ValueError unless ``text`` is a string that UTF-8 can encode (no lone surrogates)."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid Unicode text (character {e.start}: a lone surrogate)") from None


def _load(model_or_path, cfg: EngineConfig, tokenizer, ctx=None):
    """→ (model, tokenizer, whether the engine owns the model: loaded or converted here)."""
    if isinstance(model_or_path, (str, Path)):
        from arbor.models import load_model
        folder = Path(model_or_path)
        model = load_model(folder, dtype=cfg.torch_dtype, device=cfg.device, ctx=ctx)
        if tokenizer is None and (folder / "tokenizer.json").exists():
            from arbor.models.tokenizer import Tokenizer
            tokenizer = Tokenizer.load(folder)
        return model.eval(), tokenizer, True
    model = model_or_path
    if model.dtype != cfg.torch_dtype or model.device != torch.device(cfg.device) or cfg.share_weights is False:
        return converted_copy(model, cfg.torch_dtype, cfg.device).eval(), tokenizer, True
    return model.eval(), tokenizer, False


def converted_copy(model, dtype: torch.dtype, device) -> torch.nn.Module:
    """A deep copy of ``model`` whose floating parameters and buffers are made directly in ``dtype`` on
    ``device`` (``copy.deepcopy`` takes them from its memo), so no full-precision copy exists on the way:
    a float32 trainer's bfloat16 engine costs half its weights, not one and a half. Tied tensors stay tied."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        new = t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
        memo[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
    return copy.deepcopy(model, memo)


def refuse_block_diffusion(model_or_path) -> None:
    """The engine decodes autoregressively; a model of another family (a folder or a module) is refused
    with what decodes it instead, never decoded causally."""
    if isinstance(model_or_path, (str, Path)):
        from arbor.models import ModelConfig
        mc = ModelConfig.from_file(model_or_path)
    else:
        mc = getattr(model_or_path, "config", None)
    if mc is not None and getattr(mc, "family", "autoregressive") != "autoregressive":
        raise ValueError(f"{model_or_path if isinstance(model_or_path, (str, Path)) else 'this model'} is a "
                         f"block-diffusion model ({mc.architecture}); LLMEngine decodes left to right and would "
                         "decode it wrongly. Use `arbor generate --diffusion` (arbor.dllm.decoding: "
                         "diffusion_generate / generate_text), `arbor eval` for accuracy, and `arbor train` for EBPO")


class LLMEngine:
    def __init__(self, model_or_path, config: EngineConfig | None = None, tokenizer=None, ctx=None):
        """A module in the engine's dtype and device is served as is (weight updates then move
        nothing) unless ``share_weights=False``; otherwise the engine keeps its own converted copy,
        whose linear weights it packs for oneDNN on CPU (bfloat16; float32 with
        ``fp32_gemm="onednn"``: ``cpu_linear``). ``ctx``: the rank
        context of a distributed engine (a folder is then loaded with its experts sharded; a
        module must already be sharded with ``shard_experts``)."""
        refuse_block_diffusion(model_or_path)
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        cfg.check_device()
        self.model, self.tokenizer, owned = _load(model_or_path, cfg, tokenizer, ctx)
        self.ctx = ctx
        self.lockstep = getattr(self.model, "ep_state", None) is not None
        if self.lockstep and ctx is None:
            raise ValueError("an expert-parallel model needs the engine to get its rank context (ctx=...)")
        self.num_packed = pack_linears(self.model, fp32=cfg.fp32_gemm == "onednn",
                                       few_rows=cfg.few_row_kernel) if owned else 0
        mc = self.model.config
        has_linear = "linear_attention" in mc.layer_types
        n_attn = sum(t == "full_attention" for t in mc.layer_types)
        per_block = KVCache.bytes_per_block(n_attn, cfg.block_size, mc.num_key_value_heads, mc.head_dim,
                                            cfg.torch_dtype)
        num_blocks = seq_blocks = cfg.resolve_num_blocks(per_block)
        runner_cls, manager_cls, tiers = ModelRunner, BlockManager, {}
        self.layer_kv = None
        if cfg.layer_kv:    # two KV tiers with per-layer residency (arbor.engine.policies.layerkv)
            from arbor.engine.policies.layerkv import LayerKV, LayerKVRunner, TieredBlockManager
            self.layer_kv = LayerKV(cfg, n_attn, per_block, self.model.device)
            num_blocks, seq_blocks = self.layer_kv.host_blocks, self.layer_kv.max_seq_blocks
            runner_cls, manager_cls, tiers = LayerKVRunner, TieredBlockManager, {"tiers": self.layer_kv}
        self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings, seq_blocks * cfg.block_size)
        if self.max_model_len < 2:      # a prompt token and an answer
            raise ValueError(f"EngineConfig: a sequence can hold {self.max_model_len} token(s) (num_blocks × block_size = "
                             f"{seq_blocks} × {cfg.block_size}, max_position_embeddings {mc.max_position_embeddings}), so no "
                             "request could ever run; raise num_blocks or block_size")
        snapshots = cfg.state_snapshots if has_linear and cfg.enable_prefix_caching else 0
        self.lock = threading.RLock()
        self.runner = runner_cls(self.model, num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.logit_noise, cfg.seed,
                                 snapshots, cfg.logit_noise_dist, cfg.logit_noise_frac, **tiers)
        self.runner.lock = self.lock
        self.block_manager = manager_cls(num_blocks, cfg.block_size, cfg.enable_prefix_caching and (
            snapshots > 0 or not has_linear), states=self.runner.states if snapshots else None, **tiers)
        self.policy = policy_class(cfg.policy)()
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.policy,
                                   on_free=self.runner.release)
        self.sampler = Sampler(cfg.seed)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = count()
        self.num_steps = 0
        self.decode_stall_s = 0.0       # Σ over decode tokens: forward start − previous token's time
        self.timeline: list | None = None
        self.policy.bind(self)

    # ---- requests -----------------------------------------------------------------------
    @functools.cached_property
    def _longest_token_chars(self) -> int | None:
        vocab = getattr(getattr(self.tokenizer, "tok", None), "get_vocab", None)
        return None if vocab is None else max(1, max((len(t) for t in vocab(with_added_tokens=True)), default=1))

    @property
    def max_prompt_chars(self) -> int | None:
        """Text longer than this cannot fit the context, so it is refused without being tokenized:
        a token spells at most ``L`` characters (the longest vocabulary entry), hence a text of c
        characters has at least c / L tokens; the factor 2 leaves room for normalizers that merge
        characters. None without a vocabulary to measure."""
        longest = self._longest_token_chars
        return None if longest is None else 2 * self.max_model_len * longest

    def encode(self, prompt) -> list[int]:
        """Token ids of a text (never special tokens added) or of a list of ids (taken as they are).
        A long text is tokenized with the GIL released, so other threads (the server's event loop)
        keep running meanwhile."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or a model folder with tokenizer.json")
            _check_text(prompt, "prompt")
            limit = self.max_prompt_chars
            if limit is not None and len(prompt) > limit:
                raise ValueError(f"the prompt has {len(prompt)} characters, more than the {self.max_model_len}-token "
                                 f"context can hold (at most {limit} characters)")
            batch = getattr(getattr(self.tokenizer, "tok", None), "encode_batch", None)
            if batch is not None and len(prompt) > _LONG_TEXT:
                return batch([prompt], add_special_tokens=False)[0].ids
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError when this engine would refuse the request."""
        ids = self.encode(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got one out of range")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {self.max_model_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        for s in params.stop:
            _check_text(s, "stop")
        if not isinstance(params.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab
                for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids in [0, {vocab})")
        return ids

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (token ids or text); → request id. Raises ValueError on a bad request."""
        params = params or SamplingParams()
        ids = self.check_request(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.model.config.stop_token_ids)
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        seqs = [Sequence(request_id, j, ids, params, frozenset(stop), max_tokens) for j in range(params.n)]
        with self.lock:
            for seq in seqs:
                self.scheduler.add(seq)
            self.requests[request_id] = seqs
        return request_id

    def abort(self, request_id: str) -> None:
        self.policy.drain()     # a sequence in a concurrent worker's forward keeps its blocks until it ends
        with self.lock:
            for seq in self.requests.pop(request_id, []):
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    seq.finish_time = time.perf_counter()

    def has_unfinished(self) -> bool:
        """Requests still running, or outputs of finished ones that a ``step`` has yet to return."""
        return self.scheduler.has_unfinished() or self.policy.has_undelivered()

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """The policy's step: one forward (P/D policies: one prefill epoch with its decode steps);
        → the sequences that got a token this step (finished ones included)."""
        return self.policy.step(self)

    def run_batch(self, batch, layers_per_segment: int | None = None, at_boundary=None,
                  phase: str | None = None) -> list[Sequence]:
        """Forward ``batch`` (cut every ``layers_per_segment`` layers, ``at_boundary()`` between
        segments), commit its KV, sample, append, check stops; → the sequences that sampled.
        ``phase`` names the forward in ``timeline`` (default: decode, prefill or mixed by its chunks)."""
        routing = any(s.params.return_routed_experts for s, _ in batch)
        if phase is None and self.timeline is not None:
            ones = sum(n == 1 for _, n in batch)
            phase = "decode" if ones == len(batch) else "prefill" if not ones else "mixed"
        t0 = time.perf_counter()
        with self.lock:
            for seq, n in batch:
                if n == 1 and seq.last_token_time is not None and seq.num_pending_tokens == 1:
                    self.decode_stall_s += t0 - seq.last_token_time
        for _, result in self.runner.run_segments(batch, layers_per_segment, routing):
            self.record(phase, t0, batch)
            if result is None:
                at_boundary()
                t0 = time.perf_counter()
        with self.lock:
            return self._finish_batch(*result)

    def _finish_batch(self, batch, sampled, logits, routed, offsets) -> list[Sequence]:
        """After a forward (under ``lock``): record routing, commit KV, sample, append, check stops."""
        if routed is not None:
            for (seq, n), off in zip(batch, offsets):
                if seq.params.return_routed_experts:
                    seq.record_routing(seq.num_computed_tokens, routed[:, off:off + n].cpu())
        for seq, n in batch:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        self.runner.save_states([seq for seq, _ in batch])
        self.num_steps += 1
        if not sampled:
            return []
        tokens, logprobs, tops = self.sampler(logits, sampled)
        for seq, tok, lp, top in zip(sampled, tokens, logprobs, tops):
            seq.append(tok, lp, top)
            reason = seq.check_stop() or self._check_stop_strings(seq)
            if reason:
                self.scheduler.finish(seq, reason)
                seq.finish_time = time.perf_counter()
        return sampled

    def record(self, phase: str, t0: float, batch) -> None:
        """Append (phase, start, end, tokens) to ``timeline`` when one is kept (set it to a list)."""
        if self.timeline is not None:
            self.timeline.append((phase, t0, time.perf_counter(), sum(n for _, n in batch)))

    @torch.inference_mode()
    def idle_step(self) -> list:
        """Join the other ranks' expert exchanges of one step with no tokens of this rank's own."""
        return self.policy.idle_step(self)

    def any_rank_unfinished(self) -> bool:
        """``has_unfinished`` of any rank (one collective under lockstep; this rank's alone otherwise)."""
        if not self.lockstep:
            return self.has_unfinished()
        return bool(self.ctx.flags_max(float(self.has_unfinished()), name="engine work")[0])

    def _check_stop_strings(self, seq: Sequence) -> str | None:
        if not seq.params.stop:
            return None
        text = self.tokenizer.decode(seq.output_ids)
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if not hits:
            return None
        seq.text_end = min(hits)
        return "stop"

    def completion(self, seq: Sequence) -> Completion:
        return seq.completion(self.tokenizer)

    def pop_finished(self, request_id: str) -> list[Completion] | None:
        seqs = self.requests.get(request_id)
        if seqs is None or not all(s.is_finished for s in seqs):
            return None
        del self.requests[request_id]
        return [self.completion(s) for s in seqs]

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | None = None) -> list[Completion]:
        """→ completions in prompt order (the n samples of a prompt consecutive)."""
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = None
        if self.config.progress if progress is None else progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(sp.n for sp in params), desc="generate", unit="seq")
        while self.any_rank_unfinished():
            for seq in self.step():
                if bar is not None and seq.is_finished:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [c for rid in ids for c in self.pop_finished(rid)]

    def close(self) -> None:
        """Stop the policy's workers (the P/D policies' threads); the engine takes no steps after it."""
        self.policy.close()

    def stats(self) -> dict:
        """Queue lengths, KV use and counters now: requests, waiting / running sequences, steps,
        preemptions, KV blocks (``kv_usage`` = blocks held by running sequences / all blocks), the
        prefix-cache hit rate, Σ decode stall, and the policy's and the KV tiers' counters."""
        bm, s = self.block_manager, self.scheduler
        total = len(bm.blocks)
        out = {"policy": self.config.policy, "requests": len(self.requests), "waiting": len(s.waiting),
               "running": len(s.running), "num_steps": self.num_steps, "num_preemptions": s.num_preemptions,
               "kv_blocks": total, "kv_blocks_free": bm.num_free_blocks,
               "kv_usage": (total - bm.num_free_blocks) / max(1, total), "prefix_cache_hit_rate": bm.hit_rate,
               "decode_stall_s": self.decode_stall_s, **self.policy.stats()}
        if self.layer_kv is not None:
            out["layer_kv"] = self.layer_kv.stats()
        return out

    # ---- weights ------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors) -> float:
        """Copy (HF-named) tensors into the served parameters in place, between steps; the
        prefix cache is dropped (its KV belongs to the old weights). → seconds taken."""
        t0 = time.perf_counter()
        self.policy.drain()     # no forward of a concurrent worker reads the weights while they change
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        params = self.model.state_dict()
        for name, tensor in items:
            if name not in params:
                raise KeyError(f"update_weights: unknown parameter '{name}'")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            if p.data_ptr() != tensor.data_ptr():
                p.copy_(tensor)
        if self.num_packed:
            repack(self.model)
        self.block_manager.reset_prefix_cache()
        dt = time.perf_counter() - t0
        log.info("update_weights: %.3f s", dt)
        return dt
