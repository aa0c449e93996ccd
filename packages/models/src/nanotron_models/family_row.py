"""What a model family is to the rest of the stack: the row type of `families.FAMILIES`
(ModelFamily) and its Hugging Face and Nanotron parts (HFMapping, NanotronNames)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .init import InitSpec
from .tp_plan import TPPlan


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
    model_types: tuple[str, ...] = ()  # every config.json model_type read (default: model_type)
    architecture_of: Callable[[Any], str] | None = None  # the class written (default: the first)

    def reads(self, model_type: Any, architectures: Any) -> bool:
        """Whether a config.json with this model_type / architectures is of this family."""
        if model_type in (self.model_types or (self.model_type,)):
            return True
        return any(a in self.architectures for a in (architectures or ()))

    def architecture(self, config: Any) -> str:
        return self.architecture_of(config) if self.architecture_of else self.architectures[0]


@dataclass(frozen=True)
class NanotronNames:
    """A family's parameter names in Nanotron's module tree, ours -> Nanotron's: `top` whole
    names (embedding, final norm, lm_head); `layer` the names inside layer i, which Nanotron
    writes `model.decoder.{i}.pp_block.<name>` and we `<layer_prefix>{i}.<name>`."""

    top: dict[str, str]
    layer: dict[str, str]


@dataclass(frozen=True)
class ModelFamily:
    """Everything about one family.

    Blocks: `build_stage(config, pc, block_names, **options)` builds the named contiguous
    blocks with this rank's tp shards (a stage.ModelStage); `block_names(config)` lists every
    block in forward order and `block_costs(config, seq_len)` their forward FLOPs;
    `layer_prefix` starts the names of the layers (`decoder.{i}`), the blocks pipeline
    placement moves; the others stay at the ends they are at (embedding first; norm, head
    and loss last).
    Parameters: `init_spec(config, name, std, tp, scaling_method)` says how parameter `name`
    is made and cut over tp, by `tp_plan` (which layer is split how; the blocks build their
    layers by the same plan); parameters tied across stages share the name `tied_key`.
    Sizes: `num_parameters(config)`; `training_flops_per_token(config, seq_len)` (forward +
    backward, for MFU); `activation_elements(config, tp, sequence_parallel)` -> (elements each
    layer saves per token for the backward, in layer order; elements of a layer's input per
    token): the memory model (the check before allocation and the planner);
    `layer_comm(config, tp, cp, cp_rank, batch, dtype)` -> per layer (residual blocks, each
    all-reducing over tp once each way; bytes a state-passing layer hands to the cp group per
    micro-batch, None for attention, 0 for none): the planner's communication model (None:
    every layer an attention block and an MLP block); `moe_balance_over_cp`: its MoE blocks sum
    their load-balance statistics over the cp group (the planner counts those all-reduces).
    Architecture: `arch_keys`, the config fields that change the parameters or the maths (a
    checkpoint and a config, or an HF model and a config, must agree on them);
    `optional_arch_keys`, the same for features off by default, compared only when either
    side turns them on.
    Decoding: `new_decode_state(config)` makes the empty per-sequence state decoding carries
    from step to step (a KV cache for attention), passed to the stage's `logits` and
    `decode_blocks`.
    Interop: `hf` (Hugging Face config and weights), `nanotron_names` (Nanotron's parameter
    names), `yaml_marker` (the model_config key that names the family in a Nanotron YAML).
    """

    name: str
    config_class: type
    build_stage: Callable[..., nn.Module]
    block_names: Callable[[Any], list[str]]
    block_costs: Callable[[Any, int], list[float]]
    layer_prefix: str
    init_spec: Callable[..., InitSpec]
    tp_plan: TPPlan
    tied_key: str
    num_parameters: Callable[[Any], int]
    training_flops_per_token: Callable[[Any, int], float]
    activation_elements: Callable[[Any, int, bool], tuple[tuple[int, ...], int]]
    arch_keys: tuple[str, ...]
    optional_arch_keys: tuple[str, ...]
    new_decode_state: Callable[[Any], Any]
    hf: HFMapping
    nanotron_names: NanotronNames
    yaml_marker: str = ""
    layer_comm: Callable[..., tuple[tuple[int, int | None], ...]] | None = None
    moe_balance_over_cp: bool = False
