"""A Qwen2 (or Qwen2-MoE) checkpoint written as Nanotron writes one, for the import tests.

Written from Nanotron's source, independently of our own name table (nanotron_names.py):
- names: `Qwen2ForTraining` (models/qwen.py) holds `model.token_position_embeddings.pp_block.
  token_embedding`, `model.decoder.<i>.pp_block.{input_layernorm, attn.qkv_proj, attn.o_proj,
  post_attention_layernorm, mlp}`, `model.final_layer_norm.pp_block`, `model.lm_head.pp_block`;
  a dense mlp is `gate_up_proj` (gate then up) and `down_proj`; a MoE mlp (nn/moe.py) is
  `router.weight` [E, H] (fp32), `experts.merged_gate_up_proj` [E, H, 2I] (gate then up on the
  last dim), `experts.merged_down_proj` [E, I, H], `shared_expert.{gate_up_proj,down_proj}`
  and `shared_expert_gate.weight` [1, H].
- sharding (parallel/sharded_parameters.py): a column linear (qkv_proj weight and bias,
  gate_up_proj, lm_head, the embedding) splits dim 0, chunk by chunk (q, k, v; gate, up) when
  it has contiguous chunks; a row linear (o_proj, down_proj) splits dim 1. Offsets are numpy
  integers, as Nanotron computes them (so `unsharded_shape` reads `np.int64(..)` under numpy 2).
  The rest (norms, router, experts, shared_expert_gate: plain parameters) is tied across tp and
  stored once, unsharded, without metadata.
- files (serialize/weights.py, utils.get_path): `model/<dotted name as folders>/model_<attr>
  _pp-rank-P-of-PP_tp-rank-T-of-TP.safetensors` holding `data`, with metadata `version`,
  `local_global_slices_pairs` (SlicesPair: `start,stop,step` per dim joined by `|`, local and
  global by `#`, pairs by `;`) and `unsharded_shape`; `model_<attr>.safetensors` for the
  unsharded; a tied embedding stored once under the embedding's name.
- checkpoint_metadata.json (serialize/metadata.py, CheckpointMetadata at version 1.5, keys
  sorted) and config.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file

TP, PP = 2, 2
_DECODER = {  # our name in a decoder layer -> Nanotron's, and how Nanotron shards it
    "input_norm.weight": ("input_layernorm.weight", None),
    "post_attn_norm.weight": ("post_attention_layernorm.weight", None),
    "attn.qkv.weight": ("attn.qkv_proj.weight", "qkv"),
    "attn.qkv.bias": ("attn.qkv_proj.bias", "qkv"),
    "attn.o_proj.weight": ("attn.o_proj.weight", "row"),
    "mlp.gate_up.weight": ("mlp.gate_up_proj.weight", "gate_up"),
    "mlp.down.weight": ("mlp.down_proj.weight", "row"),
    "mlp.router.weight": ("mlp.router.weight", None),
    "mlp.experts.gate_up_proj": ("mlp.experts.merged_gate_up_proj", None),
    "mlp.experts.down_proj": ("mlp.experts.merged_down_proj", None),
    "mlp.shared_expert.gate_up.weight": ("mlp.shared_expert.gate_up_proj.weight", "gate_up"),
    "mlp.shared_expert.down.weight": ("mlp.shared_expert.down_proj.weight", "row"),
    "mlp.shared_expert_gate.weight": ("mlp.shared_expert_gate.weight", None),
}
_TOP = {
    "embedding.weight": ("model.token_position_embeddings.pp_block.token_embedding.weight", "col"),
    "final_norm.weight": ("model.final_layer_norm.pp_block.weight", None),
    "lm_head.weight": ("model.lm_head.pp_block.weight", "col"),
}


def nanotron_name(ours: str) -> tuple[str, str | None, int]:
    """Nanotron's name of our parameter, its sharding, and the layer it belongs to (-1: the
    embedding, a large number: the head)."""
    if ours in _TOP:
        name, how = _TOP[ours]
        return name, how, -1 if ours == "embedding.weight" else 1 << 30
    _, layer, rest = ours.split(".", 2)
    name, how = _DECODER[rest]
    return f"model.decoder.{layer}.pp_block.{name}", how, int(layer)


def _slice(s: slice) -> str:  # SlicesPair.slice_to_str
    return ",".join(str(x) if x is not None else "None" for x in (s.start, s.stop, s.step))


def _pair(local: tuple[slice, ...], glob: tuple[slice, ...]) -> str:
    return "|".join(map(_slice, local)) + "#" + "|".join(map(_slice, glob))


def shard(tensor: torch.Tensor, rank: int, split_dim: int, chunks: tuple[int, ...] | None):
    """This tp rank's shard and its metadata, as create_sharded_parameter_from_config
    computes them (numpy offsets included)."""
    dims = range(tensor.ndim)
    if chunks is None:
        n = tensor.shape[split_dim] // TP
        glob = slice(rank * n, (rank + 1) * n)
        local_slices = tuple(slice(None) for _ in dims)
        global_slices = tuple(glob if d == split_dim else slice(None) for d in dims)
        pairs = [_pair(local_slices, global_slices)]
        unsharded = tuple(tensor.shape)
        part = tensor.narrow(split_dim, rank * n, n)
    else:
        offsets = np.cumsum((0, *chunks))
        local_offsets = offsets // TP
        pairs, parts = [], []
        for chunk, g0, l0, l1 in zip(chunks, offsets[:-1], local_offsets[:-1], local_offsets[1:]):
            n = chunk // TP
            glob = slice(rank * n + g0, (rank + 1) * n + g0)
            local_slices = tuple(slice(l0, l1) if d == split_dim else slice(None) for d in dims)
            global_slices = tuple(glob if d == split_dim else slice(None) for d in dims)
            pairs.append(_pair(local_slices, global_slices))
            parts.append(tensor.narrow(split_dim, int(glob.start), n))
        unsharded = tuple(offsets[-1] if d == split_dim else tensor.shape[d] for d in dims)
        part = torch.cat(parts, dim=split_dim)
    meta = {
        "version": "1.5",
        "local_global_slices_pairs": ";".join(pairs),
        "unsharded_shape": str(tuple(unsharded)),
    }
    return part.contiguous(), meta


def write_nanotron_qwen2(
    folder: Path, full: dict, config: dict, step: int, samples: int, tokens_by_folder: bool
) -> None:
    """Write `full` (our global names, full tensors) as Nanotron's Qwen2ForTraining saved at
    tp = 2, pp = 2, with `config` as its config.yaml, at `step` after `samples` samples. With
    `tokens_by_folder` its loader counted the tokens of each dataset folder (a Nanoset's);
    without, none, so it records 0 consumed tokens (TrainingMetadata sums the folders)."""
    mc = config["model"]["model_config"]
    h, heads, kv_heads = mc["hidden_size"], mc["num_attention_heads"], mc["num_key_value_heads"]
    q, kv = h, kv_heads * (h // heads)
    moe = mc.get("moe_config") or {}
    chunks = {
        "qkv": (q, kv, kv),
        "gate_up": (mc["intermediate_size"],) * 2,
        "shared_gate_up": (moe.get("shared_expert_intermediate_size"),) * 2,
    }
    layers = mc["num_hidden_layers"]
    for ours, tensor in full.items():
        if ours == "lm_head.weight" and mc["tie_word_embeddings"]:
            continue  # tied: stored once, under the embedding's name (the tie's first)
        name, how, layer = nanotron_name(ours)
        *dirs, attr = name.split(".")
        where = folder / "model" / Path(*dirs)
        where.mkdir(parents=True, exist_ok=True)
        if how is None:
            save_file({"data": tensor.contiguous()}, str(where / f"model_{attr}.safetensors"))
            continue
        pp_rank = min(max(layer, 0) * PP // layers, PP - 1)
        split_dim = 1 if how == "row" else 0
        kind = "shared_gate_up" if how == "gate_up" and "shared_expert" in ours else how
        for rank in range(TP):
            part, meta = shard(tensor, rank, split_dim, chunks.get(kind))
            file = f"model_{attr}_pp-rank-{pp_rank}-of-{PP}_tp-rank-{rank}-of-{TP}.safetensors"
            save_file({"data": part}, str(where / file), metadata=meta)
    seq = config["tokens"]["sequence_length"]
    dataset = config["data_stages"][0]["data"]["dataset"]["dataset_folder"][0]
    by_folder = {dataset: samples * seq} if tokens_by_folder else {}
    stage = {
        "name": config["data_stages"][0]["name"],
        "start_training_step": 1,
        "consumed_train_samples": samples,
        "sequence_length": seq,
        "consumed_tokens_per_dataset_folder": by_folder,
    }
    metas = {
        "consumed_train_samples": samples,
        "last_train_step": step,
        "consumed_tokens_total": sum(by_folder.values()),
        "last_stage_idx": 0,
        "data_stages": [stage],
    }
    meta = {"version": "1.5", "tp": TP, "dp": 1, "cp": 1, "metas": metas, "custom_metas": None}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "checkpoint_metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder.parent / "latest.txt").write_text(f"{step}\n")
