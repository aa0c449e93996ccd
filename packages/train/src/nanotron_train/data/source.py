"""Pick the data source of a run: synthetic tokens (`dataset: null`), the real data path, or
both in one run (a stage of each), each stage with its own sequence length."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nanotron_train.config.schema import (
    Config,
    DatasetStageArgs,
    TokenizerArgs,
    TokensArgs,
    ValidationArgs,
)
from nanotron_train.data import StageSpec, TrainData, load_tokenizer
from nanotron_train.data.cache import failure_text
from nanotron_train.data.errors import DataError
from nanotron_train.data.synthetic import SyntheticData


class StagedData:
    """Data stages that each have their own source (synthetic or real): step k of the run is
    step k - start + 1 of its stage's source. Each source keeps its own position."""

    def __init__(self, starts: list[int], sources: list[Any]) -> None:
        self.starts, self.sources = starts, sources

    def stage_index(self, step: int) -> int:
        return max(i for i, start in enumerate(self.starts) if start <= step)

    def micro_batches(self, step: int) -> list[dict]:
        i = self.stage_index(step)
        return self.sources[i].micro_batches(step - self.starts[i] + 1)

    def state_dict(self) -> dict:
        return {"stages": [source.state_dict() for source in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        if "stages" not in state:
            if not state.get("consumed_samples"):
                return  # a converted checkpoint that has consumed nothing (convert.py)
            raise ValueError("data state: saved by a run whose data stages were not mixed")
        for source, part in zip(self.sources, state["stages"], strict=True):
            source.load_state_dict(part)


class Prefetched:
    """Nanotron's `num_loading_workers`: a background thread prepares the micro-batches of the
    next steps (as many steps ahead as the step's stage has workers) while the current one
    trains. The batches are the same as without it; `state_dict` is the position after the
    last step served, not after what was prefetched."""

    def __init__(self, source: Any, workers_at: Callable[[int], int]) -> None:
        self.source, self.workers_at = source, workers_at
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        self.pending: dict[int, Future] = {}
        self.state = source.state_dict()

    def _load(self, step: int) -> tuple[list[dict], dict]:
        batches = self.source.micro_batches(step)
        return batches, self.source.state_dict()

    def micro_batches(self, step: int) -> list[dict]:
        if step in self.pending:
            batches, self.state = self.pending.pop(step).result()
        else:  # nothing prefetched for it (the first step, or after a jump): from the position
            if self.pending:
                self._drain()
                self.source.load_state_dict(self.state)
            batches, self.state = self._load(step)
        for ahead in range(step + 1, step + 1 + self.workers_at(step + 1)):
            if ahead not in self.pending:
                self.pending[ahead] = self.pool.submit(self._load, ahead)
        return batches

    def _drain(self) -> None:
        for future in self.pending.values():
            future.cancel() or future.exception()  # wait for the one already running
        self.pending.clear()

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self._drain()
        self.source.load_state_dict(state)
        self.state = self.source.state_dict()

    def close(self) -> None:
        self._drain()
        self.pool.shutdown(wait=True)


def build_data(cfg: Config, pc) -> Any:
    """This dp rank's data: `micro_batches(step)`, `state_dict()`, `load_state_dict()`,
    prefetched in a background thread when data.num_loading_workers > 0."""
    source = _build_source(cfg.data_stages, _Shape.of(cfg), pc)
    stages = cfg.data_stages

    def workers_at(step: int) -> int:
        started = [s for s in stages if s.start_training_step <= step] or stages[:1]
        return started[-1].data.num_loading_workers

    if all(s.data.num_loading_workers == 0 for s in stages):
        return source
    return Prefetched(source, workers_at)


@dataclass(frozen=True)
class _Shape:
    """What the sources need beyond the stages: the batch shape (`tokens`), the tokenizer, the
    model's vocabulary and the held-out fraction."""

    tokens: TokensArgs
    tokenizer: TokenizerArgs
    vocab_size: int
    validation_split: float | None
    document_masking: bool = False  # the model masks documents: give their boundaries

    @classmethod
    def of(cls, cfg: Config) -> _Shape:
        split = cfg.validation.split if cfg.validation is not None else None
        mc = cfg.model.model_config
        return cls(cfg.tokens, cfg.tokenizer, mc.vocab_size, split, mc.document_masking)


def _build_source(stages: list[DatasetStageArgs], shape: _Shape, pc) -> Any:
    # Synthetic and SFT stages are sources of their own; the others share one TrainData.
    own = [s.data.dataset is None or s.data.dataset.is_sft for s in stages]
    if all(own) and len(stages) == 1:
        return _own_source(stages[0], shape, pc)
    if not any(own):  # one TrainData for every stage: one blend position across them
        return _real(stages, shape, pc)
    starts = [s.start_training_step for s in stages]
    sources = [
        _own_source(s, shape, pc) if is_own else _real([s], shape, pc, first=True)
        for s, is_own in zip(stages, own)
    ]
    return StagedData(starts, sources)


def _own_source(stage: DatasetStageArgs, shape: _Shape, pc) -> Any:
    return _synthetic(stage, shape, pc) if stage.data.dataset is None else _sft(stage, shape, pc)


def _sft(stage: DatasetStageArgs, shape: _Shape, pc) -> Any:
    from nanotron_train.data.sft import SFTData

    tok = shape.tokens
    return SFTData(
        stage.data.dataset,
        name=stage.name,
        seed=stage.data.seed,
        sequence_length=stage.sequence_length or tok.sequence_length,
        micro_batch_size=tok.micro_batch_size,
        batch_accumulation_per_replica=tok.batch_accumulation_per_replica,
        dp_rank=pc.dp_rank,
        dp_size=pc.dp_size,
        tokenizer_path=tokenizer_path(shape.tokenizer),
        model_vocab_size=shape.vocab_size,
        document_masking=shape.document_masking,
        cache=_sft_cache(stage.data.dataset, pc),
    )


def _cache_dir() -> str:
    return os.environ.get("NANOTRON_DATA_CACHE", ".cache/data")


def _sft_cache(spec, pc) -> Any:
    """Where SFT rows are cached; global rank 0 computes their key and builds them, the others
    read the key and wait (sft_cache.py)."""
    from nanotron_train.data.sft_cache import SFTCache

    barrier = BuilderBarrier(pc.rank == 0, _barrier_store(pc))
    return SFTCache(
        _cache_dir(),
        is_builder=pc.rank == 0,
        barrier=barrier,
        overwrite=spec.dataset_overwrite_cache,
        share=barrier.share,
    )


def tokenizer_path(tok: TokenizerArgs) -> str | None:
    """tokenizer.tokenizer_name_or_path, resolved to the cached file of tokenizer_revision when
    one is given (the data path then reads that file)."""
    if tok.tokenizer_revision is None or tok.tokenizer_name_or_path is None:
        return tok.tokenizer_name_or_path
    return load_tokenizer(tok.tokenizer_name_or_path, tok.tokenizer_revision).path


def _synthetic(stage: DatasetStageArgs, shape: _Shape, pc) -> SyntheticData:
    tok = shape.tokens
    return SyntheticData(
        seed=stage.data.seed,
        sequence_length=stage.sequence_length or tok.sequence_length,
        vocab_size=shape.vocab_size,
        micro_batch_size=tok.micro_batch_size,
        accumulation=tok.batch_accumulation_per_replica,
        dp_size=pc.dp_size,
        dp_rank=pc.dp_rank,
        documents=shape.document_masking,
    )


def _real(stages: list[DatasetStageArgs], shape: _Shape, pc, first: bool = False) -> TrainData:
    """TrainData over `stages` (with `first`, one stage that starts at its source's step 1)."""
    tok = shape.tokens
    specs = [
        StageSpec(
            name=s.name,
            start_training_step=1 if first else s.start_training_step,
            dataset=s.data.dataset,
            seed=s.data.seed,
            sequence_length=s.sequence_length,
        )
        for s in stages
    ]
    return TrainData(
        specs,
        sequence_length=tok.sequence_length,
        micro_batch_size=tok.micro_batch_size,
        batch_accumulation_per_replica=tok.batch_accumulation_per_replica,
        dp_rank=pc.dp_rank,
        dp_size=pc.dp_size,
        tokenizer_path=tokenizer_path(shape.tokenizer),
        cache_dir=_cache_dir(),
        model_vocab_size=shape.vocab_size,
        validation_split=shape.validation_split,
        barrier=BuilderBarrier(pc.rank == 0, _barrier_store(pc)),
        is_builder=pc.rank == 0,
        document_masking=shape.document_masking,
    )


_barriers = itertools.count()


def _barrier_store(pc):
    from nanotron_train.fault.coordination import shared_store

    # One namespace per barrier: every rank builds its data in the same order.
    return shared_store(f"data-cache{next(_barriers)}") if pc.world_size > 1 else None


class BuilderBarrier:
    """The data-cache barrier: the builder rank posts its outcome in the shared store; the
    others poll for it (no collective, so no timeout however long tokenizing takes) and get
    the builder's error at once if it failed."""

    POLL_S = 0.2

    def __init__(self, is_builder: bool, store=None) -> None:
        self.is_builder, self.store = is_builder, store
        self.calls = 0
        self.shared = 0

    def __call__(self, error: str | None) -> str | None:
        if self.store is None:
            return error
        self.calls += 1  # one key per call: every rank calls once per cached dataset
        key = f"outcome{self.calls}"
        if self.is_builder:
            self.store.set(key, json.dumps({"error": error}))
            return error
        return self._wait(key)["error"]

    def share(self, compute: Callable[[], str]) -> str:
        """`compute()` run by the builder and posted; the others read its value instead of
        computing it (an SFT cache key hashes every data file: read by one rank, not all) or
        fail at once with the builder's error. Without a store: computed here."""
        if self.store is None:
            return compute()
        self.shared += 1  # as calls: every rank shares once per cached dataset
        key = f"shared{self.shared}"
        if self.is_builder:
            try:
                value = compute()
            except Exception as exc:
                self.store.set(key, json.dumps({"error": failure_text(exc)}))
                raise
            self.store.set(key, json.dumps({"value": value}))
            return value
        got = self._wait(key)
        if "error" in got:
            raise DataError(f"the rank building the data cache failed: {got['error']}")
        return got["value"]

    def _wait(self, key: str) -> dict:
        while not self.store.check([key]):
            time.sleep(self.POLL_S)
        return json.loads(self.store.get(key))


def _eod_mask_loss(val: ValidationArgs, stages: list[DatasetStageArgs]) -> bool:
    """Whether validation masks the label after each document's end: `validation.dataset`'s
    own key, or with `validation.split` the training stages' (config/checks.py makes them agree)."""
    if val.split is None:
        return val.dataset.eod_mask_loss
    return any(s.data.dataset.eod_mask_loss for s in stages if s.data.dataset)


def build_validation_data(cfg: Config, pc, train_data: Any) -> Any:
    """This dp rank's `ValidationData`, or None without a `validation` section.

    validation.split: the documents `train_data` held out. validation.dataset: its folders,
    refused when they were tokenized with another tokenizer than the training data (or the
    config's tokenizer), or hold ids beyond the model's vocabulary.
    """
    val = cfg.validation
    if val is None:
        return None
    if val.dataset is not None and val.dataset.is_sft:  # held-out conversations (data/sft.py)
        return _sft_validation(cfg, pc)
    from nanotron_train.data import DataError
    from nanotron_train.data.datatrove import open_tokenized_folder
    from nanotron_train.data.stages import check_weights
    from nanotron_train.data.validation import ValidationData

    inner = getattr(train_data, "source", train_data)  # Prefetched wraps the source
    sources = getattr(inner, "sources", [inner])  # StagedData: one per stage
    weights = None
    if val.split is not None:
        held_out: dict[str, Any] = {}
        for source in sources:
            for folder, part in getattr(source, "held_out", {}).items():
                held_out.setdefault(folder, part)
        nanosets = list(held_out.values())
    else:
        spec = val.dataset
        folders = list(spec.dataset_folder or [])
        vocab = cfg.model.model_config.vocab_size
        nanosets = [open_tokenized_folder(f, spec, 0, vocab) for f in folders]
        if spec.dataset_weights is not None:
            weights = check_weights(spec.dataset_weights, len(folders), "validation.dataset")
        known = [getattr(s, "tokenizer_sha256", None) for s in sources]
        expected = next((k for k in known if k is not None), None)
        for ns in nanosets:
            sha = ns.metadata.tokenizer.get("sha256")
            if expected is not None and sha is not None and sha != expected[1]:
                raise DataError(
                    f"validation.dataset: {ns.folder} was tokenized with another tokenizer "
                    f"(sha256 {str(sha)[:12]}) than {expected[0]} ({expected[1][:12]})"
                )
    tok = cfg.tokens
    return ValidationData(
        nanosets,
        weights,
        sequence_length=tok.sequence_length,
        micro_batch_size=tok.micro_batch_size,
        batch_accumulation_per_replica=tok.batch_accumulation_per_replica,
        dp_rank=pc.dp_rank,
        dp_size=pc.dp_size,
        limit_batches=tok.limit_val_batches,
        eod_mask_loss=_eod_mask_loss(val, cfg.data_stages),
        document_masking=cfg.model.model_config.document_masking,
    )


def _sft_validation(cfg: Config, pc) -> Any:
    from nanotron_train.data.sft import SFTValidationData, packed_rows

    spec, tok, mc = cfg.validation.dataset, cfg.tokens, cfg.model.model_config
    where = f"validation.dataset: {spec.hf_dataset_or_datasets}"
    rows = packed_rows(spec, where, tok.sequence_length, tokenizer_path(cfg.tokenizer),
                       mc.vocab_size, mc.document_masking, _sft_cache(spec, pc))  # fmt: skip
    return SFTValidationData(
        rows,
        micro_batch_size=tok.micro_batch_size,
        batch_accumulation_per_replica=tok.batch_accumulation_per_replica,
        dp_rank=pc.dp_rank,
        dp_size=pc.dp_size,
        limit_batches=tok.limit_val_batches,
    )
