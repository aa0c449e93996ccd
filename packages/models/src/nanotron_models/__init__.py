"""Model families built from nanotron-parallel primitives, found by name in families.py.

Llama (identical to Hugging Face's LlamaForCausalLM) and Nanotron's Qwen2 (Qwen2ForCausalLM,
SmolLM3ForCausalLM: NoPE layers, sliding windows, document masking).
"""

from .attention import resolve_backend
from .config import LlamaConfig, ModelConfigError
from .families import FAMILIES, ModelFamily, config_from_dict, family, family_of
from .flops import (
    BlockSpec,
    llama_block_costs,
    llama_block_names,
    llama_block_specs,
    num_parameters,
    training_flops_per_token,
)
from .kv_cache import KVCache
from .model import (
    LlamaStage,
    build_llama,
    build_llama_stage,
    full_state_dict,
    load_full_state_dict,
)
from .qwen2 import Qwen2Config
from .stage import ModelStage

__all__ = [
    "FAMILIES",
    "BlockSpec",
    "KVCache",
    "LlamaConfig",
    "LlamaStage",
    "ModelConfigError",
    "ModelFamily",
    "ModelStage",
    "Qwen2Config",
    "build_llama",
    "build_llama_stage",
    "config_from_dict",
    "family",
    "family_of",
    "full_state_dict",
    "llama_block_costs",
    "llama_block_names",
    "llama_block_specs",
    "load_full_state_dict",
    "num_parameters",
    "resolve_backend",
    "training_flops_per_token",
]
