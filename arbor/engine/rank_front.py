"""One engine front over N ranks of a distributed engine (``arbor serve MODEL ranks=N``; the HTTP
part is ``arbor.serve.ranks``).

Every rank loads the folder under ``init_distributed`` and keeps its own requests, KV and scheduler
(attention data-parallel); an MoE model's experts are split over the ranks (expert-parallel, every
``step()`` one forward on every rank), a dense model is N independent replicas under the same
protocol. Rank 0 drives a ``RankFront`` (a ``SteppedEngine``: ``arbor.engine.client``) in place of its
``LLMEngine``; ranks ≥ 1 run ``worker_loop``.

Protocol, on the control group; every rank issues the same collectives in the same order:

- a round = rank 0 broadcasts one ``Control`` (new requests as (rank, id, prompt ids, SamplingParams),
  aborts as (rank, id), ``step``, ``stop``); every rank adds, then aborts, its own part; if ``step``,
  every rank calls ``LLMEngine.step()`` exactly once (under expert parallelism: one forward on every
  rank, idle where it has nothing) and rank 0 gathers each rank's updates with one all_gather_object.
- an update, per sequence that got a token: (id, sample, token, logprob, top log-probs, None), or,
  once it finished, (id, sample, None, None, None, its final ``Completion``) — text decoded on the
  owning rank, which knows where a stop string cut it; prompt ids left out (rank 0 has them).
  Streamed snapshots between carry token ids, log-probs and top log-probs only.
- requests are validated on rank 0 before dispatch (``LLMEngine.check_request``; all ranks first
  agree on the smallest context length of any rank): a bad one gets HTTP 400 and never reaches a
  worker, so an add never fails on its rank. A request lives on one rank, chosen on arrival: the one
  with the fewest in-flight sequences (lowest rank on ties).
- idle: the async loop steps only while a request is in flight; meanwhile rank 0 sends a no-op round
  (``step`` false) whenever no round went out for ``HEARTBEAT_S`` seconds, so a waiting worker never
  reaches the collective timeout (60 s) however long the server idles, yet still notices within that
  timeout that rank 0 is gone.
- shutdown: when the server stops (SIGTERM or SIGINT to rank 0 — ``arbor launch`` forwards its first
  signal to every rank as SIGTERM — or the launcher is gone) rank 0 sends ``stop`` and every rank
  exits 0; workers ignore SIGTERM/SIGINT and leave on rank 0's ``stop``. A failed collective ends the rank
  at once (exit 3) and the launcher stops the others; nothing hangs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from itertools import count

from arbor.distributed import CollectiveError
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion

HEARTBEAT_S = 1.0


@dataclass
class Control:
    """One round's message from rank 0 (see the module docstring)."""
    adds: list = field(default_factory=list)      # (rank, request id, prompt ids, SamplingParams)
    aborts: list = field(default_factory=list)    # (rank, request id)
    step: bool = False
    stop: bool = False


def run_round(engine, ctx, msg: Control) -> list | None:
    """Every rank's part of one round → every rank's updates (on every rank), or None without a step."""
    for rank, rid, ids, params in msg.adds:
        if rank == ctx.rank:
            engine.add_request(ids, params, rid)
    for rank, rid in msg.aborts:
        if rank == ctx.rank:
            engine.abort(rid)
    if not msg.step:
        return None
    updates = []
    for seq in engine.step():
        if seq.is_finished:
            final = seq.completion(engine.tokenizer)
            final.prompt_token_ids = []
            updates.append((seq.request_id, seq.index, None, None, None, final))
            if all(s.is_finished for s in engine.requests.get(seq.request_id, ())):
                engine.requests.pop(seq.request_id, None)
        else:   # the tokens since the last round: a P/D policy can give a sequence several per step
            new = slice(seq.num_reported, seq.num_output_tokens)
            seq.num_reported = seq.num_output_tokens
            tops = seq.top_logprobs[new] if seq.top_logprobs is not None else None
            updates.append((seq.request_id, seq.index, seq.output_ids[new], seq.logprobs[new], tops, None))
    return ctx.all_gather_object(updates, name="serve updates")


def agree_context_length(engine, ctx) -> None:
    """Every rank serves the smallest context length of all ranks (collective)."""
    engine.max_model_len = min(ctx.all_gather_object(engine.max_model_len, name="serve context length"))


def worker_loop(engine, ctx) -> None:
    """Rank ≥ 1: apply rank 0's rounds until it sends ``stop`` (signals are left to rank 0)."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: None)
    while True:
        msg = ctx.broadcast_object(None, name="serve control")
        if msg.stop:
            return
        run_round(engine, ctx, msg)


@dataclass
class _Request:
    rank: int
    params: SamplingParams
    prompt: list[int]
    live: int                                       # samples not finished
    samples: dict = field(default_factory=dict)     # index → (token ids, logprobs, top logprobs or None)


@dataclass
class _Snapshot:
    """What ``AsyncLLMEngine._publish`` reads from an updated sequence."""
    out: Completion

    @property
    def request_id(self) -> str:
        return self.out.request_id

    @property
    def is_finished(self) -> bool:
        return self.out.finished

    def completion(self, tokenizer=None) -> Completion:
        return self.out


class RankFront:
    """Rank 0's engine: its own ``LLMEngine`` plus the other ranks, behind the ``SteppedEngine``
    interface (``generate``, ``add_request``, ``abort``, ``step``, ``has_unfinished``, ``stats``;
    ``requests``), so ``AsyncLLMEngine(front)`` streams from it. Invariant: ``_load[r]`` = unfinished
    sequences of the requests in ``_inflight`` on rank r."""

    lockstep = False          # the rounds keep the ranks in step; the async loop need not

    def __init__(self, engine, ctx):
        self.engine, self.ctx = engine, ctx
        self.model, self.tokenizer, self.max_model_len = engine.model, engine.tokenizer, engine.max_model_len
        self.requests: dict[str, list[_Request]] = {}     # AsyncLLMEngine's view; it pops finished ones
        self._inflight: dict[str, _Request] = {}
        self._load = [0] * ctx.world_size
        self._adds, self._aborts = [], []
        self._ids = count()
        self._last = time.monotonic()

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's ids, or ValueError: rank 0's ``LLMEngine.check_request`` at the agreed context length."""
        return self.engine.check_request(prompt, params)

    @property
    def max_prompt_chars(self) -> int | None:
        return self.engine.max_prompt_chars

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate here (ValueError on a bad request) and queue for the least loaded rank."""
        params = params or SamplingParams()
        ids = self.engine.check_request(prompt, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._inflight or rid in self.requests:
            raise ValueError(f"request id '{rid}' is already in use")
        rank = min(range(self.ctx.world_size), key=lambda r: (self._load[r], r))
        req = _Request(rank, params, ids, params.n)
        self._inflight[rid], self.requests[rid] = req, [req]
        self._load[rank] += params.n
        self._adds.append((rank, rid, ids, params))
        return rid

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        req = self._inflight.pop(request_id, None)
        if req is not None:
            self._load[req.rank] -= req.live
            self._aborts.append((req.rank, request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inflight or self._adds or self._aborts)

    def update_weights(self, named_tensors) -> float:
        raise ValueError("update_weights is not supported with --ranks; restart the server on the new weights")

    def stats(self) -> dict:
        """Requests in flight, in-flight sequences per rank (``load``), and rank 0's engine's ``stats()``."""
        return {"requests": len(self._inflight), "load": list(self._load), "rank0": self.engine.stats()}

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run a batch over the ranks to the end → final completions in prompt order (``LLMEngine.generate``)."""
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        while self.has_unfinished():
            for snap in self.step():
                if snap.is_finished:
                    final[snap.request_id, snap.out.index] = snap.out
        for rid in rids:
            self.requests.pop(rid, None)
        return [final[rid, j] for rid, sp in zip(rids, params) for j in range(sp.n)]

    def _round(self, step: bool = False, stop: bool = False) -> list | None:
        msg = Control(self._adds, self._aborts, step, stop)
        self._adds, self._aborts, self._last = [], [], time.monotonic()
        try:
            self.ctx.broadcast_object(msg, name="serve control")
            return None if stop else run_round(self.engine, self.ctx, msg)
        except CollectiveError as e:       # a broken group cannot be recovered: leave at once
            print(f"arbor serve: error: {e}", file=sys.stderr, flush=True)
            os._exit(3)

    def step(self) -> list[_Snapshot]:
        """One round with a step on every rank → a snapshot per sequence that got a token."""
        out = []
        for updates in self._round(step=True):
            for rid, index, tokens, logprobs, new_tops, final in updates:
                req = self._inflight.get(rid)
                if req is None:                 # aborted since
                    continue
                if final is not None:
                    final.prompt_token_ids = req.prompt
                    req.live -= 1
                    self._load[req.rank] -= 1
                    if not req.live:
                        del self._inflight[rid]
                    out.append(_Snapshot(final))
                    continue
                ids, lps, tops = req.samples.setdefault(index, ([], [], None if new_tops is None else []))
                ids += tokens
                lps += logprobs
                if tops is not None:
                    tops += new_tops
                out.append(_Snapshot(Completion(rid, index, req.prompt, list(ids), list(lps),
                                                top_logprobs=None if tops is None else list(tops))))
        return out

    def heartbeat(self) -> None:
        """A no-op round (pending adds and aborts ride along) if none went out for ``HEARTBEAT_S``."""
        if time.monotonic() - self._last >= HEARTBEAT_S:
            self._round()

    def close(self) -> None:
        """Tell every worker to exit (once)."""
        self._round(stop=True)


__all__ = ["Control", "RankFront", "agree_context_length", "run_round", "worker_loop"]
