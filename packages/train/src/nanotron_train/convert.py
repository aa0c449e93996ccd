"""Hugging Face export and import of checkpoints, and import of Nanotron checkpoints.

    python -m nanotron_train.convert to-hf --ckpt-path CKPT --out DIR [--tokenizer PATH]
    python -m nanotron_train.convert from-hf --hf-path DIR --out CKPT [--config-file C.yaml]
    python -m nanotron_train.convert from-nanotron --nanotron-path DIR --out CKPT

to-hf writes a folder `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load: model.safetensors in the checkpoint's dtype,
config.json (rope, tie, token ids), generation_config.json and the tokenizer files, with the
chat template an SFT stage's config gave (chat_template.jinja). The token ids are the training
config's where they are the tokenizer's special tokens (token_ids.py).
from-hf writes `<CKPT>/<step>/` (step 0 unless --step) that the trainer resumes from in any
layout: the weights, a fresh optimizer state, and the training config (--config-file, or one
derived from the HF config). from-nanotron reads a Nanotron checkpoint saved with any tp/pp
(see nanotron_checkpoint.py) and writes `<CKPT>/<step>/` at its step, with its config
translated (checkpoints now go to CKPT, resuming from it). A user error prints one line and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from nanotron_train.inference.model_io import TOKENIZER_HELP
from nanotron_train.interop.hf_folder import (
    HFFolderError,
    check_writable,
    copy_tokenizer_files,
    hf_dtype_name,
    read_hf_config,
    read_hf_weights,
    write_folder_atomically,
)


def to_hf(
    ckpt_path: str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    tokenizer=True,
    tokenizer_path: str | None = None,
):
    """Export a checkpoint (any layout) as a Hugging Face Llama folder; returns its path.
    `tokenizer_path` replaces the tokenizer the checkpoint's config names."""
    from nanotron_train.config.token_ids import ids_for_export
    from nanotron_train.inference.model_io import (
        full_model_tensors,
        load_tokenizer_of,
        open_checkpoint,
    )

    check_writable(Path(out), overwrite)
    ckpt = open_checkpoint(ckpt_path, tokenizer_path)
    tok = load_tokenizer_of(ckpt) if tokenizer else None
    # transformers is slow to import: only once the inputs are known to be good.
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from nanotron_models.families import family_of
    from nanotron_train.model_factory import checkpoint_parametrization

    config = ckpt.model_config
    trained = checkpoint_parametrization(ckpt.train_config, config).name
    if trained in ("mup", "completep"):  # a Hugging Face Llama has no place for them
        raise ValueError(
            f"{ckpt.folder}: trained with model.parametrization.name: {trained}, whose forward "
            "multipliers (readout, attention 1/d, residual branches) a Hugging Face Llama "
            "does not have; its export would compute other logits"
        )
    hf_map = family_of(config).hf
    if tok is not None:  # the config's ids where they are the tokenizer's special tokens
        ids, notes = ids_for_export(config, tok)
        for note in notes:
            print(note, file=sys.stderr, flush=True)
        config = replace(config, **ids)
    hf_sd = hf_map.state_dict_to_hf(full_model_tensors(ckpt), config)
    if config.tie_word_embeddings:
        del hf_sd["lm_head.weight"]  # one storage, as save_pretrained writes tied weights
    hf_config = hf_map.config_to_hf(config)
    hf_config.architectures = [hf_map.architecture(config)]
    hf_config.dtype = ckpt.dtype

    def fill(tmp: Path) -> None:
        save_file(hf_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(tmp)
        GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        if tok is not None:
            _write_tokenizer(tok, tmp, config, _trained_chat_template(ckpt.train_config))

    return write_folder_atomically(Path(out), fill, overwrite)


def _trained_chat_template(train_config: dict) -> str | None:
    """The chat template the run's SFT data was rendered with when its config gave one
    (`dataset.chat_template`, the last SFT stage's); None: the tokenizer's own, if any."""
    for stage in reversed(train_config.get("data_stages") or []):
        ds = ((stage if isinstance(stage, dict) else {}).get("data") or {}).get("dataset")
        if isinstance(ds, dict) and ds.get("sft_dataloader") and ds.get("chat_template"):
            return str(ds["chat_template"])
    return None


def _write_tokenizer(tok, dst: Path, config, chat_template: str | None = None) -> None:
    """The tokenizer's files; `chat_template` (the one trained with) as chat_template.jinja,
    which transformers reads before tokenizer_config.json's, so apply_chat_template renders
    conversations as the fine-tune saw them."""
    from nanotron_train.data.chat import CHAT_TEMPLATE_FILE

    src = Path(tok.path).parent
    copied = copy_tokenizer_files(src, dst)
    if chat_template is not None:
        (dst / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    if "tokenizer.json" not in copied:
        (dst / "tokenizer.json").write_bytes(Path(tok.path).read_bytes())
    if "tokenizer_config.json" not in copied:  # a bare tokenizer.json: describe it
        eos = tok.tokenizer.id_to_token(config.eos_token_id)
        bos = tok.tokenizer.id_to_token(config.bos_token_id)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos}
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _derived_config(hf: dict, model_config, dtype: str, tokenizer: str | None, out: Path):
    """A sensible fine-tuning config for an imported model (edit data_stages before use)."""
    from nanotron_train.config.load import config_from_dict

    seq = min(2048, model_config.max_position_embeddings)
    raw = {
        "general": {"project": "nanotron", "run": "from-hf", "seed": 42},
        "model": {
            "model_config": model_config.to_dict(),
            "init_method": {"std": model_config.initializer_range},
            "dtype": dtype,
        },
        "tokenizer": {"tokenizer_name_or_path": tokenizer},
        "tokens": {
            "sequence_length": seq,
            "micro_batch_size": 1,
            "batch_accumulation_per_replica": 1,
            "train_steps": 1000,
        },
        "optimizer": {
            "learning_rate_scheduler": {
                "learning_rate": 3.0e-5,
                "lr_warmup_steps": 10,
                "lr_decay_style": "cosine",
                "min_decay_lr": 3.0e-6,
            },
            "weight_decay": 0.01,
            "clip_grad": 1.0,
        },
        "checkpoints": {
            "checkpoints_path": str(out.resolve()),
            "checkpoint_interval": 100,
            "resume_checkpoint_path": str(out.resolve()),  # start from the imported weights
        },
    }
    return config_from_dict(raw, f"<derived from {hf.get('_name_or_path') or 'config.json'}>")


def _check_same_model(cfg, model_config, config_file: str) -> None:
    from nanotron_models.families import family_of
    from nanotron_train.model_factory import padded_model_config

    mine, theirs = padded_model_config(cfg.model).to_dict(), model_config.to_dict()
    keys = family_of(model_config).arch_keys  # the HF model's family's architecture fields
    diff = [
        f"{k}: config {mine.get(k)!r}, HF {theirs.get(k)!r}"
        for k in keys
        if mine.get(k) != theirs.get(k)
    ]
    if diff:
        raise HFFolderError(
            f"{config_file}: model.model_config does not describe the HF model "
            f"({'; '.join(diff)}; the vocab is after make_vocab_size_divisible_by)"
        )


def _data_state(cfg, step: int) -> dict:
    """The data position of a run that has consumed nothing yet, at `step`."""
    if all(s.data.dataset is None for s in cfg.data_stages):
        return {"consumed_samples": 0}
    from nanotron_train.data.train_data import STATE_VERSION

    names = [s.name for s in cfg.data_stages if s.start_training_step <= max(step, 1)]
    return {
        "version": STATE_VERSION,
        "step": step,
        "consumed_samples": 0,
        "stage_index": len(names) - 1,
        "stage_name": names[-1],
        "stage_consumed_samples": 0,
        "dataset_consumed_samples": None,
        "stages_consumed_samples": {},
    }


def from_hf(
    hf_path: str | Path, out: str | Path, *, config_file: str | None = None, step: int = 0
) -> Path:
    """Import a Hugging Face Llama folder as `<out>/<step>/`; returns the step folder."""
    from nanotron_models.families import family_of_hf
    from nanotron_train.checkpoints import CheckpointError
    from nanotron_train.config.load import load_config

    hf_dir, out = Path(hf_path), Path(out)
    if step < 0:
        raise HFFolderError(f"--step must be >= 0, got {step}")
    hf = read_hf_config(hf_dir)
    hf_map = family_of_hf(hf).hf
    model_config = hf_map.config_from_hf(hf).validate()
    has_tokenizer = (hf_dir / "tokenizer.json").is_file()
    tok_dir = out / "tokenizer"
    if config_file:
        # A checkpoint's own config records its step (general.step), which only a resume may
        # carry; the import writes a new checkpoint at --step, so that record does not apply.
        cfg = load_config(config_file, ["general.step=null", "general.consumed_train_samples=null"])
        _check_same_model(cfg, model_config, config_file)
    else:
        tok = str(tok_dir.resolve()) if has_tokenizer else None
        cfg = _derived_config(hf, model_config, hf_dtype_name(hf), tok, out)
    if (out / str(step)).exists():
        raise CheckpointError(f"{out / str(step)}: already exists; choose another --out or --step")
    hf_sd = read_hf_weights(hf_dir)
    if has_tokenizer and not tok_dir.exists():
        write_folder_atomically(tok_dir, lambda d: copy_tokenizer_files(hf_dir, d), False)
    return save_imported(
        cfg, lambda mc: hf_map.state_dict_from_hf(hf_sd, mc), out, step, consumed_samples=0
    )


def save_imported(
    cfg, full_state_dict, out: Path, step: int, consumed_samples: int, consumed_tokens: int = 0
) -> Path:
    """Write `<out>/<step>/` holding the weights `full_state_dict(model_config)` returns (our
    global names, full tensors), a fresh optimizer, the LR schedule at `step` and `cfg`."""
    from nanotron_models.config import DTYPES
    from nanotron_models.families import load_full_state_dict
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.checkpoints import save_checkpoint
    from nanotron_train.lr_schedule import build_lr_schedule
    from nanotron_train.model_factory import build_family_stage, padded_model_config

    pc = ParallelContext()
    try:
        torch.manual_seed(cfg.general.seed)
        mc = padded_model_config(cfg.model)
        model = build_family_stage(
            mc, pc, cfg.tokens.sequence_length, dtype=DTYPES[cfg.model.dtype], seed=cfg.general.seed
        )
        load_full_state_dict(model, full_state_dict(mc))
        # The state a run at `step` would checkpoint, before any optimizer step was taken.
        state = SimpleNamespace(
            model=model,
            # no optimizer state: the run that loads it starts its optimizer fresh
            optimizer=SimpleNamespace(
                pieces=[], inner=None, state_kinds=lambda piece: (), settings=lambda: {}
            ),
            lr_schedule=build_lr_schedule(
                cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
            ),
            data=SimpleNamespace(state_dict=lambda: _data_state(cfg, step)),
            step=step,
            consumed_samples=consumed_samples,
            consumed_tokens=consumed_tokens,
            data_step_offset=0,
            spike_rollbacks=[],
        )
        random.seed(cfg.general.seed)
        np.random.seed(cfg.general.seed % 2**32)
        return save_checkpoint(out, state, cfg, pc, zero_stage=0)
    finally:
        pc.destroy()


def from_nanotron(nanotron_path: str | Path, out: str | Path) -> Path:
    """Import a Nanotron checkpoint (weights, step, config) as `<out>/<step>/`."""
    from nanotron_train.checkpoints import CheckpointError
    from nanotron_train.config.load import config_from_dict
    from nanotron_train.interop import nanotron_checkpoint as nt

    folder, out = nt.resolve(nanotron_path), Path(out)
    step, samples, tokens = nt.read_position(folder)
    raw = nt.read_config(folder)
    raw.setdefault("checkpoints", {})
    raw["checkpoints"].update(
        checkpoints_path=str(out.resolve()), resume_checkpoint_path=str(out.resolve())
    )
    raw.setdefault("general", {}).update(step=step, consumed_train_samples=samples)
    cfg = config_from_dict(raw, f"{folder / 'config.yaml'} (translated)")
    if (out / str(step)).exists():
        raise CheckpointError(f"{out / str(step)}: already exists; choose another --out")
    weights = nt.read_model_weights(folder, cfg.model.model_config)
    tokens = tokens or samples * cfg.tokens.sequence_length  # not recorded (read_position)
    return save_imported(cfg, lambda mc: weights, out, step, samples, tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nanotron_train.convert", description="Hugging Face export and import"
    )
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-hf", help="checkpoint -> Hugging Face folder")
    a.add_argument(
        "--ckpt-path", required=True, help="a checkpoint step folder or checkpoints root"
    )
    a.add_argument("--out", required=True, help="the folder to write")
    a.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a.add_argument(
        "--no-tokenizer", action="store_true", help="export without tokenizer files (no tokenizer)"
    )
    a.add_argument("--tokenizer", help=TOKENIZER_HELP)
    b = sub.add_parser("from-hf", help="Hugging Face folder -> checkpoint")
    b.add_argument("--hf-path", required=True, help="a local Hugging Face Llama folder")
    b.add_argument("--out", required=True, help="the checkpoints folder to write <out>/<step>/ in")
    b.add_argument("--config-file", help="the training config to store (default: derived)")
    b.add_argument("--step", type=int, default=0, help="the step the checkpoint is at (default 0)")
    c = sub.add_parser("from-nanotron", help="Nanotron checkpoint -> checkpoint")
    c.add_argument(
        "--nanotron-path", required=True, help="a Nanotron checkpoint step folder or its root"
    )
    c.add_argument("--out", required=True, help="the checkpoints folder to write <out>/<step>/ in")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "to-hf":
            path = to_hf(
                args.ckpt_path,
                args.out,
                overwrite=args.overwrite,
                tokenizer=not args.no_tokenizer,
                tokenizer_path=args.tokenizer,
            )
            print(f"wrote {path} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
        else:
            if args.command == "from-nanotron":
                path = from_nanotron(args.nanotron_path, args.out)
            else:
                path = from_hf(args.hf_path, args.out, config_file=args.config_file, step=args.step)
            print(
                f"wrote {path}; fine-tune with: python -m nanotron_train "
                f"--config-file {path / 'config.yaml'} --resume {path}"
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
