"""Group advantages: every sample of a group answers the same prompt (the leaves under one
rollout-tree root).

- GRPO:  A_i = (R_i − mean(R)) / (std(R) + eps)   (``normalize_std=False`` keeps R_i − mean(R))
- RLOO:  A_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean(R))
A group whose rewards are all equal gets A = 0 (no signal, no update).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, method: str = "grpo",
                     normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [S], group [S] (group id of each sample) → advantages [S]."""
    if method not in ("grpo", "rloo"):
        raise ValueError(f"advantage method must be grpo or rloo, got '{method}'")
    rewards = rewards.double()
    _, inverse = torch.unique(group, return_inverse=True)
    n = int(inverse.max()) + 1 if len(inverse) else 0
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    if method == "rloo":
        g = count[inverse]
        return (centred * g / (g - 1).clamp(min=1)).float()
    if normalize_std:
        var = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, centred ** 2) / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt()[inverse] + eps)
    return centred.float()
