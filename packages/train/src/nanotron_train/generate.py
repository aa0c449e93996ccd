"""`torchrun --nproc_per_node=N -m nanotron_train.generate --ckpt-path CKPT --prompt TEXT ...`

Loads a checkpoint (saved in any layout) at tp = N / pp (`--pp`, default 1: with more, each
step is pipelined over the stages, nanotron_train/inference/pipelined_decoding.py), encodes the prompts with the
checkpoint's tokenizer (or --tokenizer PATH), decodes them in one left-padded batch with the KV cache (greedy at
temperature 0, else top-k / top-p sampling from --seed), prints each prompt and its
continuation, then the decode speed. `python -m nanotron_train.generate ...` runs one process.
A user error prints one line from rank 0 and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from nanotron_models.config import DTYPES
from nanotron_train.inference.model_io import TOKENIZER_HELP
from nanotron_train.launching.tp_command import run_over_tp
from nanotron_train.process_exit import exit_process


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nanotron_train.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--ckpt-path", required=True, help="a checkpoint step folder or checkpoints root"
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: all ranks)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the processes are pp x tp)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the training dtype")
    p.add_argument("--output-json", help="also write prompts, token ids and texts to this file")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    from nanotron_train.inference.decoding import DecodingError

    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise DecodingError(f"--prompts-file {args.prompts_file}: {exc.strerror}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise DecodingError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def run(args: argparse.Namespace, pc) -> dict:
    """Generate on every rank of `pc` (tp ranks only); returns the report (same on all ranks)."""
    from nanotron_train.config.token_ids import generation_eos
    from nanotron_train.inference.decoding import generate
    from nanotron_train.inference.model_io import load_model, load_tokenizer_of, open_checkpoint
    from nanotron_train.inference.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).validate()
    prompts = read_prompts(args)
    ckpt = open_checkpoint(args.ckpt_path, args.tokenizer)
    tok = load_tokenizer_of(ckpt)
    # The EOS a Hugging Face export of this checkpoint would write (token_ids.py): the config's
    # where it is a special token of the tokenizer, else the tokenizer's own.
    eos = generation_eos(ckpt.model_config, tok)
    # An empty prompt starts a new document: EOS is what precedes one in the training data.
    ids = [tok.encode(p) or [tok.eos_token_id] for p in prompts]
    model = load_model(ckpt, pc, DTYPES[args.dtype] if args.dtype else None)
    res = generate(model, ids, args.max_new_tokens, sampling, eos_token_id=eos, pad_token_id=eos)
    items = []
    for prompt, p_ids, new in zip(prompts, ids, res.tokens):
        text_ids = new[:-1] if new and new[-1] == eos else new
        items.append(
            {
                "prompt": prompt,
                "prompt_ids": p_ids,
                "new_ids": new,
                "continuation": tok.decode(text_ids),
            }
        )
    return {
        "checkpoint": str(ckpt.folder),
        "tp": pc.tp_size,
        "pp": pc.pp_size,
        "sampling": dataclasses.asdict(sampling),
        "results": items,
        "prompt_tokens": res.prompt_tokens,
        "prefill_s": res.prefill_s,
        "decode_s": res.decode_s,
        "decode_tokens": res.decode_tokens,
        "decode_tokens_per_s": res.decode_tokens_per_s,
    }


def print_report(report: dict, stream=None) -> None:
    stream = stream if stream is not None else sys.stdout
    for i, item in enumerate(report["results"]):
        print(f"=== [{i}] prompt ({len(item['prompt_ids'])} tokens) ===", file=stream)
        print(item["prompt"], file=stream)
        print(f"--- [{i}] continuation ({len(item['new_ids'])} tokens) ---", file=stream)
        print(item["continuation"], file=stream)
    print(
        f"prefill: {report['prompt_tokens']} prompt tokens in {report['prefill_s']:.3f} s | "
        f"decode: {report['decode_tokens']} tokens in {report['decode_s']:.3f} s = "
        f"{report['decode_tokens_per_s']:.1f} tokens/s (tp={report['tp']}, pp={report['pp']})",
        file=stream,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    status, report = run_over_tp(lambda pc: run(args, pc), tp=args.tp, pp=args.pp)
    if report is not None:
        print_report(report)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    exit_process(main())  # under torchrun too: no teardown after the outcome
