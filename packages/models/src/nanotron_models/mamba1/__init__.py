"""The Mamba-1 family (Nanotron's `examples/mamba`, Hugging Face's MambaForCausalLM): config,
layers, stage, parameters and sizes, Hugging Face mapping. Reached through its row in
families.py (`MAMBA1`) and stage.ModelStage only."""

from .config import MambaConfig

__all__ = ["MambaConfig"]
