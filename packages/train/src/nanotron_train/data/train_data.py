"""``TrainData``: the trainer's view of the data — micro-batches for a step, and its position.

The stream of a stage is a sequence of samples (sequence_length + 1 tokens each), drawn from
its datasets by the deterministic blend and each dataset's seeded shuffle. Global batch k of
a stage is stream samples [(k-1)*G, k*G), G = mbs * accum * dp; dp rank r takes the contiguous
slice [r*mbs*accum, (r+1)*mbs*accum) of it, cut into accum micro-batches of mbs. So the global
batch is the same whatever dp is, and the position is just the consumed-sample count (plus the
blend's per-dataset counts), which is what ``state_dict`` holds.

Label mask at document boundaries (the stage's ``dataset.eod_mask_loss``): label position t
is masked when input token t is the last of a document (the EOS our tokenizer appends), i.e.
when its target is the first token of the next document. The prediction of EOS itself (a
document's end) is kept. Off by default: every label counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanotron_train.data.blend import blend_counts_at, blend_draw
from nanotron_train.data.cache import cached_nanoset
from nanotron_train.data.datatrove import (
    eod_label_mask,
    keep_first_tokens,
    open_tokenized_folder,
    positions,
)
from nanotron_train.data.documents import DOCUMENT_IDS_KEY, document_ids
from nanotron_train.data.errors import DataError
from nanotron_train.data.mixer import mixed_dataset
from nanotron_train.data.nanoset import Nanoset
from nanotron_train.data.sampler import ShuffledSamples
from nanotron_train.data.split import split_by_documents
from nanotron_train.data.stages import (
    StageSpec,
    check_weights,
    stage_index_for_step,
    validate_stages,
)
from nanotron_train.data.tokenizer import load_tokenizer

logger = logging.getLogger("nanotron_train.data")
STATE_VERSION = 1


@dataclass
class _Stage:
    spec: StageSpec
    nanosets: list[Nanoset]
    weights: list[float]
    samplers: list[ShuffledSamples]


def _check_sizes(sequence_length: int, micro_batch_size: int, accum: int, dp_size: int) -> None:
    for key, value in (
        ("tokens.sequence_length", sequence_length),
        ("tokens.micro_batch_size", micro_batch_size),
        ("tokens.batch_accumulation_per_replica", accum),
        ("parallelism.dp", dp_size),
    ):
        if value < 1:
            raise DataError(f"{key} must be >= 1, got {value}")


def _tokenizer_sha256(tokenizer_path: str | None, stages: list[StageSpec]) -> str | None:
    """The tokenizer's hash, to check the data against; None without one, or when it is not
    found locally and no stage needs it to tokenize a raw dataset."""
    if not tokenizer_path:
        return None
    try:
        return load_tokenizer(tokenizer_path).sha256
    except DataError:
        if any(s.dataset.hf_dataset_or_datasets is not None for s in stages):
            raise  # needed to tokenize the raw dataset
        # Nanoset folders carry their tokens: the tokenizer is only used for a check.
        logger.warning("data: tokenizer %r not found locally; not checked", tokenizer_path)
        return None


def _tokenizer_identity(
    tokenizer_path: str | None, tok_sha: str | None, first_stage: _Stage
) -> tuple[str, str] | None:
    """(what, sha256) of the data's tokenizer: the configured one, else the first folder's;
    None when unknown (a datatrove folder records a tokenizer name, not a hash)."""
    first = first_stage.nanosets[0]
    first_sha = first.metadata.tokenizer.get("sha256")
    if tok_sha:
        return (f"the tokenizer {tokenizer_path}", tok_sha)
    if first_sha is not None:
        return (f"the training data {first.folder}", str(first_sha))
    return None


def _raw_dataset_tokens(ds, tokenizer_path, cache_dir, barrier, builder) -> Path:
    """The token folder of a raw dataset: a local input, or Nanotron's mixer mapping
    {input: fraction} whose rows are mixed first (mixer.py)."""
    inputs, splits = ds.hf_dataset_or_datasets, ds.hf_dataset_splits or ["train"]
    identity = None
    if isinstance(inputs, dict | list):
        inputs = mixed_dataset(
            inputs, splits=splits, text_column=ds.text_column_name, cache_dir=cache_dir,
            is_builder=builder, barrier=barrier, overwrite=ds.dataset_overwrite_cache,
        )  # fmt: skip
        # the tokens keyed by the mix's key (its folder), not by its files' times
        inputs, splits, identity = str(inputs), None, inputs.parent.name
    return cached_nanoset(
        inputs, tokenizer_path=tokenizer_path, cache_dir=cache_dir,
        text_column=ds.text_column_name, is_builder=builder, barrier=barrier,
        num_workers=ds.dataset_processing_num_proc_per_process, splits=splits,
        overwrite=ds.dataset_overwrite_cache, identity=identity,
    )  # fmt: skip


class TrainData:
    def __init__(
        self,
        stages: list[StageSpec],
        *,
        sequence_length: int,
        micro_batch_size: int,
        batch_accumulation_per_replica: int,
        dp_rank: int,
        dp_size: int,
        tokenizer_path: str | None,
        cache_dir: str,
        model_vocab_size: int,
        validation_split: float | None = None,
        barrier: Callable[[], None] | None = None,
        is_builder: bool = True,
        document_masking: bool = False,
    ):
        validate_stages(stages)
        _check_sizes(sequence_length, micro_batch_size, batch_accumulation_per_replica, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.sequence_length = sequence_length
        self.micro_batch_size = micro_batch_size
        self.accum = batch_accumulation_per_replica
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch_size = micro_batch_size * batch_accumulation_per_replica * dp_size
        self.validation_split = validation_split
        # folder -> its held-out validation part (validation.split), each folder once
        self.held_out: dict[str, Nanoset] = {}
        self.model_vocab_size = model_vocab_size
        # The model masks attention at document ends: give positions and document ids.
        self.document_masking = document_masking
        tok_sha = _tokenizer_sha256(tokenizer_path, stages)
        self._stages = [
            self._open_stage(i, s, tokenizer_path, tok_sha, cache_dir, model_vocab_size,
                             barrier, is_builder)
            for i, s in enumerate(stages)
        ]  # fmt: skip
        self._specs = list(stages)
        # (what, sha256) of the tokenizer of this data: a validation folder must match it.
        self.tokenizer_sha256 = _tokenizer_identity(tokenizer_path, tok_sha, self._stages[0])
        # Position: everything below is what state_dict saves.
        self.consumed_samples = 0
        self._step = 0  # the last step served
        self._stage_index = 0
        self._stage_consumed = 0
        self._counts = [0] * len(self._stages[0].nanosets)
        self._stages_consumed = {s.name: 0 for s in stages}
        self._last_batch: list[tuple[int, int]] | None = None

    def _open_stage(self, i, spec, tokenizer_path, tok_sha, cache_dir, vocab, barrier, builder):
        ds = spec.dataset
        if ds.dataset_folder is not None:
            folders = list(ds.dataset_folder)
        else:
            folders = [str(_raw_dataset_tokens(ds, tokenizer_path, cache_dir, barrier, builder))]
        weights = check_weights(ds.dataset_weights, len(folders), f"data_stages[{i}].data.dataset")
        if ds.dataset_read_path is not None:  # Nanotron: read the local copy where it exists
            folders = [r if Path(r).exists() else f for f, r in zip(folders, ds.dataset_read_path)]
        nanosets = [open_tokenized_folder(f, ds, spec.seed, vocab) for f in folders]
        for ns, limit in zip(nanosets, ds.dataset_max_tokens or []):
            keep_first_tokens(ns, limit)
        if self.validation_split is not None:  # train on the kept documents only (split.py)
            seq = spec.sequence_length or self.sequence_length
            parts = [split_by_documents(ns, self.validation_split, seq) for ns in nanosets]
            nanosets = [train for train, _ in parts]
            for ns, (_, val) in zip(nanosets, parts):
                self.held_out.setdefault(str(Path(ns.folder).resolve()), val)
        samplers = []
        seq = spec.sequence_length or self.sequence_length
        for d, ns in enumerate(nanosets):
            n = ns.num_samples(seq)
            if n < 1:
                raise DataError(
                    f"{ns.folder}: {ns.num_tokens} tokens are too few for one sample of "
                    f"sequence_length + 1 = {seq + 1}"
                )
            if tok_sha and ns.metadata.tokenizer.get("sha256") not in (None, tok_sha):
                logger.warning("data: %s was tokenized with another tokenizer", ns.folder)
            samplers.append(
                ShuffledSamples(n, spec.seed, d, f"stage {spec.name!r} {ns.folder}",
                                log=self.dp_rank == 0)
            )  # fmt: skip
        return _Stage(spec, nanosets, weights, samplers)

    # ---- position -------------------------------------------------------------------------

    def _advance(self, step: int) -> list[tuple[int, int]]:
        """Draw the global batch of ``step`` (the next one) and move the position past it."""
        index = stage_index_for_step(self._specs, step)
        if index != self._stage_index:
            stage = self._stages[index]
            logger.info("data: step %d starts data stage %r", step, stage.spec.name)
            self._stage_index = index
            self._stage_consumed = 0
            self._counts = [0] * len(stage.nanosets)
        stage = self._stages[self._stage_index]
        before = list(self._counts)
        G = self.global_batch_size
        if len(stage.samplers) == 1:  # the common case, kept cheap
            self._counts[0] += G
            batch = [(0, i) for i in stage.samplers[0].sample_ids(before[0], G).tolist()]
        else:
            picks = np.asarray(blend_draw(self._counts, stage.weights, G))
            ids = np.empty(G, dtype=np.int64)
            for d, sampler in enumerate(stage.samplers):
                rows = np.flatnonzero(picks == d)  # dataset d's draws, in stream order
                ids[rows] = sampler.sample_ids(before[d], len(rows))
            batch = list(zip(picks.tolist(), ids.tolist()))
        self._stage_consumed += self.global_batch_size
        self._stages_consumed[stage.spec.name] += self.global_batch_size
        self.consumed_samples += self.global_batch_size
        self._step = step
        return batch

    def micro_batches(self, step: int) -> list[dict]:
        """This dp rank's micro-batches of the global batch of ``step`` (1-based)."""
        if step == self._step and self._last_batch is not None:
            batch = self._last_batch  # asked again for the same step: same samples
        elif step > self._step:
            for s in range(self._step + 1, step + 1):  # skipped steps still consume samples
                batch = self._advance(s)
            self._last_batch = batch
        else:
            raise ValueError(f"micro_batches({step}): the data is already past step {self._step}")
        per_rank = self.micro_batch_size * self.accum
        mine = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        stage = self._stages[self._stage_index]
        return [
            self._collate(stage, mine[m * self.micro_batch_size : (m + 1) * self.micro_batch_size])
            for m in range(self.accum)
        ]

    def _collate(self, stage: _Stage, picks: list[tuple[int, int]]) -> dict:
        import torch

        S = stage.spec.sequence_length or self.sequence_length
        tokens = np.empty((len(picks), S + 1), dtype=np.int64)
        arrays = [ns.tokens for ns in stage.nanosets]
        for row, (d, sample) in enumerate(picks):  # the hot loop: one slice copy per sample
            start = sample * S
            tokens[row] = arrays[d][start : start + S + 1]
        # Token ids are checked here, once per sample on the host, not in the model (where a
        # check is a device sync per micro-batch); the files are unsigned, so only the top.
        too_big = tokens.max(axis=1) >= self.model_vocab_size
        if too_big.any():
            row = int(np.flatnonzero(too_big)[0])
            d, sample = picks[row]
            raise DataError(
                f"{stage.nanosets[d].folder}: sample {sample} holds token id "
                f"{int(tokens[row].max())}, outside the model's vocab_size {self.model_vocab_size}"
            )
        if stage.spec.dataset.eod_mask_loss:
            mask = np.empty((len(picks), S), dtype=bool)
            for d in {d for d, _ in picks}:
                rows = [r for r, (dd, _) in enumerate(picks) if dd == d]
                starts = np.asarray([picks[r][1] * S for r in rows], dtype=np.int64)
                mask[rows] = eod_label_mask(stage.nanosets[d].doc_ends, starts, S)
            label_mask = torch.from_numpy(mask)
        else:
            label_mask = torch.ones((len(picks), S), dtype=torch.bool)
        batch = {
            "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
            "label_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, 1:])),
            "label_mask": label_mask,
        }
        if stage.spec.dataset.return_positions or self.document_masking:
            pos = np.empty((len(picks), S), dtype=np.int64)  # restarting at each document
            for d in {d for d, _ in picks}:
                rows = [r for r, (dd, _) in enumerate(picks) if dd == d]
                starts = np.asarray([picks[r][1] * S for r in rows], dtype=np.int64)
                pos[rows] = positions(stage.nanosets[d].doc_ends, starts, S)
            batch["position_ids"] = torch.from_numpy(pos)
            if self.document_masking:
                batch[DOCUMENT_IDS_KEY] = torch.from_numpy(document_ids(pos))
        return batch

    # ---- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "consumed_samples": self.consumed_samples,
            "stage_index": self._stage_index,
            "stage_name": self._stages[self._stage_index].spec.name,
            "stage_consumed_samples": self._stage_consumed,
            "dataset_consumed_samples": list(self._counts),
            "stages_consumed_samples": dict(self._stages_consumed),
        }

    def load_state_dict(self, state: dict) -> None:
        names = [s.spec.name for s in self._stages]
        name = state.get("stage_name")
        if name not in names:
            raise DataError(f"data state: stage {name!r} is not in the config's stages {names}")
        index = names.index(name)
        stage = self._stages[index]
        counts = state.get("dataset_consumed_samples")
        if counts is None or len(counts) != len(stage.nanosets):
            # The blend changed (or an old state): replay it from the stage's sample count.
            counts = blend_counts_at(int(state["stage_consumed_samples"]), stage.weights)
        self._step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self._stage_index = index
        self._stage_consumed = int(state["stage_consumed_samples"])
        self._counts = [int(c) for c in counts]
        self._stages_consumed.update(state.get("stages_consumed_samples", {}))
        self._last_batch = None
