"""``python -m nanotron_train.data {tokenize,train-tokenizer,prepare-default,inspect}``.

A user error prints one line ``error: ...`` naming the file and exits 2 (no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from nanotron_train.data.errors import DataError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nanotron_train.data", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tokenize", help="tokenize local text/JSONL/parquet/HF data into a Nanoset")
    t.add_argument("--input", nargs="+", required=True, help="files, globs or folders")
    t.add_argument("--tokenizer", required=True, help="tokenizer folder or tokenizer.json")
    t.add_argument("--out", required=True, help="the Nanoset folder to create")
    t.add_argument("--text-column", default="text", help="JSONL field / column (default: text)")
    t.add_argument("--num-workers", type=int, default=None, help="worker processes")
    t.add_argument("--model-vocab-size", type=int, default=None, help="refuse a bigger vocab")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    t.add_argument("--no-progress", action="store_true")

    b = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer")
    b.add_argument("--input", nargs="+", required=True, help="files, globs or folders")
    b.add_argument("--vocab-size", type=int, required=True)
    b.add_argument("--out", required=True, help="the tokenizer folder to create")
    b.add_argument("--text-column", default="text")

    d = sub.add_parser("prepare-default", help="tokenizer + Nanoset of the Python stdlib (cached)")
    d.add_argument("--cache-dir", default=".cache/data")
    d.add_argument("--vocab-size", type=int, default=None)
    d.add_argument("--num-workers", type=int, default=None)
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--source-root", default=None, help="default: this interpreter's stdlib")

    i = sub.add_parser("inspect", help="validate a Nanoset and print its metadata")
    i.add_argument("folder")
    i.add_argument("--model-vocab-size", type=int, default=None)
    i.add_argument("--tokenizer", default=None, help="decode the first document with it")
    return p


def _run(args: argparse.Namespace) -> None:
    if args.command == "tokenize":
        from nanotron_train.data.tokenize import tokenize_to_nanoset

        t0 = time.perf_counter()
        out = tokenize_to_nanoset(
            args.input,
            args.tokenizer,
            args.out,
            text_column=args.text_column,
            num_workers=args.num_workers,
            model_vocab_size=args.model_vocab_size,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    elif args.command == "train-tokenizer":
        from nanotron_train.data.readers import expand_inputs, iter_documents
        from nanotron_train.data.tokenizer import train_tokenizer

        sources = expand_inputs(args.input)
        out = train_tokenizer(iter_documents(sources, args.text_column), args.vocab_size, args.out)
        print(f"wrote {out}")
    elif args.command == "prepare-default":
        from nanotron_train.data.corpus import DEFAULT_VOCAB_SIZE, prepare_default_corpus

        t0 = time.perf_counter()
        tok, nanoset = prepare_default_corpus(
            args.cache_dir,
            args.vocab_size or DEFAULT_VOCAB_SIZE,
            num_workers=args.num_workers,
            progress=not args.no_progress,
            root=args.source_root,
        )
        print(f"tokenizer: {tok}\nnanoset: {nanoset}\n({time.perf_counter() - t0:.1f} s)")
    else:
        from nanotron_train.data.nanoset import Nanoset

        ns = Nanoset(args.folder, model_vocab_size=args.model_vocab_size)
        _ = ns.doc_ends  # validates the document index too
        for key, value in vars(ns.metadata).items():
            print(f"{key}: {value}")
        if args.tokenizer:
            from nanotron_train.data.tokenizer import load_tokenizer

            print(repr(load_tokenizer(args.tokenizer).decode(ns.document(0)[:200])))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    try:
        _run(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    return 0
