"""``arbor train`` on a block-diffusion model: GRPO-style RL with LLaDA2.1's EBPO ratio (or its per-block
variant, ESPO, or the mean-field baseline: ``dllm.estimator``, see ``arbor.dllm.ebpo``), sharing the RL
job's config (``RLConfig`` with its ``dllm`` section), the trainer loop (``arbor.train.rl.rl_run``:
``RunLog``, checkpoints and resume) and its ``run / evaluate`` shape, so ``arbor train`` and ``arbor
eval`` drive either trainer.

One step:
  1. ``groups_per_step`` training problems of the task (a diffusion task: sudoku, countdown,
     addition), each decoded ``dllm.group_size`` times in one batch by the diffusion decoder
     (``dllm.mode`` preset at the model's block size, ``dllm.temperature`` sampling, seed from
     (seed, step) so a resumed run draws the same rollouts);
  2. rewards = the task's score of each decoded answer; advantages per group (``advantage``, GRPO
     or RLOO); samples with A = 0 take no forward (they add nothing but still count in the mean);
  3. noise drawn once per step (``draw_noise``; ``draw_espo_noise`` for ESPO), then per mini-batch:
     log-likelihood units at θ_old (no gradient), and for ``ppo_epochs`` passes the clipped
     surrogate ``ebpo_loss`` and an optimizer step — the same masks for θ_old and θ, so the first
     update has r ≡ 1.
Single process only (``arbor launch`` is refused).
"""

from __future__ import annotations

import random
import time

import torch

from arbor.distributed import DistContext
from arbor.dllm.decoding import DecodeConfig, diffusion_generate, mode_config
from arbor.train.advantages import group_advantages
from arbor.dllm.ebpo import draw_espo_noise, draw_noise, ebpo_loss, unit_logprobs
from arbor.train.checkpoint import settings_of
from arbor.train.optim import make_optimizer, optimizer_step
from arbor.train.rl import rl_run

STATS = ("clip_low", "clip_high", "dual_clip_frac", "approx_kl")


def decode_config(mode: str, gen_length: int, **kw) -> DecodeConfig:
    """The named decoding mode at the model's own block size (``arbor.dllm.decoding.mode_config``)."""
    return mode_config(mode, gen_length=gen_length, **kw)


class EBPOTrainer:
    def __init__(self, cfg, model, tokenizer, task_name: str, ctx=None):
        from arbor.tasks.registry import get_diffusion_task
        self.cfg, self.model, self.tok, self.task_name = cfg, model, tokenizer, task_name
        self.task = get_diffusion_task(task_name)
        self.ctx = ctx or DistContext.single()
        self.optimizer = make_optimizer(model, cfg.optim)
        self.problems = self.task.generate(max(512, cfg.steps * cfg.groups_per_step), seed=cfg.seed, split="train")
        self.step, self.next_problem = 0, 0
        self.history: list[dict] = []
        self.last_eval: dict = {}

    # ---- rollouts -------------------------------------------------------------------------
    def decode(self, problems, mode: str, temperature: float = 0.0, seed: int = 0):
        """→ (scores, DecodeResults, prompt ids) of ``problems`` decoded in one batch."""
        prompts = [self.tok.encode(p.prompt) for p in problems]
        cfg = decode_config(mode, self.task.GEN_LENGTH, temperature=temperature, seed=seed)
        self.model.eval()
        results = diffusion_generate(self.model, prompts, cfg, [self.tok.eos_token_id])
        scores = [self.task.score(p, self.tok.decode(r.tokens[:r.num_tokens])) for p, r in zip(problems, results)]
        return scores, results, prompts

    def response(self, tokens: list[int]) -> list[int]:
        """The decoded response positions (blocks never reached still hold the mask: dropped)."""
        mask = self.model.config.mask_token_id
        return tokens[:tokens.index(mask)] if mask in tokens else list(tokens)

    # ---- one step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        c, d = self.cfg, self.cfg.dllm
        t0 = time.perf_counter()
        problems = [self.problems[(self.next_problem + i) % len(self.problems)] for i in range(c.groups_per_step)]
        self.next_problem += c.groups_per_step
        batch = [p for p in problems for _ in range(d.group_size)]
        scores, results, prompts = self.decode(batch, d.mode, d.temperature, seed=c.seed * 1_000_003 + self.step)
        t1 = time.perf_counter()
        rewards = torch.tensor(scores, dtype=torch.float32)
        groups = torch.arange(len(problems)).repeat_interleave(d.group_size)
        adv = group_advantages(rewards, groups, c.advantage, c.normalize_std)
        keep = [i for i in range(len(batch)) if float(adv[i]) != 0.0]
        row = {"step": self.step, "reward": float(rewards.mean()), "samples": len(batch), "trained_samples": len(keep),
               "tpf": sum(r.num_tokens for r in results) / max(1, sum(r.forwards for r in results))}
        stats, norms, loss_sum, lr = {}, [], 0.0, float("nan")
        if keep:
            x = [prompts[i] for i in keep]
            y = [self.response(results[i].tokens) for i in keep]
            lens, seed = ([len(p) for p in x], [len(r) for r in y]), c.seed * 1_000_003 + self.step
            noise = (draw_espo_noise(*lens, d.espo_mc, seed=seed) if d.estimator == "espo"
                     else draw_noise(*lens, d.levels, d.prompt_mask_prob, seed=seed))
            parts = [keep_idx for keep_idx in (list(range(len(keep)))[m::c.mini_batches] for m in range(c.mini_batches))
                     if keep_idx]
            sub = lambda idx: ([x[i] for i in idx], [y[i] for i in idx], noise.select(idx))
            with torch.no_grad():
                old = [unit_logprobs(self.model, *sub(idx), d.estimator)[0] for idx in parts]
            self.model.train()
            for _ in range(c.ppo_epochs):
                for idx, lp_old in zip(parts, old):
                    logp, valid = unit_logprobs(self.model, *sub(idx), d.estimator)
                    n = round(len(batch) * len(idx) / len(keep))          # this part's share of all samples
                    loss, st = ebpo_loss(logp, lp_old, valid, adv[[keep[i] for i in idx]], c.loss, max(1, n))
                    loss.backward()
                    opt = optimizer_step(self.model, self.optimizer, self.step, c.steps, c.optim, self.ctx)
                    if not opt["skipped"]:
                        norms.append(opt["grad_norm"])
                    lr, loss_sum = opt["lr"], loss_sum + float(loss.detach())
                    for k in STATS:
                        stats[k] = stats.get(k, 0.0) + st[k] * st["tokens"]
                    stats["units"] = stats.get("units", 0.0) + st["tokens"]
            self.model.eval()
        units = stats.pop("units", 0.0)
        row.update({k: v / max(1.0, units) for k, v in stats.items()})
        row.update(loss=loss_sum / max(1, c.ppo_epochs * c.mini_batches), lr=lr, optimizer_steps=len(norms),
                   grad_norm=sum(norms) / len(norms) if norms else float("nan"),
                   rollout_s=t1 - t0, train_s=time.perf_counter() - t1)
        self.step += 1
        return row

    # ---- eval -----------------------------------------------------------------------------
    async def evaluate(self, n: int | None = None, split: str = "test", progress: bool = False,
                       mode: str | None = None) -> float:
        """Held-out accuracy (mean task score) with greedy ``dllm.eval_mode`` decoding; the TPF of
        the same decode is left in ``self.last_eval``."""
        probs = self.task.generate(n or self.cfg.eval_problems, seed=self.cfg.seed + 1, split=split)
        scores, results, _ = self.decode(probs, mode or self.cfg.dllm.eval_mode)
        self.last_eval = {"accuracy": sum(scores) / max(1, len(scores)),
                          "tpf": sum(r.num_tokens for r in results) / max(1, sum(r.forwards for r in results))}
        return self.last_eval["accuracy"]

    # ---- checkpoints (arbor.train.checkpoint) ---------------------------------------------
    @property
    def settings(self) -> dict:
        return settings_of(self.cfg)

    def state_dict(self) -> dict:
        return {"next_problem": self.next_problem, "python_rng": random.getstate()}

    def load_state_dict(self, s: dict) -> None:
        self.next_problem = s["next_problem"]
        random.setstate(s["python_rng"])

    async def eval_row(self) -> dict:
        """Held-out accuracy and tokens per forward, every ``eval_every`` steps of the loop."""
        return {"test_accuracy": await self.evaluate(), "test_tpf": self.last_eval["tpf"]}

    async def run(self, on_row=None, stop_after: int | None = None) -> list[dict]:
        """Train to ``cfg.steps`` with the RL jobs' loop (``arbor.train.rl.rl_run``)."""
        return await rl_run(self, "ebpo", on_row, stop_after)


def build_ebpo_trainer(cfg) -> EBPOTrainer:
    """``build_trainer``'s branch for a block-diffusion model folder."""
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    import os
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("RL on a block-diffusion model runs in one process; run `arbor train` without `arbor launch`")
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, dtype=torch.float32, device=cfg.device).eval()
    return EBPOTrainer(cfg, model, Tokenizer.load(cfg.model), cfg.task)
