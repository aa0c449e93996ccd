"""Mixture of experts: Qwen2-MoE's sparse block (router, grouped-matmul experts, optional
shared expert), its balance losses and per-step statistics. docs/models.md "Mixture of experts"."""

from .block import MoEBlock
from .config import (
    DISPATCHERS,
    ROUTERS,
    MoEConfig,
    MoEConfigError,
    MoEVariant,
    moe_config_error,
    moe_layers_of,
)
from .stats import (
    MoEStats,
    begin_moe_step,
    moe_blocks,
    moe_state_buffers,
    reset_moe_stats,
    update_expert_biases,
)

__all__ = [
    "DISPATCHERS",
    "ROUTERS",
    "MoEBlock",
    "MoEConfig",
    "MoEConfigError",
    "MoEStats",
    "MoEVariant",
    "begin_moe_step",
    "moe_blocks",
    "moe_config_error",
    "moe_layers_of",
    "moe_state_buffers",
    "reset_moe_stats",
    "update_expert_biases",
]
