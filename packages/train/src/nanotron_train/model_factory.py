"""Build this rank's blocks of a model, of any family, from a training config (before
`parallelize`).

One place for what the trainer, inference (inference/model_io.py) and the imports
(convert.py) need: the vocabulary padding, the placement of blocks over pipeline stages (by
estimated compute at the training sequence length), and this rank's stage (or its v chunks
under the interleaved engine). The family is the config's row in `nanotron_models.families`;
the blocks are built with this rank's tp shards, in the default tp mode; `parallelize.py`
then applies every parallel and speed option.
"""

from __future__ import annotations

from dataclasses import replace
from inspect import signature
from typing import Any

from nanotron_models.config import DTYPES
from nanotron_models.families import family_of
from nanotron_models.parametrization import Parametrization
from nanotron_models.stage import ModelStage
from nanotron_parallel.context import ParallelContext
from nanotron_parallel.expert_parallel import make_dispatcher
from nanotron_parallel.pipeline import engine, stage_block_names
from nanotron_train.config.nanotron_layouts import init_options
from nanotron_train.config.schema import Config, ModelArgs


def padded_model_config(model: ModelArgs) -> Any:
    """Nanotron rounds the vocabulary up to make_vocab_size_divisible_by (layout-independent)."""
    mc = model.model_config
    div = model.make_vocab_size_divisible_by
    padded = -(-mc.vocab_size // div) * div
    return mc if padded == mc.vocab_size else replace(mc, vocab_size=padded)


def build_family_stage(
    mc: Any,
    pc: ParallelContext,
    sequence_length: int,
    stage: int = 0,
    num_stages: int = 1,
    **options: Any,
) -> ModelStage:
    """The blocks of pipeline stage `stage` of `num_stages` of model config `mc` (its family's
    row builds them), balanced by estimated compute at `sequence_length`, with this rank's tp
    shards; `options` go to the row's `build_stage` (seed, init_std, dtype, device, ...).
    A mixture-of-experts model reaches its experts over the ep group (one rank: all local)."""
    family = family_of(mc)
    names = family.block_names(mc)
    costs = family.block_costs(mc, sequence_length)
    moe = getattr(mc, "moe_config", None)
    if moe is not None and "dispatcher" not in options:
        group = pc.ep_group if pc.ep_size > 1 else None
        options["dispatcher"] = make_dispatcher(moe.token_dispatcher_type, moe.num_experts, group)
    placed = stage_block_names(names, costs, num_stages, stage, family.layer_prefix)
    return family.build_stage(mc, pc, placed, **options)


def build_model(
    model: ModelArgs,
    seed: int,
    sequence_length: int,
    pc: ParallelContext,
    stage: int | None = None,
    num_stages: int | None = None,
) -> ModelStage:
    """The blocks of pipeline stage `stage` of `num_stages` (default: this rank's of pp),
    balanced by estimated compute at `sequence_length`, with this rank's tp shards."""
    return build_family_stage(
        padded_model_config(model),
        pc,
        sequence_length,
        pc.pp_rank if stage is None else stage,
        pc.pp_size if num_stages is None else num_stages,
        seed=seed,
        **init_options(model),
        dtype=DTYPES[model.dtype],
        device=pc.device,
        # only when not sp, so a family without parametrizations needs no such option
        **({"parametrization": p} if (p := parametrization_of(model)).name != "sp" else {}),
    )


def parametrization_of(model: ModelArgs) -> Parametrization:
    """Nanotron's `init_method.use_mup` (spectral µP), else `model.parametrization`; a
    family whose builder takes no `parametrization` has only sp (one line, not a TypeError)."""
    p, mc = model.parametrization, model.model_config
    out = (
        Parametrization("spectral_mup")
        if model.init_method.use_mup
        else _relative(p.name, p.base_hidden_size, p.base_num_layers, p.completep_alpha, mc)
    )
    family = family_of(mc)
    if out.name != "sp" and "parametrization" not in signature(family.build_stage).parameters:
        key = "init_method.use_mup" if model.init_method.use_mup else "parametrization.name"
        raise ValueError(f"model.{key}: the {family.name} family has only sp (no µP rules)")
    return out


def checkpoint_parametrization(train_config: dict, mc: Any) -> Parametrization:
    """The parametrization a checkpoint's config.yaml trained with (its forward multipliers
    are part of the model: inference builds it with them)."""
    model = train_config.get("model") or {}
    p = model.get("parametrization") or {}
    if (model.get("init_method") or {}).get("use_mup"):
        return Parametrization("spectral_mup")
    return _relative(p.get("name", "sp"), p.get("base_hidden_size"), p.get("base_num_layers"),
                     p.get("completep_alpha", 1.0), mc)  # fmt: skip


def _relative(name: str, base_w, base_d, alpha: float, mc: Any) -> Parametrization:
    if name == "sp":  # whatever the family's size fields are
        return Parametrization()
    width = mc.hidden_size / (base_w or mc.hidden_size)
    return Parametrization(name, width, mc.num_hidden_layers / (base_d or mc.num_hidden_layers),
                           alpha)  # fmt: skip


def build_stage_chunks(cfg: Config, pc: ParallelContext) -> list[ModelStage]:
    """This rank's chunks: one stage, or for an engine with several chunks per rank its
    chunks in the engine's order (interleaved-1f1b: v chunks, chunk c = virtual stage
    c * pp + pp_rank; zbv: two, virtual stages pp_rank and 2 pp - 1 - pp_rank), of pp * chunks
    virtual stages over which the blocks are placed by cost."""
    args = (cfg.model, cfg.general.seed, cfg.tokens.sequence_length, pc)
    eng = engine(cfg.parallelism.pp_engine)
    v, pp = eng.chunks(cfg.parallelism.pp_virtual_stages), pc.pp_size
    if v == 1:
        return [build_model(*args)]
    return [build_model(*args, eng.stage_of(pc.pp_rank, c, pp), pp * v) for c in range(v)]
