"""Ours against picotron or TorchTitan, same model and work, on the CPU: throughput or a profile.

Throughput (the default) runs the shared script `../shared/bench-peers/peers.sh` (see its
README: it builds the peers' environments under /tmp, alternates ours and the peer round after
round, and prints `layout ours_tok_s peer_tok_s ratio` per layout, then `min ratio R`):

    .venv/bin/python bench/peers.py --peer picotron --picotron-repo DIR [--rounds 3]
    .venv/bin/python bench/peers.py --peer titan [--layouts 1proc,dp2,tp2]

`--profile LAYOUT` (1proc, dp2, tp2-ar) instead runs one training of each side under
`bench/step_profile.py` and prints both phase tables (wall and CPU ms per step: data, forward,
backward, reduction wait, norm, optimizer, logging, ...) and, with `--ops N`, torch.profiler's
top ops: ours from this checkout, picotron from the environment the throughput run made
(/tmp/peer-pico; run that once first).

    .venv/bin/python bench/peers.py --peer picotron --profile 1proc --ops 25

The model is the shared script's (hidden 512, 8 layers, GQA 8/4, vocab 8192, sequence 256,
global batch 4, fp32); picotron's settings: AdamW without clipping, non-fused.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench-peers"
PICO = Path(os.environ.get("PICO", "/tmp/peer-pico"))
MODEL = {"HIDDEN": 512, "FFN": 1536, "LAYERS": 8, "HEADS": 8, "KV_HEADS": 4, "VOCAB": 8192,
         "SEQ": 256, "MBS": 2, "GBS": 4}  # fmt: skip
LAYOUTS = {"1proc": (1, 1, 1), "dp2": (2, 2, 1), "tp2-ar": (2, 1, 2)}  # nproc, dp, tp


def throughput(args) -> int:
    env = {**os.environ, "PEER": args.peer, "ROUNDS": str(args.rounds)}
    if args.layouts:
        env["LAYOUTS"] = args.layouts
    if args.picotron_repo:
        env["PICOTRON_REPO"] = str(Path(args.picotron_repo).resolve())
    elif args.peer == "titan":
        env.setdefault("PICOTRON_REPO", "-")  # the script asks for it whatever the peer
    return subprocess.call(["bash", str(SHARED / "peers.sh")], cwd=ROOT, env=env)


def ours_cmd(nproc: int, dp: int, tp: int, steps: int, work: Path) -> list[str]:
    m, accum = MODEL, MODEL["GBS"] // (MODEL["MBS"] * dp)
    sets = {
        "parallelism.dp": dp, "parallelism.tp": tp, "parallelism.pp": 1,
        "parallelism.tp_mode": "ALL_REDUCE",
        "model.model_config.hidden_size": m["HIDDEN"],
        "model.model_config.intermediate_size": m["FFN"],
        "model.model_config.num_hidden_layers": m["LAYERS"],
        "model.model_config.num_attention_heads": m["HEADS"],
        "model.model_config.num_key_value_heads": m["KV_HEADS"],
        "model.model_config.vocab_size": m["VOCAB"],
        "model.model_config.max_position_embeddings": m["SEQ"],
        "model.model_config.tie_word_embeddings": "false", "model.dtype": "float32",
        "tokens.sequence_length": m["SEQ"], "tokens.micro_batch_size": m["MBS"],
        "tokens.batch_accumulation_per_replica": accum, "tokens.train_steps": steps,
        "optimizer.zero_stage": 0, "optimizer.optimizer_factory.torch_adam_is_fused": "false",
        "optimizer.clip_grad": "null", "checkpoints.checkpoints_path": "null",
        "data_stages.0.data.dataset": "null", "logging.metrics_file": str(work / "metrics.jsonl"),
    }  # fmt: skip
    cmd = ["-m", "nanotron_train", "--config-file", str(ROOT / "configs/tiny-llama-cpu.yaml")]
    for key, value in sets.items():
        cmd += ["--override", f"{key}={value}"]
    return cmd


def pico_cmd(nproc: int, dp: int, tp: int, steps: int, work: Path) -> list[str]:
    m = MODEL
    assets = PICO / "assets-{HIDDEN}-{FFN}-{LAYERS}-{HEADS}-{KV_HEADS}-{VOCAB}-{SEQ}".format(**m)
    if not (assets / "model").is_dir():
        sys.exit(f"no {assets}: run the throughput bench for picotron once first")
    link = work / "hf_model_safetensors"  # where picotron reads the weights
    if not link.exists():
        link.symlink_to(assets / "model")
    env = {**os.environ, **{f"BENCH_{k}": str(v) for k, v in m.items()}}
    subprocess.check_call(
        [str(PICO / "bin/python"), str(SHARED / "pico_bench.py"), "config",
         str(work / "config.json"), "--model", str(assets / "model"), "--data",
         str(assets / "data"), "--tp", str(tp), "--dp", str(dp), "--mbs", str(m["MBS"]),
         "--accum", str(m["GBS"] // (m["MBS"] * dp)), "--steps", str(steps),
         "--threads", str(2 // nproc)],
        env=env,
    )  # fmt: skip
    return [str(PICO / "src/train.py"), "--config", str(work / "config.json")]


def profile(args) -> int:
    nproc, dp, tp = LAYOUTS[args.profile]
    rc = 0
    for fw, python, build in (
        ("ours", ROOT / ".venv/bin/python", ours_cmd),
        ("pico", PICO / "bin/python", pico_cmd),
    ):
        work = Path(args.work) / f"{args.profile}.{fw}"
        work.mkdir(parents=True, exist_ok=True)
        inner = build(nproc, dp, tp, args.warmup + args.steps + 1, work)
        cmd = [str(python), "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(ROOT / "bench/step_profile.py"), "--fw", fw,
               "--warmup", str(args.warmup), "--ops", str(args.ops),
               *(["--shapes"] if args.shapes else []), "--", *inner]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(2 // nproc), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf")}  # fmt: skip
        out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        (work / "log.txt").write_text(out.stdout + out.stderr)
        report = out.stdout[out.stdout.find("== step phases") :]
        print(report if "== step phases" in out.stdout else f"{fw} failed: {work}/log.txt")
        rc = rc or out.returncode
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", choices=["picotron", "titan"], default="picotron")
    ap.add_argument("--picotron-repo", help="a clone of huggingface/picotron (throughput)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", help="comma-separated; the shared script's default otherwise")
    ap.add_argument("--profile", choices=sorted(LAYOUTS), help="profile both sides instead")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps of a profile")
    ap.add_argument("--ops", type=int, default=0, help="torch.profiler's top N ops too")
    ap.add_argument("--shapes", action="store_true", help="--ops: a row per op and shapes")
    ap.add_argument("--work", default="/tmp/peer-profile", help="the profiles' folders")
    args = ap.parse_args()
    if args.profile:
        if args.peer != "picotron":
            ap.error("--profile compares with picotron")
        return profile(args)
    if args.peer == "picotron" and not args.picotron_repo:
        ap.error("--peer picotron needs --picotron-repo DIR (a clone of huggingface/picotron)")
    return throughput(args)


if __name__ == "__main__":
    sys.exit(main())
