"""Multi-rank runtime over torch.distributed: launch, the rank context and its process groups,
the tag-checked expert-parallel all-to-all, collective timeouts."""

from arbor.distributed.all_to_all import TagMismatchError, all_to_all, exchange_counts
from arbor.distributed.context import (CollectiveError, DistConfig, DistContext, env_world_size, init_distributed,
                                       resolve_ep_size, shutdown)

__all__ = ["CollectiveError", "DistConfig", "DistContext", "TagMismatchError",
           "all_to_all", "env_world_size", "exchange_counts", "init_distributed", "resolve_ep_size", "shutdown"]
