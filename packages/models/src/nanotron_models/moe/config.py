"""`moe_config`: Nanotron's MoEConfig fields with its defaults, our documented additions, and
the checks (one line each, naming the key).

Nanotron's keys: num_experts, top_k, moe_intermediate_size, shared_expert_intermediate_size,
router_aux_loss_coef, layers ([-1] = every layer), enable_shared_expert, token_dispatcher_type
(alltoall | allgather: how tokens reach the ranks of other experts under expert parallelism;
one rank runs both the same way). Ours: `router` (softmax | sigmoid_bias), `norm_topk_prob`
(Hugging Face Qwen2-MoE's key), `router_z_loss_coef`, `router_bias_update_rate` (sigmoid_bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelConfigError

ROUTERS = ("softmax", "sigmoid_bias")
DISPATCHERS = ("alltoall", "allgather")
_K = "model_config.moe_config"


class MoEConfigError(ModelConfigError):
    """A `moe_config` value a user can get wrong; the message names the key."""


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    router_aux_loss_coef: float = 0.01
    layers: list[int] = field(default_factory=lambda: [-1])
    enable_shared_expert: bool = False
    token_dispatcher_type: str = "alltoall"
    # Ours (docs/models.md "Mixture of experts").
    router: str = "softmax"
    norm_topk_prob: bool = False
    router_z_loss_coef: float = 0.0
    router_bias_update_rate: float = 0.001

    @classmethod
    def of(cls, value: Any) -> MoEConfig | None:
        """A MoEConfig from a mapping (a checkpoint's or HF's config), itself, or None."""
        if value is None or isinstance(value, MoEConfig):
            return value
        if not isinstance(value, dict):
            raise MoEConfigError(f"{_K} must be a mapping or null, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise MoEConfigError(f"{_K}.{unknown[0]}: unknown key")
        return cls(**value)

    def moe_layers(self, num_layers: int) -> list[int]:
        """The decoder layers (0-based) whose MLP is a mixture of experts."""
        if -1 in self.layers:
            return list(range(num_layers))
        return sorted(set(self.layers))


@dataclass(frozen=True)
class MoEVariant:
    """How a family's MoE layer departs from Qwen2-MoE's (the defaults), set by the family,
    not a YAML key: the sigmoid router's group limit and weight scale (router.py) and the
    experts' activation (experts.EXPERT_ACTIVATIONS). Nemotron-H's: its n_group, topk_group,
    routed_scaling_factor and relu2."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    expert_activation: str = "swiglu"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def moe_config_error(m: MoEConfig, num_layers: int) -> str | None:
    """The first refused value of `m`, as one line naming its key; None when all are fine."""
    for name in ("num_experts", "top_k", "moe_intermediate_size"):
        if not _int(getattr(m, name)) or getattr(m, name) < 1:
            return f"{_K}.{name} must be a positive integer, got {getattr(m, name)!r}"
    if m.top_k > m.num_experts:
        return f"{_K}.top_k ({m.top_k}) must be at most num_experts ({m.num_experts})"
    if m.enable_shared_expert and (
        not _int(m.shared_expert_intermediate_size) or m.shared_expert_intermediate_size < 1
    ):
        return (
            f"{_K}.shared_expert_intermediate_size must be a positive integer with "
            f"enable_shared_expert, got {m.shared_expert_intermediate_size!r}"
        )
    layers = m.layers
    if not isinstance(layers, list) or not layers or not all(_int(x) for x in layers):
        return f"{_K}.layers must be a non-empty list of layer indices ([-1]: all), got {layers!r}"
    bad = [x for x in layers if not (x == -1 or 0 <= x < num_layers)]
    if bad:
        return f"{_K}.layers {bad} are outside 0..{num_layers - 1} (num_hidden_layers; -1: all)"
    if m.token_dispatcher_type not in DISPATCHERS:
        return (
            f"{_K}.token_dispatcher_type must be one of {list(DISPATCHERS)}, "
            f"got {m.token_dispatcher_type!r}"
        )
    if m.router not in ROUTERS:
        return f"{_K}.router must be one of {list(ROUTERS)}, got {m.router!r}"
    for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
        if not _number(getattr(m, name)) or getattr(m, name) < 0:
            return f"{_K}.{name} must be a number >= 0, got {getattr(m, name)!r}"
    if not isinstance(m.norm_topk_prob, bool) or not isinstance(m.enable_shared_expert, bool):
        return f"{_K}.norm_topk_prob and enable_shared_expert must be true or false"
    return None


def moe_layers_of(config: Any) -> set[int]:
    """The MoE layers of a model config (none without `moe_config`, as Llama's)."""
    m = getattr(config, "moe_config", None)
    return set() if m is None else set(m.moe_layers(config.num_hidden_layers))
