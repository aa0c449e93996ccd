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
- anything else randomly initialised (a MoE router or experts): no rule, an error.
"""

from __future__ import annotations

import dataclasses
import math

from .init import InitSpec

PARAMETRIZATIONS = ("sp", "spectral_mup")


def spectral_std(fan_in: int, fan_out: int) -> float:
    """σ = 1/√fan_in · min(1, √(fan_out/fan_in)) (Nanotron's _compute_spectral_std, std 1)."""
    return (1.0 / math.sqrt(fan_in)) * min(1.0, math.sqrt(fan_out / fan_in))


def spectral_lr_scale(fan_in: int, fan_out: int) -> float:
    """η_l / η = fan_out / fan_in (Nanotron's LearningRateForSpectralMup._get_mup_lr)."""
    return fan_out / fan_in


def parametrized(spec: InitSpec, name: str, parametrization: str) -> tuple[InitSpec, float]:
    """(the spec to initialise `name` with, its learning-rate multiplier)."""
    if parametrization == "sp":
        return spec, 1.0
    if parametrization != "spectral_mup":
        raise ValueError(
            f"parametrization must be one of {PARAMETRIZATIONS}, got {parametrization!r}"
        )
    if spec.fan is not None:
        fan_in, fan_out = spec.fan
        return dataclasses.replace(spec, std=spectral_std(fan_in, fan_out)), spectral_lr_scale(
            fan_in, fan_out
        )
    if spec.embedding:
        return dataclasses.replace(spec, std=1.0), 1.0
    if spec.std is None or spec.std == 0.0:  # norms (ones), biases (zeros)
        return spec, 1.0
    raise ValueError(f"{name}: spectral µP (model.init_method.use_mup) has no rule for it")
