"""Multi-rank runtime: launch, the rank context and its process groups, expert-parallel exchanges,
the in-order device queue and the P/D turnstile."""

from arbor.dist.all_to_all import TagMismatchError, all_to_all, exchange_counts
from arbor.dist.context import (CollectiveError, DistConfig, DistContext, env_world_size, init_distributed,
                                resolve_ep_size, shutdown)
from arbor.dist.device_queue import DeviceQueue
from arbor.dist.turnstile import Turnstile

__all__ = ["CollectiveError", "DeviceQueue", "DistConfig", "DistContext", "TagMismatchError", "Turnstile",
           "all_to_all", "env_world_size", "exchange_counts", "init_distributed", "resolve_ep_size", "shutdown"]
