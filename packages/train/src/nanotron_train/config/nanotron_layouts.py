"""Nanotron's older config layout and its Mamba example's init keys, read with their meanings.

Layout: Nanotron's examples/mamba/config.py (and Nanotron before `optimizer_factory`) reads the
AdamW keys directly under `optimizer` (adam_beta1, adam_beta2, adam_eps, torch_adam_is_fused).
`upgrade_optimizer_layout` moves them into `optimizer.optimizer_factory` (name adamW), on the
raw mapping before the typed load; a key given in both places is an error naming it.

Init (`INIT_CHECKS`, run by load.py after checks.py's tables): the example's MambaInit keys under model.init_method:
initializer_range (the embedding's std, in place of `std`), rescale_prenorm_residual and
n_residuals_per_layer (out_proj divided by sqrt(n_residuals_per_layer * layers)). A family
whose builder has no `residuals_per_layer` (every one but Mamba-1's) refuses the last two in
one line; model_config.dtype (the example's layers' dtype) must be null or model.dtype.
"""

from __future__ import annotations

from inspect import signature
from typing import TYPE_CHECKING, Any

from nanotron_models.families import family_of
from nanotron_train.config.errors import ConfigError
from nanotron_train.config.rules import Check

if TYPE_CHECKING:
    from nanotron_train.config.schema import Config

ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_eps", "torch_adam_is_fused")


def upgrade_optimizer_layout(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` with optimizer-level Adam keys moved into optimizer.optimizer_factory."""
    opt = data.get("optimizer")
    if not isinstance(opt, dict) or not any(k in opt for k in ADAM_KEYS):
        return data
    factory = opt.get("optimizer_factory")
    factory = dict(factory) if isinstance(factory, dict) else {"name": "adamW"}
    opt = dict(opt)
    for key in ADAM_KEYS:
        if key not in opt:
            continue
        if key in factory:
            raise ConfigError(
                f"optimizer.{key}",
                f"is also given as optimizer.optimizer_factory.{key}: keep one",
                source,
            )
        factory[key] = opt.pop(key)
    opt["optimizer_factory"] = factory
    return {**data, "optimizer": opt}


def _takes_residuals(c: Config) -> bool:
    return (
        "residuals_per_layer" in signature(family_of(c.model.model_config).build_stage).parameters
    )


_RESIDUAL_KEYS = ("n_residuals_per_layer", "rescale_prenorm_residual")

INIT_CHECKS: tuple[Check, ...] = (
    *(
        Check(
            f"model.init_method.{key}",
            lambda c, key=key: getattr(c.model.init_method, key) is None or _takes_residuals(c),
            "is Nanotron's Mamba example's (MambaInit): only a Mamba-1 model (is_mamba_config) "
            "reads it; use init_method.std and scaling_method",
        )
        for key in _RESIDUAL_KEYS
    ),
    Check(
        "model.init_method.n_residuals_per_layer",
        lambda c: (c.model.init_method.n_residuals_per_layer or 1) >= 1,
        lambda c: f"must be >= 1, got {c.model.init_method.n_residuals_per_layer}",
    ),
    Check(
        "model.init_method.initializer_range",
        lambda c: (c.model.init_method.initializer_range or 1.0) > 0,
        lambda c: f"must be > 0, got {c.model.init_method.initializer_range}",
    ),
    Check(
        "model.model_config.dtype",
        lambda c: getattr(c.model.model_config, "dtype", None) in (None, c.model.dtype),
        lambda c: (
            f"{c.model.model_config.dtype!r} differs from model.dtype ({c.model.dtype!r}): the "
            "whole model has one dtype here; set them equal (or this one null)"
        ),
    ),
)


def init_options(model: Any) -> dict[str, Any]:
    """The build options of model.init_method: init_std (initializer_range wins over std),
    scaling_method (rescale_prenorm_residual, when given, says NUM_LAYERS or NONE) and, when
    given, residuals_per_layer."""
    im = model.init_method
    scaling = im.scaling_method
    if im.rescale_prenorm_residual is not None:
        scaling = "NUM_LAYERS" if im.rescale_prenorm_residual else "NONE"
    out = {
        "init_std": im.std if im.initializer_range is None else im.initializer_range,
        "scaling_method": scaling,
    }
    if im.n_residuals_per_layer is not None:
        out["residuals_per_layer"] = im.n_residuals_per_layer
    return out
