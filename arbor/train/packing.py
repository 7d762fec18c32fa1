"""Micro-batches by token budget: sequences are packed (no padding) into micro-batches of at
most ``max_tokens`` tokens each (a longer sequence gets a micro-batch of its own), first-fit
decreasing, so that every micro-batch is one VarlenAttention forward."""

from __future__ import annotations


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """→ lists of sequence indices; every index appears exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins
