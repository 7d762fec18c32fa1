"""TAD — temporal-aware trajectory self-distillation for block-diffusion LMs.

1. The teacher (a frozen copy of the model) reads ``reference_prompt`` (prompt + "Reference
   answer: …") and decodes one token per step (LLaDA low-confidence, k = 1); the response state
   after every step is recorded: s_0 (all masked), s_1, …, s_K. Only trajectories whose final
   answer is correct are kept.
2. Pairs (s_k, s_{k+Δ}) (k + Δ clipped to K). Inside the block being decoded at step k (the block
   of s_k's first mask; later blocks are not yet part of the input), a position masked in s_k is
     near    if it is revealed in s_{k+Δ}  → CE against the teacher's token s_{k+Δ}[i];
     distant if it is still masked there   → KL(p_teacher ‖ p_student) at temperature 1, the
                                             teacher reading its reference-conditioned input.
   Loss = CE_near + KL_distant, each the mean over its positions in the batch (0 if none).
   Optional (``visible_weight`` w > 0, not in the paper): + w · CE_visible, the mean CE of the
   block's already revealed positions against their own tokens (s_k[i] = s_{k+Δ}[i]: the teacher
   never edits), so the student's predictions on visible tokens stay put and T2T editing, which
   re-reads them, does not rewrite right answers. It also adds one pair per block at the step that
   fills the block's last mask (the state LLaDA2.1's edit-only check reads), visible term only.
3. A smaller Δ gives the Quality student, a larger Δ (more distant tokens pulled towards the
   teacher's reference-informed distribution) the Speed student.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from arbor.dllm.decoding import DecodeConfig, diffusion_generate
from arbor.dllm.sft import Example, PaddedBlockAttention
from arbor.train.checkpoint import settings_of
from arbor.train.loop import BatchTrainer
from arbor.train.optim import OptimConfig
from arbor.train.run_log import LogConfig, RunLog

QUALITY_DELTA, SPEED_DELTA = 2, 8


@dataclass
class TADConfig:
    delta: int | None = None             # Δ; None: the mode's (Quality 2, Speed 8; `distill` alone: Speed's)
    steps: int = 1500                    # defaults = what `arbor bench dllm` distils with
    batch_size: int = 32
    seed: int = 0
    visible_weight: float = 0.0          # w of CE on revealed block tokens; 0 = the paper's loss
    log_every: int = 50
    checkpoint_every: int = 250          # steps between resumable checkpoints (0: none)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20))


def mode_delta(mode: str, delta: int | None = None) -> int:
    """Δ of a TAD student: ``delta`` when given, else the mode's (Quality 2, Speed 8)."""
    return delta if delta is not None else {"quality": QUALITY_DELTA, "speed": SPEED_DELTA}[mode]


@dataclass
class Trajectory:
    example: Example
    states: list[torch.Tensor]           # response after 0, 1, …, K steps (s_0 all masked)


def record_trajectories(teacher, examples: list[Example], is_correct, gen_length: int,
                        batch_size: int = 64) -> list[Trajectory]:
    """Teacher's reference-conditioned one-token-per-step trajectories; keeps those with
    ``is_correct(index, response_tokens)`` true."""
    B = teacher.config.block_size
    cfg = DecodeConfig(method="low_confidence", steps_per_block=B, gen_length=gen_length, record=True)
    mask = teacher.config.mask_token_id
    kept = []
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo:lo + batch_size]
        results = diffusion_generate(teacher, [e.reference_prompt for e in chunk], cfg)
        for i, (e, r) in enumerate(zip(chunk, results)):
            if is_correct(lo + i, r.tokens[:r.num_tokens]):
                s0 = torch.full((gen_length,), mask, dtype=torch.long)
                kept.append(Trajectory(e, [s0] + [s.cpu() for s in r.trajectory]))
    return kept


def current_block(prompt_len: int, state: torch.Tensor, mask_id: int, block_size: int) -> torch.Tensor:
    """bool [gen_length]: the response positions of the block holding the first mask of ``state``."""
    pos = prompt_len + torch.arange(state.shape[0])
    masked = (state == mask_id).nonzero()
    if len(masked) == 0:
        return torch.zeros_like(state, dtype=torch.bool)
    return pos // block_size == int(pos[masked[0, 0]]) // block_size


def partition(state_k: torch.Tensor, state_kd: torch.Tensor, mask_id: int, region: torch.Tensor | None = None):
    """(near, distant) bool masks: masked at k and revealed / still masked at k + Δ (inside region)."""
    masked = state_k == mask_id
    if region is not None:
        masked = masked & region
    still = state_kd == mask_id
    return masked & ~still, masked & still


def tad_loss(student_logits, teacher_logits, targets, near, distant, visible=None, visible_weight: float = 0.0) -> dict:
    """CE_near + KL_distant [+ w·CE_visible]: mean CE(student, target) over near rows + mean
    KL(teacher ‖ student) over distant rows [+ w · mean CE(student, target) over visible rows]
    (rows = positions; logits [N, V]; computed in float32, float64 for float64 logits)."""
    wide = lambda x: x.to(torch.promote_types(x.dtype, torch.float32))
    logp_s = F.log_softmax(wide(student_logits), -1)
    zero = logp_s.sum() * 0
    ce_of = lambda rows: -logp_s[rows].gather(-1, targets[rows, None]).mean() if bool(rows.any()) else zero
    ce = ce_of(near)
    if bool(distant.any()):
        logp_t = F.log_softmax(wide(teacher_logits), -1)[distant]
        kl = (logp_t.exp() * (logp_t - logp_s[distant])).sum(-1).mean()
    else:
        kl = zero
    if visible is None or visible_weight == 0:
        return {"loss": ce + kl, "ce_near": ce, "kl_distant": kl}
    vis = ce_of(visible)
    return {"loss": ce + kl + visible_weight * vis, "ce_near": ce, "kl_distant": kl, "ce_visible": vis}


def completed_block(prompt_len: int, before: torch.Tensor, after: torch.Tensor, mask_id: int,
                    block_size: int) -> torch.Tensor:
    """bool [gen_length]: the response positions of the block(s) whose last mask was filled going
    from ``before`` to ``after``; all False if none was."""
    block = (prompt_len + torch.arange(after.shape[0])) // block_size
    out = torch.zeros_like(after, dtype=torch.bool)
    for b in block[(before == mask_id) & (after != mask_id)].unique().tolist():
        region = block == b
        if not bool((after[region] == mask_id).any()):
            out |= region
    return out


def make_pairs(trajectories: list[Trajectory], delta: int, mask_id: int, block_size: int,
               completed_blocks: bool = False):
    """(trajectory index, k, region, near, distant, targets) for every k with a near or distant position;
    with ``completed_blocks`` also (t, k, block, ∅, ∅, s_k) for each step k that completes a block."""
    pairs = []
    for t, traj in enumerate(trajectories):
        K, P = len(traj.states) - 1, len(traj.example.prompt)
        for k in range(K):
            sk, skd = traj.states[k], traj.states[min(k + delta, K)]
            region = current_block(P, sk, mask_id, block_size)
            near, distant = partition(sk, skd, mask_id, region)
            if bool((near | distant).any()):
                pairs.append((t, k, region, near, distant, skd))
        for k in range(1, K + 1) if completed_blocks else ():
            done = completed_block(P, traj.states[k - 1], traj.states[k], mask_id, block_size)
            if bool(done.any()):
                pairs.append((t, k, done, torch.zeros_like(done), torch.zeros_like(done), traj.states[k]))
    return pairs


def _forward_rows(model, prompts, states, regions):
    """Logits at the region positions of prompt ‖ state (cut after the region's block)."""
    seqs = [list(p) + s[:int(r.nonzero().max()) + 1].tolist() for p, s, r in zip(prompts, states, regions)]
    dev = model.device
    hidden = model(torch.tensor([x for s in seqs for x in s], device=dev),
                   PaddedBlockAttention([len(s) for s in seqs], model.config.block_size, dev)).hidden
    rows, start = [], 0
    for p, s, r in zip(prompts, seqs, regions):
        rows.append(start + len(p) + r.nonzero().squeeze(-1))
        start += len(s)
    return model.logits(hidden[torch.cat(rows).to(dev)])


def distill(student, trajectories: list[Trajectory], cfg: TADConfig, teacher=None, on_log=None, until=None,
            checkpoint_dir=None, settings=None, run_log=None) -> list[dict]:
    """Train ``student`` in place on TAD pairs; ``teacher`` defaults to a frozen copy of it. Resumes
    from ``checkpoint_dir`` when it holds a checkpoint of the same ``settings`` (``arbor.train.loop.BatchTrainer``)."""
    teacher = teacher if teacher is not None else copy.deepcopy(student)
    teacher.eval().requires_grad_(False)
    mask_id, B = student.config.mask_token_id, student.config.block_size
    delta = SPEED_DELTA if cfg.delta is None else cfg.delta
    pairs = make_pairs(trajectories, delta, mask_id, B, completed_blocks=cfg.visible_weight > 0)
    if not pairs:
        raise ValueError("TAD has no training pairs: no correct teacher trajectory was recorded")

    def step(rng) -> dict:
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_size)]
        trajs = [trajectories[b[0]] for b in batch]
        states = [tr.states[b[1]] for tr, b in zip(trajs, batch)]
        regions = [b[2] for b in batch]
        sel = lambda i: torch.cat([b[i][b[2]] for b in batch]).to(student.device)
        logits_s = _forward_rows(student, [tr.example.prompt for tr in trajs], states, regions)
        with torch.no_grad():
            logits_t = _forward_rows(teacher, [tr.example.reference_prompt for tr in trajs], states, regions)
        visible = None
        if cfg.visible_weight:
            visible = torch.cat([(tr.states[b[1]] != mask_id)[b[2]] for tr, b in zip(trajs, batch)]).to(student.device)
        parts = tad_loss(logits_s, logits_t, sel(5), sel(3), sel(4), visible, cfg.visible_weight)
        parts["loss"].backward()
        return {**{k: v.detach() for k, v in parts.items()}, "tokens": int(sel(5).numel())}

    return BatchTrainer(student, cfg, step, settings).run(on_log, until, checkpoint_dir, run_log)


def teacher_trajectories(teacher, tokenizer, tasks: list[str], per_task: int, seed: int = 0) -> list[Trajectory]:
    """Correct reference-conditioned teacher trajectories on the training prompts of built-in tasks."""
    from arbor.dllm.sft import TASKS, task_examples
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; built-in diffusion tasks: {sorted(TASKS)}")
    out = []
    for i, task in enumerate(tasks):
        problems, examples = task_examples(tokenizer, task, per_task, seed + i, "train", teacher.config.block_size)
        ok = lambda j, toks, ps=problems, mod=TASKS[task]: mod.score(ps[j], tokenizer.decode(toks)) == 1.0
        out += record_trajectories(teacher, examples, ok, TASKS[task].GEN_LENGTH)
    return out


def cached_trajectories(path, key: dict, record) -> list[Trajectory]:
    """``record()``'s trajectories, saved to ``path`` with ``key`` (what they were recorded from) and
    loaded from there instead when an earlier run with the same key left them."""
    path = Path(path)
    if path.exists():
        saved = torch.load(path, weights_only=False)
        if saved["key"] == key:
            return saved["trajectories"]
    trajectories = record()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "trajectories": trajectories}, path.with_suffix(".part"))
    path.with_suffix(".part").rename(path)
    return trajectories


@dataclass
class DistillRunConfig:
    """``arbor dllm-distill``: TAD students of a block-diffusion checkpoint."""
    model: str = ""                      # block-diffusion checkpoint (teacher and initial student)
    out: str = "runs/tad"                # folder for the quality/ and speed/ students (each an HF folder)
    mode: str = "both"                   # quality | speed | both
    per_task: int = 1000                 # training prompts per task for the teacher
    tasks: list[str] = field(default_factory=list)   # distil on these tasks only (empty: every built-in task)
    device: str = "cpu"
    tad: TADConfig = field(default_factory=TADConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        from arbor.configs import check
        from arbor.dllm.sft import TASKS
        check(self, (bool(self.model), "model", "must name a block-diffusion checkpoint folder (model=DIR)"),
              (self.mode in ("quality", "speed", "both"), "mode", "must be quality, speed or both"),
              (self.per_task >= 1, "per_task", "must be ≥ 1"),
              (all(t in TASKS for t in self.tasks), "tasks", f"must name tasks of {sorted(TASKS)}"))


def distill_folder(cfg: DistillRunConfig, on_log=None) -> dict:
    """Load a block-diffusion checkpoint, record its trajectories, write one student per mode
    (``out/quality`` with Δ = QUALITY_DELTA, ``out/speed`` with Δ = SPEED_DELTA unless ``tad.delta``
    is set for a single mode) as HF-layout folders; → {mode: folder}. Nothing is lost to a crash: the
    trajectories are kept in ``out/trajectories.pt`` and each student's training resumes from
    ``out/<mode>/checkpoint`` (rows in ``out/<mode>/metrics.jsonl``)."""
    from dataclasses import replace

    from arbor.models import load_model, save_model
    from arbor.models.tokenizer import Tokenizer
    from arbor.dllm.sft import TASKS
    model_dir, out_dir, device = cfg.model, Path(cfg.out), cfg.device
    modes = ("quality", "speed") if cfg.mode == "both" else (cfg.mode,)
    tok = Tokenizer.load(model_dir)
    teacher = load_model(model_dir, device=device).eval()
    source = {"teacher": str(Path(model_dir).resolve()), "tasks": list(cfg.tasks or TASKS), "per_task": cfg.per_task,
              "seed": cfg.tad.seed}
    trajectories = cached_trajectories(out_dir / "trajectories.pt", source, lambda: teacher_trajectories(
        teacher, tok, source["tasks"], cfg.per_task, cfg.tad.seed))
    print(f"TAD: {len(trajectories)} correct teacher trajectories", flush=True)
    out = {}
    for mode in modes:
        delta = mode_delta(mode, cfg.tad.delta if len(modes) == 1 else None)
        student = load_model(model_dir, device=device)
        mode_cfg = replace(cfg.tad, delta=delta)
        run_log = RunLog(out_dir / mode, cfg, mode_cfg.steps, cfg.log, name=f"tad-{mode}")
        distill(student, trajectories, mode_cfg, teacher=teacher, on_log=on_log, checkpoint_dir=out_dir / mode / "checkpoint",
                settings={**source, "tad": settings_of(mode_cfg)}, run_log=run_log)
        out[mode] = save_model(student, out_dir / mode, tokenizer=tok)
    return out
