"""Model layer shared by the engine and the trainer: configs, layers, one CausalLM, checkpoints."""

from arbor.models.attention import BlockDiffusionAttention, TreeAttention, VarlenAttention
from arbor.models.causal_lm import CausalLM, ModelOutput
from arbor.models.checkpoint import CheckpointError, load_model, save_model
from arbor.models.config import ConfigError, ModelConfig
from arbor.models.moe import expert_counts

__all__ = [
    "BlockDiffusionAttention", "CausalLM", "CheckpointError", "ConfigError", "ModelConfig", "ModelOutput",
    "TreeAttention", "VarlenAttention", "expert_counts", "load_model", "save_model",
]
