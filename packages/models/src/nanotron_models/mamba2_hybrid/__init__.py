"""The Mamba-2 / hybrid family (Mamba2ForCausalLM, Nemotron-H's M/*/- patterns): config,
layers, stage, parameters and sizes, decoding state, Hugging Face mapping. Reached through
its row in families.py (`MAMBA2`) and stage.ModelStage only."""

from .config import Mamba2HybridConfig

__all__ = ["Mamba2HybridConfig"]
