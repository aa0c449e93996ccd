"""`python -m nanotron_train.plan --config-file C.yaml --world N --gpus-per-node G --device D`.

Prints the fastest layouts that fit as a table, the `--override` flags of the best, and how
many layouts do not fit (with what overflows); `--json` prints every layout instead. A user's
error (config, device, numbers, metrics file, the dashboard's run) is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from nanotron_train.config import ConfigError, load_config
from nanotron_train.plan.calibrate import CalibrationError, calibrate
from nanotron_train.plan.calibrate_dashboard import (
    DashboardCalibrationError,
    calibrate_from_dashboard,
    is_url,
)
from nanotron_train.plan.devices import DeviceError, load_device
from nanotron_train.plan.enumerate import Plan, plan

COLUMNS = ("dp", "tp", "pp", "context_parallel_size", "expert_parallel_size", "pp_engine")
SHORT = {"context_parallel_size": "cp", "expert_parallel_size": "ep", "pp_engine": "engine"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m nanotron_train.plan", description=__doc__)
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--override", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--world", type=int, required=True, help="ranks (GPUs) in all")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--device", default="h100", help="h100, h200, a100, b200, cpu or a YAML file")
    ap.add_argument(
        "--calibrate",
        metavar="METRICS.jsonl|URL",
        help="fit the device from a run: its metrics file, or its dashboard page "
        "http://HOST:PORT/runs/RUN_ID (token: NANOTRON_DASHBOARD_TOKEN)",
    )
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="every layout as JSON")
    return ap.parse_args(argv)


def flags(p: Plan, cfg) -> str:
    """The `--override` flags that turn `cfg` into the layout (its values that differ)."""
    changed = {k: v for k, v in p.overrides.items() if _value(cfg, k) != v}
    if not changed:
        return "(the config's own layout: nothing to override)"
    return " ".join(f"--override {k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in changed.items())  # fmt: skip


def _value(cfg, dotted: str) -> object:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def table(plans: list[Plan]) -> str:
    head = ["#", *(SHORT.get(c, c) for c in COLUMNS), "zero", "mbs", "m", "recompute",
            "mem GiB", "step s", "compute", "comm", "idle", "tok/s/dev", "MFU"]  # fmt: skip
    rows = [head]
    for i, p in enumerate(plans, 1):
        o, t = p.overrides, p.time
        rows.append([
            str(i), *(str(o[f"parallelism.{c}"]) for c in COLUMNS),
            str(o["optimizer.zero_stage"]), str(o["tokens.micro_batch_size"]),
            str(o["tokens.batch_accumulation_per_replica"]),
            "full" if o["parallelism.recompute_layer"] else "off",
            f"{p.memory.total / 2**30:.2f}", f"{t.total:.3g}", f"{t.compute:.3g}",
            f"{t.exposed_comm:.3g}", f"{t.idle:.3g}", f"{p.tokens_per_s_per_device:.4g}",
            f"{p.mfu:.3f}",
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def report(plans: list[Plan], refused: int, device, top: int, cfg) -> str:
    fits = [p for p in plans if p.fits]
    over = [p for p in plans if not p.fits]
    lines = [f"device {device.name} ({device.source}); {len(plans)} layouts "
             f"({refused} refused by the config checks): {len(fits)} fit, {len(over)} do not"]  # fmt: skip
    if fits:
        lines += [table(fits[:top]), "", "best layout's overrides:", flags(fits[0], cfg)]
    if over:
        least = min(over, key=lambda p: p.memory.total)
        lines += ["", f"smallest that does not fit: {least.overflow}", flags(least, cfg)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.world < 1 or args.gpus_per_node < 1 or args.top < 1:
            raise ValueError("--world, --gpus-per-node and --top must be >= 1")
        cfg = load_config(args.config_file, args.override)
        device = load_device(args.device)
        fitted: list[str] = []
        if args.calibrate and is_url(args.calibrate):
            device, fitted = calibrate_from_dashboard(device, cfg, args.calibrate)
        elif args.calibrate:
            device = calibrate(device, cfg, args.calibrate)
        plans, refused = plan(cfg, device, args.world, args.gpus_per_node)
    except (ConfigError, DeviceError, CalibrationError, DashboardCalibrationError, ValueError,
            OSError) as exc:  # fmt: skip
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not plans:
        print(f"error: no layout of {args.world} ranks passes the config checks", file=sys.stderr)
        return 2
    if args.json:
        layouts = [p.as_dict() for p in plans]
        print(json.dumps({"device": device.__dict__, "calibration": fitted, "layouts": layouts}))
    else:
        print("\n".join([*fitted, report(plans, refused, device, args.top, cfg)]))
    return 0
