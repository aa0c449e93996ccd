"""The Qwen3-Next family (Qwen3NextForCausalLM: Gated DeltaNet and gated-attention layers,
mixture of experts with a gated shared expert): config, layers, stage, parameters and sizes,
decoding state, Hugging Face mapping. Reached through its row in families.py (`QWEN3_NEXT`)
and stage.ModelStage only."""

from .config import Qwen3NextConfig

__all__ = ["Qwen3NextConfig"]
