"""Model layer shared by the engine and the trainer: configs, layers, one CausalLM, checkpoints."""

from arbor.models.attention import BlockDiffusionAttention, TreeAttention, VarlenAttention, sdpa
from arbor.models.causal_lm import CausalLM, ModelOutput
from arbor.models.checkpoint import CheckpointError, load_model, save_model
from arbor.models.config import ConfigError, ModelConfig
from arbor.models.moe import expert_counts
from arbor.models.tree_attention import SegmentTreeAttention

__all__ = [
    "BlockDiffusionAttention", "CausalLM", "CheckpointError", "ConfigError", "ModelConfig", "ModelOutput",
    "SegmentTreeAttention", "TreeAttention", "VarlenAttention", "expert_counts", "load_model", "save_model", "sdpa",
]
