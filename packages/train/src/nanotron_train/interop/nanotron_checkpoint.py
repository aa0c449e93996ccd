"""Reading a Nanotron checkpoint: its weights (any tp/pp it was saved with) and its config.
Its Llama and Qwen2 models (Qwen2-MoE included) name their parameters alike (nanotron_names.py).

Nanotron's layout (src/nanotron/serialize): `<ckpt>/checkpoint_metadata.json` (the step and
consumed samples under `metas`), `<ckpt>/config.yaml` (its Config), and one safetensors file
per parameter and tp/pp shard under `<ckpt>/model/`, the parameter's dotted name as folders:
`model/model/decoder/0/pp_block/attn/qkv_proj/model_weight_pp-rank-0-of-2_tp-rank-1-of-2
.safetensors` holding one tensor `data`. A sharded file's metadata gives `unsharded_shape` and
`local_global_slices_pairs` (`local#global` slice lists, `|` between dims, `;` between pairs),
which place each piece of the shard in the full tensor; a replicated parameter has one file,
`model_weight.safetensors`. A tied parameter is stored once, under its first name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from nanotron_models.families import family_of
from nanotron_train.checkpoints.errors import CheckpointError
from nanotron_train.interop.nanotron_names import from_nanotron

_FILE = re.compile(
    r"model_(?P<attr>[^_].*?)(?:_pp-rank-\d+-of-\d+_tp-rank-\d+-of-\d+)?\.safetensors"
)


def _slices(text: str) -> tuple[slice, ...]:
    def one(part: str) -> slice:
        return slice(*(None if x == "None" else int(x) for x in part.split(",")))

    return tuple(one(p) for p in text.split("|"))


def _shape(text: str, path: Path) -> tuple[int, ...]:
    """A file's `unsharded_shape`: "(a, b)", each size "np.int64(a)" instead when Nanotron
    computed it with numpy 2 (its chunked offsets are numpy integers; TensorMetadata reads
    both spellings)."""
    sizes = [s.strip() for s in text.strip().strip("()").split(",") if s.strip()]
    try:
        return tuple(
            int(re.fullmatch(r"np\.\w+\((\d+)\)", s)[1]) if "np." in s else int(s) for s in sizes
        )
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: unsharded_shape {text!r} is not a shape") from None


def _read_file(path: Path) -> tuple[torch.Tensor, dict]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor("data"), f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 (safetensors raises several types)
        raise CheckpointError(f"{path}: not a Nanotron weight file ({exc})") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter, full, keyed by Nanotron's name (shards merged by their slices)."""
    root = folder / "model"
    files = sorted(root.rglob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no Nanotron weight files (*.safetensors)")
    shards: dict[str, list[Path]] = {}
    for path in files:
        match = _FILE.fullmatch(path.name)
        if match is None:
            raise CheckpointError(f"{path}: not a Nanotron weight file name")
        name = ".".join([*path.parent.relative_to(root).parts, match["attr"]])
        shards.setdefault(name, []).append(path)
    out = {}
    for name, paths in shards.items():
        tensor, meta = _read_file(paths[0])
        if "unsharded_shape" not in meta:
            out[name] = tensor
            continue
        shape = _shape(meta["unsharded_shape"], paths[0])
        full = torch.empty(shape, dtype=tensor.dtype)
        filled = torch.zeros(shape, dtype=torch.bool)
        for path in paths:
            shard, meta = _read_file(path)
            for pair in meta["local_global_slices_pairs"].split(";"):
                local, glob = (_slices(t) for t in pair.split("#"))
                full[glob] = shard[local]
                filled[glob] = True
        if not bool(filled.all()):
            raise CheckpointError(f"{root}: the shards of {name} do not cover it (a file missing?)")
        out[name] = full
    return out


# The families whose Nanotron files this module reads tensor by tensor. Nanotron's Mamba
# example stores in_proj with x and z interleaved by its own tp layout: its names map (for
# weight-decay patterns) but its files would load silently mis-ordered.
READ_FAMILIES = ("llama", "qwen2")


def check_family_is_read(folder: Path, model_config) -> None:
    name = family_of(model_config).name
    if name not in READ_FAMILIES:
        raise CheckpointError(
            f"{folder}: the weights of a Nanotron {name} checkpoint cannot be read here (Llama "
            "and Qwen2 checkpoints can); train from the config, or export the model to "
            "Hugging Face and import it with from-hf"
        )


def read_model_weights(folder: Path, model_config) -> dict[str, torch.Tensor]:
    """The model's full weights under our names (read_weights, check_experts, to_our_names)."""
    check_family_is_read(folder, model_config)
    weights = read_weights(folder)
    moe = getattr(model_config, "moe_config", None)
    check_experts(folder, weights, moe.num_experts if moe is not None else None)
    return to_our_names(weights, model_config.tie_word_embeddings)


def check_experts(folder: Path, weights: dict[str, torch.Tensor], num_experts: int | None) -> None:
    """Nanotron's routed experts (nn/moe.py's GroupedMLP: `merged_gate_up_proj`
    [E_local, H, 2I], `merged_down_proj` [E_local, I, H]) are plain parameters, tied over tp
    and never marked expert-sharded, so at expert_parallel_size > 1 every ep rank writes its
    own experts to the same unsharded file: one rank's survive. Refused, naming the file."""
    for name, tensor in weights.items():
        if not name.endswith((".merged_gate_up_proj", ".merged_down_proj")):
            continue
        if num_experts is None or tensor.shape[0] == num_experts:
            continue  # a dense config: the model's own check names the parameters it lacks
        *dirs, attr = name.split(".")
        path = folder / "model" / Path(*dirs) / f"model_{attr}.safetensors"
        raise CheckpointError(
            f"{path}: holds {tensor.shape[0]} of moe_config.num_experts={num_experts} experts "
            "(Nanotron saving at expert_parallel_size > 1 writes each expert-parallel rank's "
            "experts to this one file, so the others are lost): it cannot be imported"
        )


def to_our_names(weights: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Nanotron names -> ours; a tied lm_head takes the embedding (stored once)."""
    out, unknown = {}, []
    for name, tensor in weights.items():
        ours = from_nanotron(name)
        if ours is None:
            unknown.append(name)
        else:
            out[ours] = tensor
    if unknown:
        raise CheckpointError(
            f"Nanotron parameters with no counterpart here: {sorted(unknown)[:3]}"
        )
    if tied:
        out.setdefault("lm_head.weight", out.get("embedding.weight"))
        out.setdefault("embedding.weight", out.get("lm_head.weight"))
    return out


def read_position(folder: Path) -> tuple[int, int, int]:
    """(step, consumed samples, consumed tokens) from checkpoint_metadata.json.

    Nanotron counts tokens per dataset folder, so a run whose loader fills no folder (or a
    checkpoint older than `consumed_tokens_total`) records 0 tokens after its samples: then
    each stage's samples times its sequence length, or 0 when the stages do not say (the
    caller knows the config's sequence length)."""
    path = folder / "checkpoint_metadata.json"
    try:
        metas = json.loads(path.read_text())["metas"]
        samples = int(metas["consumed_train_samples"])
        tokens = int(metas.get("consumed_tokens_total") or 0)
        if tokens < samples:
            stages = metas.get("data_stages") or []
            tokens = sum(
                int(s["consumed_train_samples"]) * int(s["sequence_length"]) for s in stages
            )
            tokens = tokens if tokens >= samples else 0
        return int(metas["last_train_step"]), samples, tokens
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: missing or not Nanotron's checkpoint metadata ({exc})"
        ) from None


def read_config(folder: Path) -> dict:
    path = folder / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path}: cannot read Nanotron's config ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a Nanotron config")
    return raw


def resolve(path: str | Path) -> Path:
    """A step folder, or a checkpoints root whose latest.txt names the step (as Nanotron's)."""
    folder = Path(path)
    if (folder / "latest.txt").is_file() and not (folder / "checkpoint_metadata.json").exists():
        folder = folder / (folder / "latest.txt").read_text().strip()
    if not (folder / "checkpoint_metadata.json").is_file():
        raise CheckpointError(f"{folder}: not a Nanotron checkpoint (no checkpoint_metadata.json)")
    return folder
