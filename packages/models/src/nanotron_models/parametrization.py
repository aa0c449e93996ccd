"""How a parametrization changes a parameter's initialisation and learning rate, family-
agnostic: a family's init spec (init.py's InitSpec) says each parameter's full shape, its
std under the standard parametrization, and, for µP, its `fan` (a linear weight's fan_in,
fan_out) or that it is an `embedding`.

`sp`: the spec as it is, every learning rate the scheduler's.

`spectral_mup` (Nanotron's `model.init_method.use_mup: true`, its SpectralMupParametrizator
and LearningRateForSpectralMup; Yang, Simon, Bernstein, "A Spectral Condition for Feature
Learning", parametrization 1), with the full (unsharded) fans whatever tp is:
- a linear weight (attention's fused q/k/v and output, the MLP's fused gate/up and down, an
  untied lm_head): std = 1/sqrt(fan_in) * min(1, sqrt(fan_out/fan_in)), learning rate
  lr * fan_out/fan_in; `init_method.std` and `scaling_method` are not used (as in Nanotron);
- an embedding (the tied lm_head with it): std 1.0, learning rate lr;
- norms (ones) and biases (zeros): as under sp, learning rate lr (Nanotron has no rule for a
  bias: its fan-in is undefined, and it fails there; ours stay zero);
- a mixture of experts (ours: Nanotron's spectral µP fails on its MoE modules): each expert's
  matrices and the shared expert's as linear weights with their per-expert fans; the router
  (fan_out: the experts) and the shared expert's gate (fan_out 1) as linear weights too, which
  is what the spectral condition asks of any linear map;
- anything else randomly initialised: no rule, an error.

`mup` (µTransfer, Tensor Programs V, Adam) and `completep` (CompleteP, Dey et al. 2025: µP
plus depth-µP with exponent alpha), relative to a base model: width_mult m = hidden /
base_hidden, depth_mult L = layers / base_layers; at the base shape they are sp (but for the
attention's 1/d, below):
- hidden linear weights (`fan` set, not the readout), the MoE experts' and shared expert's
  among them: std / sqrt(m), Adam learning rate lr / m (completep: x L^(alpha-1)), Adam eps
  unchanged (completep: eps / m x L^-alpha);
- a MoE router and the shared expert's gate (`router`: hidden -> a width-independent size,
  µP's output layer; Tensor Programs V's Table 3 form, init var 1/fan_in^2 and Adam rate
  1/fan_in, rather than the lm_head's multiplier form, so the MoE block's forward is
  unchanged): std / m, Adam learning rate lr / m (completep: x L^(alpha-1)), Adam eps
  unchanged (completep: x L^-alpha: its gradient scales with the branch multiplier, not
  with 1/m as a hidden matrix's does);
- the embedding, the lm_head (readout: its vocabulary side does not grow), norms, biases:
  std and learning rate as sp (completep: norms' and biases' rates x L^(alpha-1));
- in the forward (`multipliers`): the lm_head's input x 1/m (tied or not: the readout
  multiplier), attention scores q.k / d instead of / sqrt(d) (the queries x 1/sqrt(d)),
  completep: each residual branch x L^-alpha.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .init import InitSpec

PARAMETRIZATIONS = ("sp", "spectral_mup", "mup", "completep")


@dataclass(frozen=True)
class Parametrization:
    name: str = "sp"
    width_mult: float = 1.0  # hidden_size / base hidden size (mup, completep)
    depth_mult: float = 1.0  # num_hidden_layers / base layers (completep)
    alpha: float = 1.0  # CompleteP's depth exponent, in [0.5, 1]

    def __post_init__(self) -> None:
        if self.name not in PARAMETRIZATIONS:
            raise ValueError(
                f"parametrization must be one of {PARAMETRIZATIONS}, got {self.name!r}"
            )


@dataclass(frozen=True)
class Rule:
    """One parameter under a parametrization: its init spec and optimizer multipliers."""

    spec: InitSpec
    lr_scale: float = 1.0
    eps_scale: float = 1.0


@dataclass(frozen=True)
class Multipliers:
    """The forward's constants: on the lm_head's input, the queries, each residual branch."""

    output: float = 1.0
    attention_q: float = 1.0
    residual: float = 1.0


def as_parametrization(p: str | Parametrization) -> Parametrization:
    return Parametrization(p) if isinstance(p, str) else p


def spectral_std(fan_in: int, fan_out: int) -> float:
    """σ = 1/√fan_in · min(1, √(fan_out/fan_in)) (Nanotron's _compute_spectral_std, std 1)."""
    return (1.0 / math.sqrt(fan_in)) * min(1.0, math.sqrt(fan_out / fan_in))


def spectral_lr_scale(fan_in: int, fan_out: int) -> float:
    """η_l / η = fan_out / fan_in (Nanotron's LearningRateForSpectralMup._get_mup_lr)."""
    return fan_out / fan_in


def parametrized(spec: InitSpec, name: str, parametrization: str | Parametrization) -> Rule:
    """How parameter `name` (whose sp init is `spec`) is made and stepped."""
    p = as_parametrization(parametrization)
    if p.name == "sp":
        return Rule(spec)
    if p.name == "spectral_mup":
        return _spectral(spec, name)
    return _transfer(spec, p)


def _spectral(spec: InitSpec, name: str) -> Rule:
    if spec.fan is not None:
        fan_in, fan_out = spec.fan
        std = spectral_std(fan_in, fan_out)
        return Rule(dataclasses.replace(spec, std=std), spectral_lr_scale(fan_in, fan_out))
    if spec.embedding:
        return Rule(dataclasses.replace(spec, std=1.0))
    if spec.std is None or spec.std == 0.0:  # norms (ones), biases (zeros)
        return Rule(spec)
    raise ValueError(f"{name}: spectral µP (model.init_method.use_mup) has no rule for it")


def _transfer(spec: InitSpec, p: Parametrization) -> Rule:
    """µTransfer (mup) and CompleteP: see the module docstring."""
    m, depth = p.width_mult, p.depth_mult if p.name == "completep" else 1.0
    alpha = p.alpha if p.name == "completep" else 1.0
    if spec.router:  # µP's output layer inside a block, as init and learning rate
        eps = depth**-alpha if p.name == "completep" else 1.0
        return Rule(dataclasses.replace(spec, std=spec.std / m), depth ** (alpha - 1) / m, eps)
    if spec.fan is not None and not spec.readout:  # a hidden matrix
        std = spec.std / math.sqrt(m)
        eps = (1.0 / m) * depth**-alpha if p.name == "completep" else 1.0
        return Rule(dataclasses.replace(spec, std=std), depth ** (alpha - 1) / m, eps)
    if spec.std is None or spec.std == 0.0:  # norms, biases
        return Rule(spec, depth ** (alpha - 1))
    return Rule(spec)  # the embedding and the readout


def multipliers(p: str | Parametrization, head_dim: int) -> Multipliers:
    p = as_parametrization(p)
    if p.name not in ("mup", "completep"):
        return Multipliers()
    residual = p.depth_mult**-p.alpha if p.name == "completep" else 1.0
    return Multipliers(1.0 / p.width_mult, 1.0 / math.sqrt(head_dim), residual)
