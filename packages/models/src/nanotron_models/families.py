"""Model families by name: one row per family, the one place callers look a family up.

A row gathers what the rest of the stack needs of a family: its config class; its blocks
(names in forward order, their relative costs for pipeline placement, the builder of a
stage holding some of them); its parameter naming (the global names' init/sharding rule and
the name tied parameters share); its size and FLOPs; and its Hugging Face mapping (config and
state dict, both ways). Llama is the only family today; another one (Qwen2, say) is its
modules plus one row in `FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .config import LlamaConfig, ModelConfigError
from .flops import (
    llama_block_costs,
    llama_block_names,
    num_parameters,
    training_flops_per_token,
)
from .hf import (
    config_from_hf,
    config_to_hf,
    hf_state_dict_to_ours_full,
    our_full_state_dict_to_hf,
)
from .init import InitSpec, llama_init_spec
from .model import TIED_KEY, build_llama_stage


@dataclass(frozen=True)
class HFMapping:
    """Hugging Face `transformers` interop of a family: `config_from_hf(hf_config)`,
    `config_to_hf(config)`, `state_dict_from_hf(hf_sd, config)` (full tensors, our names) and
    `state_dict_to_hf(full_sd, config)`; `model_type` and `architectures`: how HF's
    config.json names the family."""

    model_type: str
    architectures: tuple[str, ...]
    config_from_hf: Callable[[Any], Any]
    config_to_hf: Callable[[Any], Any]
    state_dict_from_hf: Callable[[dict, Any], dict]
    state_dict_to_hf: Callable[[dict, Any], dict]


@dataclass(frozen=True)
class ModelFamily:
    """Everything about one family. `build_stage(config, pc, block_names, **options)` builds
    the named contiguous blocks with this rank's tp shards; `block_names(config)` lists every
    block in forward order and `block_costs(config, seq_len)` their forward FLOPs;
    `init_spec(config, name, std, tp, scaling_method)` says how parameter `name` is made and
    sharded; parameters tied across stages share the name `tied_key`."""

    name: str
    config_class: type
    build_stage: Callable[..., nn.Module]
    block_names: Callable[[Any], list[str]]
    block_costs: Callable[[Any, int], list[float]]
    init_spec: Callable[..., InitSpec]
    tied_key: str
    num_parameters: Callable[[Any], int]
    training_flops_per_token: Callable[[Any, int], float]
    hf: HFMapping


LLAMA = ModelFamily(
    name="llama",
    config_class=LlamaConfig,
    build_stage=build_llama_stage,
    block_names=llama_block_names,
    block_costs=llama_block_costs,
    init_spec=llama_init_spec,
    tied_key=TIED_KEY,
    num_parameters=num_parameters,
    training_flops_per_token=training_flops_per_token,
    hf=HFMapping(
        model_type="llama",
        architectures=("LlamaForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        state_dict_from_hf=hf_state_dict_to_ours_full,
        state_dict_to_hf=our_full_state_dict_to_hf,
    ),
)

FAMILIES: dict[str, ModelFamily] = {"llama": LLAMA}


def family(name: str) -> ModelFamily:
    """The family called `name`; an unknown one is an error listing the known ones."""
    if name not in FAMILIES:
        raise ModelConfigError(f"model family {name!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of(config: Any) -> ModelFamily:
    """The family whose config class `config` is an instance of."""
    for row in FAMILIES.values():
        if isinstance(config, row.config_class):
            return row
    raise ModelConfigError(f"no model family has the config class {type(config).__name__}")
