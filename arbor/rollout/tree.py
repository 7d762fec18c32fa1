"""Rollout trees: a root (the prompt) whose descendants are token segments, model-written or
environment-written; branching at a turn gives several children. Every root-to-leaf path is
one trajectory; the leaves under one root form one GRPO group.

Invariants: a trajectory's ``tokens`` are exactly the ids the engine saw (segments are
concatenated, never re-tokenized); ``loss_mask``, ``logp_infer`` and ``versions`` align with
``tokens`` (env tokens: mask 0, logp 0, version −1); ``routed_experts`` (MoE) holds, per model
segment, the engine's expert ids [num_moe_layers, len(segment), k], and a trajectory's
[num_moe_layers, len(tokens), k] aligns them with its tokens (−1 where the engine routed nothing:
prompt and environment tokens, and the last token of a turn, which the engine never fed back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Segment:
    tokens: list[int]
    is_model: bool
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None

    def __post_init__(self):
        if self.is_model and not (len(self.logprobs) == len(self.versions) == len(self.tokens)):
            raise ValueError(f"model segment of {len(self.tokens)} tokens has {len(self.logprobs)} log-probs "
                             f"and {len(self.versions)} versions; they must align")


@dataclass
class Node:
    segment: Segment
    children: list["Node"] = field(default_factory=list)
    reward: float | None = None        # set on leaves
    text: str = ""                     # decoded model turn (for logs)


@dataclass
class Trajectory:
    tokens: list[int]
    loss_mask: list[int]
    logp_infer: list[float]
    versions: list[int]
    reward: float
    group: int
    prompt_len: int
    routed_experts: torch.Tensor | None = None
    final_text: str = ""

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RolloutTree:
    root: Node
    group: int
    task: object = None

    def trajectories(self) -> list[Trajectory]:
        out: list[Trajectory] = []

        def walk(node: Node, path: list[Node]):
            path = path + [node]
            if not node.children:
                out.append(self._trajectory(path))
            for child in node.children:
                walk(child, path)

        walk(self.root, [])
        return out

    def _trajectory(self, path: list[Node]) -> Trajectory:
        tokens, mask, logp, vers, routed = [], [], [], [], []
        for node in path:
            s = node.segment
            if s.routed_experts is not None:
                routed.append((len(tokens), s.routed_experts))
            tokens += s.tokens
            mask += [int(s.is_model)] * len(s.tokens)
            logp += s.logprobs if s.is_model else [0.0] * len(s.tokens)
            vers += s.versions if s.is_model else [-1] * len(s.tokens)
        routing = None
        if routed:
            layers, _, k = routed[0][1].shape
            routing = torch.full((layers, len(tokens), k), -1, dtype=routed[0][1].dtype)
            for start, r in routed:
                routing[:, start:start + r.shape[1]] = r
        leaf = path[-1]
        last_model = next((n for n in reversed(path) if n.segment.is_model), leaf)
        return Trajectory(tokens, mask, logp, vers, float(leaf.reward or 0.0), self.group,
                          len(path[0].segment.tokens), routing, last_model.text)

    def num_tokens(self) -> tuple[int, int]:
        """(tokens over all trajectories, tokens in the tree counting each shared prefix once)."""
        total = sum(len(t.tokens) for t in self.trajectories())

        def count(node: Node) -> int:
            return len(node.segment.tokens) + sum(count(c) for c in node.children)

        return total, count(self.root)
