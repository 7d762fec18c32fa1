"""The policy-gradient update of one RL step on its trajectories (``RLTrainer``'s training half).

Given a step's trajectories (tokens as sampled, loss masks, the engine's log-probs μ, rewards):

1. advantages per group (``advantage``: GRPO or RLOO, ``arbor.train.advantages``);
2. θ_old's log-probs (and the frozen reference's, with ``loss.kl_coef`` > 0) by a no-grad pass —
   or, when exact, from the training forward itself (``skips_recompute``);
3. ``ppo_epochs`` passes over the samples, each ``mini_batches`` optimizer steps on whole groups;
   a mini-batch's loss is ``policy_loss`` (PPO clip, IcePop / TIS against μ) averaged over its
   trained tokens (``loss.agg=token``) or samples (``sequence``) of all ranks, accumulated over
   micro-batches of ≤ ``tree.token_cap`` tokens.

Which rank trains which sample in which micro-batch is the step's layout (``arbor.train.step_layout``);
the local one: first-fit-decreasing bins (``arbor.plan.packing``) of the rank's trajectories, or, in tree
mode, of whole groups counted by their compact tokens (each shared prefix once). Under expert
parallelism every rank runs as many forward(+backward) passes as the busiest (idle passes).
"""

from __future__ import annotations

import torch

from arbor.plan.packing import first_fit_decreasing
from arbor.train.advantages import group_advantages
from arbor.train.distributed import global_count, run_idle_passes
from arbor.train.fsdp import is_fsdp
from arbor.train.logprobs import packed_logprobs
from arbor.train.precision import autocast, upcast
from arbor.train.step_layout import local_layout
from arbor.train.losses import policy_loss
from arbor.train.optim import optimizer_step
from arbor.train.tree_batch import build_tree
from arbor.train.tree_forward import tree_packed_logprobs

# token-weighted means over a step's optimizer steps (moe_aux: sample share; entropy: of π_old, recompute pass)
SUMMED_STATS = ("masked_frac", "mismatch_abs", "clip_low", "clip_high", "dual_clip_frac", "approx_kl", "kl_ref", "moe_aux")


def flat(trajs, key) -> list:
    return [x for t in trajs for x in getattr(t, key)]


class PolicyUpdate:
    """The update methods of ``RLTrainer`` (which sets ``cfg``, ``model``, ``optimizer``, ``reference``
    (None without a KL term), ``spec`` (the sampling distribution's temperature / top-p), ``ctx`` and
    ``step``)."""

    def micro_batches(self, trajs) -> list[list[int]]:
        """Trajectory indices per micro-batch, ≤ tree.token_cap tokens each. Tree mode keeps a
        group together and counts its compact tokens (each shared prefix once)."""
        cap = self.cfg.tree.token_cap
        if not self.cfg.tree.enabled:
            return first_fit_decreasing([len(t.tokens) for t in trajs], cap)
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            groups.setdefault(t.group, []).append(i)
        units = list(groups.values())
        sizes = [build_tree([trajs[i].tokens for i in u]).num_tokens for u in units]
        return [[i for b in bin_ for i in units[b]] for bin_ in first_fit_decreasing(sizes, cap)]

    def logprobs(self, trajs, with_aux: bool = False, model=None, entropy: list | None = None):
        """Per-token log-probs of the sampling distribution (``self.spec``), flat in trajectory order
        (tree forward or packed trajectories). With ``replay_routing`` each MoE layer sends a model
        token to the experts the engine chose for it, so a near-tie in top-k cannot route trainer and
        engine differently; tokens the engine did not route (id −1: prompt, environment, a turn's last
        token) route themselves."""
        model = model or self.model
        seqs = [t.tokens for t in trajs]
        routed = None
        if self.cfg.replay_routing and trajs and all(t.routed_experts is not None for t in trajs):
            routed = torch.cat([t.routed_experts for t in trajs], 1).to(model.device)
        kw = dict(routed_experts=routed, with_aux=with_aux, spec=self.spec, entropy=entropy)
        with autocast(self.cfg.dtype, model.device):       # float32 unless dtype=bfloat16 (arbor.train.precision)
            if self.cfg.tree.enabled:
                out = tree_packed_logprobs(model, seqs, cfg=self.cfg.tree, **kw)
            else:
                out = packed_logprobs(model, seqs, **kw)
        return (upcast(out[0]), *out[1:])

    def recompute_old(self, trajs, layout=None):
        """→ (logp_old per trajectory: the trainer's log-probs at θ_old, logp_ref per trajectory or
        None, {entropy sum, tokens} of π_old over the loss tokens); no gradient. ``layout``: the step's
        ``StepLayout`` (``trajs`` are then its trajectories; its micro-batches are used)."""
        old, ref = [None] * len(trajs), [None] * len(trajs) if self.reference is not None else None
        ent = [0.0, 0.0]
        micros = layout.micros if layout is not None else self.micro_batches(trajs)
        missing = self._missing_passes(len(micros))
        with torch.no_grad():
            for micro in micros:
                sub, entropy = [trajs[i] for i in micro], []
                logp, cu = self.logprobs(sub, entropy=entropy)
                mask = torch.tensor(flat(sub, "loss_mask"), dtype=torch.float32, device=logp.device)
                ent[0] += float((entropy[0] * mask).sum())
                ent[1] += float(mask.sum())
                refp = self.logprobs(sub, model=self.reference)[0] if ref is not None else None
                for j, i in enumerate(micro):
                    old[i] = logp[cu[j]:cu[j + 1]]
                    if ref is not None:
                        ref[i] = refp[cu[j]:cu[j + 1]]
            self._idle_passes(missing, with_reference=ref is not None)
        return old, ref, ent

    def advantages(self, trajs) -> torch.Tensor:
        """Per-sample advantages over each group (``advantage``: GRPO or RLOO), the groups whole in ``trajs``."""
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        return group_advantages(rewards, torch.tensor([t.group for t in trajs], dtype=torch.long),
                                self.cfg.advantage, self.cfg.normalize_std)

    @property
    def skips_recompute(self) -> bool:
        """True when the log-prob pass at θ_old cannot change anything, so it is skipped: one optimizer
        step per RL step (``ppo_epochs = mini_batches = 1``: every micro-batch's training forward runs
        at θ_old, so ``logp.detach()`` *is* logp_old, bit for bit) and no frozen reference to score.
        The mismatch correction (IcePop/TIS) still sees θ_old vs the engine; the entropy of π_old
        comes from the same forward. Logged as ``recompute_skipped``."""
        c = self.cfg
        return c.old_logprobs == "auto" and c.ppo_epochs == 1 and c.mini_batches == 1 and self.reference is None

    def _missing_passes(self, mine: int) -> int:
        """Under expert parallelism or FSDP every rank runs as many forward(+backward) passes as the busiest:
        → how many this rank, with ``mine`` micro-batches, must add. Asked before the passes (a collective
        of its own: a rank done early must not wait in it while another still exchanges)."""
        if getattr(self.model, "ep_state", None) is None and not is_fsdp(self.model):
            return 0
        return global_count(mine, self.ctx) - mine

    def _idle_passes(self, missing: int, with_reference: bool = False) -> None:
        """``missing`` idle passes (``_missing_passes``), each (``with_reference``) also through the frozen
        reference. Under FSDP the reference is whole (no all-gathers), so a missing micro-batch is one idle
        pass of the policy, then one of the reference (its expert exchanges alone), in the busiest rank's order."""
        ep = getattr(self.model, "ep_state", None) is not None
        if not missing:
            return
        if not is_fsdp(self.model):      # expert exchanges only: a policy pass and a reference pass are alike
            run_idle_passes(self.model, missing * (2 if with_reference else 1))
            return
        for _ in range(missing):
            run_idle_passes(self.model, 1)
            if with_reference and ep:
                run_idle_passes(self.reference, 1)

    def mini_batches(self, trajs) -> list[list[int]]:
        """``mini_batches`` parts of the step's samples, whole groups each (round-robin over groups
        in order), so every optimizer step sees complete groups."""
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            groups.setdefault(t.group, []).append(i)
        parts: list[list[int]] = [[] for _ in range(self.cfg.mini_batches)]
        for g, members in enumerate(groups.values()):
            parts[g % len(parts)].extend(members)
        return parts

    def train_on(self, trajs, logp_old, logp_ref=None, entropy: list | None = None, layout=None) -> dict:
        """``ppo_epochs`` passes over the samples, each ``mini_batches`` optimizer steps; advantages
        once per step. The first optimizer step has r ≡ 1; later ones see how far θ moved from θ_old,
        so the clip and the dual clip act. → step metrics (token-weighted over all optimizer steps).
        ``logp_old`` None (only with one optimizer step, ``skips_recompute``): each micro-batch's own
        forward, detached, is θ_old's; ``entropy`` then receives [entropy sum, tokens] of π_old.
        ``layout``: the step's ``StepLayout`` (``arbor.train.step_layout``; ``trajs`` are its
        trajectories, its advantages and micro-batches are used); default: the local one."""
        if logp_old is None and self.cfg.ppo_epochs * self.cfg.mini_batches != 1:
            raise ValueError("logp_old may be None only with one optimizer step per RL step")
        if layout is None:
            layout = local_layout(self, trajs, self.advantages(trajs))
        adv = layout.adv
        stats, norms, skipped = {}, [], 0.0
        aux = self.model.config.moe_layers and self.cfg.moe_aux_coef > 0
        self.model.train()
        for _ in range(self.cfg.ppo_epochs):
            for micros in layout.minis:
                self._train_mini(trajs, micros, adv, logp_old, logp_ref, stats, entropy)
                opt = optimizer_step(self.model, self.optimizer, self.step, self.cfg.steps, self.cfg.optim, self.ctx)
                if opt["skipped"]:
                    skipped += 1
                else:
                    norms.append(opt["grad_norm"])
        self.model.eval()
        out = self._reduce_stats(stats, aux)
        nan = float("nan")
        out.update(grad_norm=sum(norms) / len(norms) if norms else nan, grad_norm_max=max(norms, default=nan),
                   lr=opt["lr"], optimizer_steps=len(norms), skipped_steps=skipped)
        return out

    def _train_mini(self, trajs, micros: list[list[int]], adv, logp_old, logp_ref, stats: dict,
                    entropy: list | None = None) -> None:
        """Forward + backward of one mini-batch (its micro-batches: indices into ``trajs``); the loss is the
        aggregate (``loss.agg``) over the mini-batch's samples or trained tokens of all ranks. Accumulates
        token-weighted loss statistics in ``stats``."""
        dev = self.model.device
        mini = [i for m in micros for i in m]
        n = global_count(len(mini), self.ctx, "sum", "samples")
        n_tokens = global_count(sum(trajs[i].num_model_tokens for i in mini), self.ctx, "sum", "trained tokens") \
            if self.cfg.loss.agg == "token" else None
        aux_coef = self.cfg.moe_aux_coef if self.model.config.moe_layers else 0.0
        pos = {t: p for p, t in enumerate(mini)}          # sample index inside the mini-batch
        missing = self._missing_passes(len(micros))
        for micro in micros:
            sub = [trajs[i] for i in micro]
            ent = [] if entropy is not None else None
            logp, _, *aux = self.logprobs(sub, with_aux=aux_coef > 0, entropy=ent)
            lengths = torch.tensor([len(t.tokens) for t in sub], device=dev)
            mask = torch.tensor(flat(sub, "loss_mask"), device=dev)
            if ent is not None:
                entropy[0] += float((ent[0] * mask).sum())
                entropy[1] += float(mask.sum())
            old = logp.detach() if logp_old is None else torch.cat([logp_old[i] for i in micro]).to(dev)
            loss, st = policy_loss(
                logp, old, torch.tensor(flat(sub, "logp_infer"), device=dev),
                torch.repeat_interleave(adv[micro].to(dev), lengths), mask,
                torch.repeat_interleave(torch.tensor([pos[i] for i in micro], device=dev), lengths),
                max(n, 1), self.cfg.loss,
                logp_ref=torch.cat([logp_ref[i] for i in micro]).to(dev) if logp_ref is not None else None,
                num_tokens=n_tokens)
            if aux:   # this micro-batch's share of the mini-batch's sample mean
                loss = loss + aux_coef * aux[0] * len(micro) / n
                stats["moe_aux"] = stats.get("moe_aux", 0.0) + float(aux[0].detach()) * len(micro) / n
            loss.backward()
            stats["loss_sum"] = stats.get("loss_sum", 0.0) + float(loss.detach())
            w = st.pop("tokens")
            for k, v in st.items():
                stats[k] = max(stats.get(k, 0.0), v) if k == "max_k" else stats.get(k, 0.0) + v * w
            stats["tokens"] = stats.get("tokens", 0.0) + w
        self._idle_passes(missing)

    def _reduce_stats(self, stats: dict, aux: bool) -> dict:
        """Token-weighted sums (and max k) of this rank → the step's values over all ranks."""
        keys = [k for k in SUMMED_STATS if (k != "moe_aux" or aux) and (k != "kl_ref" or self.reference is not None)]
        sums = [stats.get(k, 0.0) for k in keys] + [stats.get("tokens", 0.0)]
        max_k = stats.get("max_k", 0.0)
        sums.append(stats.get("loss_sum", 0.0))
        if self.ctx.distributed:
            sums = self.ctx.sum_floats(sums, "loss stats")
            max_k = self.ctx.flags_max(max_k, name="max k")[0]
        tokens, loss_sum = sums[-2], sums[-1]
        steps = self.cfg.ppo_epochs * self.cfg.mini_batches
        out = {k: v / steps if k == "moe_aux" else v / max(1.0, tokens) for k, v in zip(keys, sums)}
        return {**out, "loss": loss_sum / steps, "max_k": max_k, "tokens": tokens / self.cfg.ppo_epochs}
