"""Reading documents from local inputs: text files, JSONL, parquet and saved HF datasets.

Conventions:
- a plain text file is one document (source code and prose files keep their structure);
- a JSONL line is one document, its text in ``text_column``; blank lines are skipped;
- a parquet row is one document (column ``text_column``);
- a folder saved with ``datasets.save_to_disk`` is read with ``load_from_disk`` (every split,
  in name order); any other folder is searched recursively for files with known extensions.
Inputs expand in sorted order, so the same inputs always give the same document order.
Empty documents are skipped.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanotron_train.data.errors import DataError

TEXT_EXTENSIONS = {".txt", ".text", ".md", ".rst", ".py"}
JSONL_EXTENSIONS = {".jsonl", ".json", ".ndjson"}
PARQUET_EXTENSIONS = {".parquet"}
KNOWN_EXTENSIONS = TEXT_EXTENSIONS | JSONL_EXTENSIONS | PARQUET_EXTENSIONS


@dataclass(frozen=True)
class Source:
    kind: str  # "text" | "jsonl" | "parquet" | "hf"
    path: Path


def _is_saved_hf_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _kind_of_file(path: Path) -> str:
    ext = path.suffix.lower()
    if ext in JSONL_EXTENSIONS:
        return "jsonl"
    if ext in PARQUET_EXTENSIONS:
        return "parquet"
    return "text"


def expand_inputs(inputs: list[str] | str) -> list[Source]:
    """Files, globs and folders -> a sorted list of sources; a missing input is an error."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [str(inputs)]
    if not inputs:
        raise DataError("--input: no input given")
    sources: list[Source] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            if _is_saved_hf_dataset(path):
                sources.append(Source("hf", path))
                continue
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in KNOWN_EXTENSIONS and not _hidden(p, path)
            )
            if not files:
                raise DataError(f"{path}: folder holds no text/JSONL/parquet files")
            sources.extend(Source(_kind_of_file(p), p) for p in files)
        elif path.is_file():
            sources.append(Source(_kind_of_file(path), path))
        elif glob.has_magic(item):
            matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True))
            matches = [p for p in matches if p.is_file()]
            if not matches:
                raise DataError(f"{item}: pattern matches no file")
            sources.extend(Source(_kind_of_file(p), p) for p in matches)
        else:
            raise DataError(f"{path}: input does not exist")
    return sources


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Stream the lines of a big file; only "\n" ends a line (JSON may hold U+2028)."""
    with open(path, encoding="utf-8", newline="") as f:
        try:
            yield from enumerate(f, start=1)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _iter_jsonl(path: Path, column: str) -> Iterator[str]:
    for lineno, line in _utf8_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or column not in row:
            raise DataError(f"{path}:{lineno}: no {column!r} field (set --text-column)")
        text = row[column]
        if not isinstance(text, str):
            raise DataError(f"{path}:{lineno}: field {column!r} is not a string")
        yield text


def _iter_parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 (pyarrow raises several types)
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    if column not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {column!r} (columns: {pf.schema_arrow.names})")
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _iter_hf(path: Path, column: str, names: list[str] | None = None) -> Iterator[str]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}: cannot load the saved Hugging Face dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded) if names is None else names
        missing = [n for n in names if n not in loaded]
        if missing:
            raise DataError(f"{path}: no split {missing[0]!r} (splits: {sorted(loaded)})")
        splits = [loaded[name] for name in names]
    else:
        splits = [loaded]
    for split in splits:
        if column not in split.column_names:
            raise DataError(f"{path}: no column {column!r} (columns: {split.column_names})")
        for batch in split.select_columns([column]).iter(batch_size=1024):
            for text in batch[column]:
                if text is not None:
                    yield text


def iter_documents(
    sources: list[Source], text_column: str = "text", splits: list[str] | None = None
) -> Iterator[str]:
    """Every non-empty document of the sources, in order (`splits`: those of a saved
    DatasetDict, every split when None)."""
    for src in sources:
        if src.kind == "text":
            texts: Iterator[str] = iter([_read_text(src.path)])
        elif src.kind == "jsonl":
            texts = _iter_jsonl(src.path, text_column)
        elif src.kind == "parquet":
            texts = _iter_parquet(src.path, text_column)
        else:
            texts = _iter_hf(src.path, text_column, splits)
        for text in texts:
            if text:
                yield text


def source_files(src: Source) -> list[Path]:
    """The files behind a source (a saved HF dataset is a folder of them)."""
    if src.path.is_dir():
        return sorted(p for p in src.path.rglob("*") if p.is_file())
    return [src.path]


def total_bytes(sources: list[Source]) -> int:
    return sum(f.stat().st_size for src in sources for f in source_files(src))


def describe(sources: list[Source]) -> str:
    names = [str(s.path) for s in sources[:3]]
    more = f" and {len(sources) - 3} more" if len(sources) > 3 else ""
    return ", ".join(names) + more
