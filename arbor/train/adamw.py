"""AdamW on PyTorch's fused kernel without ``torch.optim``: same update, same kernel, same ``state_dict``.

``torch.optim.AdamW`` imports ``torch._dynamo`` in ``Optimizer.__init__`` and in every ``step`` (its
``_disable_dynamo`` / ``_use_grad`` wrappers): 1.2–1.4 s of every run's start-up, whatever the model's
size (AMD EPYC Zen 4; a third of ``arbor train``'s time to its first step on the tiny model). This class calls
the kernel ``torch.optim.AdamW(fused=True)`` calls, ``torch._fused_adamw_``, on each (device, dtype,
sharded) bucket of a parameter group, so the weights it produces are bit-identical to PyTorch's
(``tests/test_adamw.py`` checks it in float64). On a device the fused kernel does not serve (not CPU or
CUDA) the same update runs as plain tensor ops (``reference_step``).

Update of parameter p with gradient g at step t (lr η, decoupled weight decay λ)::

    p ← p·(1 − ηλ);  m ← β₁·m + (1 − β₁)·g;  v ← β₂·v + (1 − β₂)·g²
    p ← p − η · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)

State per parameter, as PyTorch keeps it: ``step`` (a float32 scalar tensor on the parameter's device),
``exp_avg`` (m) and ``exp_avg_sq`` (v), shaped and typed as the parameter (DTensors for FSDP's
sharded ones). ``state_dict`` / ``load_state_dict`` use ``torch.optim``'s layout (states indexed by the
parameter's position over all groups), so a checkpoint written by either optimizer loads into the other.
"""

from __future__ import annotations

import torch

FUSED_DEVICES = ("cpu", "cuda")
HYPER = ("lr", "betas", "eps", "weight_decay")       # a group's settings (besides "params")


class AdamW:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay, fused=True)``'s update and state."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict] = {}
        seen = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in seen}) != len(seen):
            raise ValueError("a parameter appears in more than one place of the optimizer's parameter groups")

    def _state(self, p: torch.Tensor) -> dict:
        s = self.state.get(p)
        if s is None:
            s = self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return s

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient."""
        for g in self.param_groups:
            buckets: dict[tuple, list[torch.Tensor]] = {}
            for p in g["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise ValueError("AdamW does not take sparse gradients")
                    buckets.setdefault((p.device, p.dtype, type(p)), []).append(p)
            b1, b2 = g["betas"]
            for (device, _, _), ps in buckets.items():
                states = [self._state(p) for p in ps]
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1)
                args = (ps, [p.grad for p in ps], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states])
                if device.type in FUSED_DEVICES and ps[0].is_floating_point():
                    torch._fused_adamw_(*args, [], steps, lr=g["lr"], beta1=b1, beta2=b2,
                                        weight_decay=g["weight_decay"], eps=g["eps"], amsgrad=False, maximize=False)
                else:
                    for p, grad, m, v, t in zip(*args, steps):
                        reference_step(p, grad, m, v, float(t), g["lr"], b1, b2, g["weight_decay"], g["eps"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict``'s layout: {"state": {index: {...}}, "param_groups": [{…, "params":
        [index, …]}]}; indices count parameters over all groups in order."""
        index, groups, i = {}, [], 0
        for g in self.param_groups:
            ids = list(range(i, i + len(g["params"])))
            index.update({id(p): j for p, j in zip(g["params"], ids)})
            groups.append({k: g[k] for k in HYPER} | {"fused": True, "params": ids})
            i += len(ids)
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take ``state_dict``'s states and group settings (``torch.optim``'s or this class's), matched to this
        optimizer's parameters by position; moments are cast to each parameter's dtype and device, steps to
        float32 on its device."""
        saved = state_dict["param_groups"]
        sizes = ([len(g["params"]) for g in saved], [len(g["params"]) for g in self.param_groups])
        if sizes[0] != sizes[1]:
            raise ValueError(f"the saved optimizer state has parameter groups of sizes {sizes[0]}, this optimizer "
                             f"{sizes[1]}: it was written for another model or another set of trained parameters")
        params = {}
        for old, g in zip(saved, self.param_groups):
            g.update({k: tuple(old[k]) if k == "betas" else old[k] for k in HYPER if k in old})
            params.update(zip(old["params"], g["params"]))
        self.state = {}
        for i, s in state_dict["state"].items():
            p = params[i]
            self.state[p] = {k: v.to(dtype=torch.float32, device=p.device) if k == "step" else
                             v.to(dtype=p.dtype, device=p.device) if torch.is_tensor(v) and p.is_floating_point() else v
                             for k, v in s.items()}


def reference_step(p, grad, m, v, t: float, lr: float, b1: float, b2: float, weight_decay: float, eps: float) -> None:
    """The update of the module docstring on one parameter, in plain tensor ops (in place)."""
    p.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
