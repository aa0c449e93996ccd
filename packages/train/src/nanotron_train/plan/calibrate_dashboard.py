"""Fit the device from a run's per-rank telemetry on the dashboard (`--calibrate URL`).

URL: the run's dashboard page, `http://HOST:PORT/runs/RUN_ID` (or its `/api/runs/RUN_ID`);
the token, where the dashboard has one, from `NANOTRON_DASHBOARD_TOKEN` as the trainer sends
it. One bounded GET of `/api/runs/RUN_ID/rank_stats` (the newest MAX_INTERVALS intervals,
three fields): per interval the mean over the ranks, then the median over the intervals, the
oldest read left out (the run's start-up interval when the run has no more than
MAX_INTERVALS). Fitted, for the run's own layout (the config given to the planner):

* `achievable` = compute FLOPs / peak / measured `compute_ms`;
* a link's bandwidth (intra-node or inter-node: whether the group's ranks sit on more than one
  host, from the hosts rank_stats names) such that the planner's exposed time of the kinds on
  that link equals what the run measured of them: tp = `tp_comm_ms` (tp's collectives are
  exposed in full, so the fit is tp's bytes on the wire / tp_comm_ms), dp = `dp_wait_ms` (the
  gradient reduction after the backward the model overlaps it with, ZeRO's gathers). dp_wait
  includes the wait for slower ranks, so the dp fit is an effective bandwidth. When both
  kinds use one link they share one fit (their sum). The fit is stored as the device's
  bandwidth / `link_efficiency` (unchanged), so the planner's bandwidth x efficiency is it.
  A kind without traffic in the run (tp = 1, dp = 1) or without measured time leaves its link
  the device's value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter

from nanotron_train.plan.devices import Device

MAX_INTERVALS = 50
MAX_BODY = 64 << 20  # bytes read of the response at most (the server caps it near 25 MB)
# kind -> (the rank_stats field that measures it, the planner's kinds it covers)
MEASURED = {"tp": ("tp_comm_ms", ("tp",)), "dp": ("dp_wait_ms", ("dp", "zero_gather"))}
FIELDS = ("compute_ms", *(f for f, _ in MEASURED.values()))
LOWEST, HIGHEST = 1e-3, 1e18  # bytes/s: the range a link fit is searched in
LINK_FIELD = {True: "intra_node_bandwidth", False: "inter_node_bandwidth"}


class DashboardCalibrationError(ValueError):
    """The dashboard cannot give the run's rank_stats; the message is one line."""


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def split_run_url(url: str) -> tuple[str, str]:
    """(the dashboard's base URL, the run id) of a run page's URL."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    head, sep, run = path.rpartition("/runs/")
    if not sep or not run or "/" in run or not parts.netloc:
        raise DashboardCalibrationError(
            f"--calibrate {url}: expected the run's dashboard page, http://HOST:PORT/runs/RUN_ID"
        )
    head = head.removesuffix("/api")
    return f"{parts.scheme}://{parts.netloc}{head}", urllib.parse.unquote(run)


def fetch_rank_stats(url: str) -> dict:
    """The run's newest rank_stats intervals (FIELDS only) from the dashboard."""
    base, run = split_run_url(url)
    query = urllib.parse.urlencode({"max_steps": MAX_INTERVALS, "fields": ",".join(FIELDS)})
    req = urllib.request.Request(
        f"{base}/api/runs/{urllib.parse.quote(run, safe='')}/rank_stats?{query}"
    )
    token = os.environ.get("NANOTRON_DASHBOARD_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.loads(r.read(MAX_BODY))  # a longer answer: cut, so "not JSON"
    except urllib.error.HTTPError as exc:
        why = {404: f"the dashboard has no run {run!r}",
               401: "the dashboard wants a token: NANOTRON_DASHBOARD_TOKEN is unset or wrong",
               403: "the dashboard refused the token (NANOTRON_DASHBOARD_TOKEN)"}  # fmt: skip
        raise DashboardCalibrationError(
            f"--calibrate {url}: {why.get(exc.code, f'the dashboard answered {exc.code}')}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DashboardCalibrationError(
            f"--calibrate {url}: the dashboard does not answer ({reason})"
        ) from None
    except ValueError:
        raise DashboardCalibrationError(f"--calibrate {url}: the answer is not JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("values"), dict):
        raise DashboardCalibrationError(f"--calibrate {url}: the answer is not rank_stats")
    if not body.get("steps"):
        raise DashboardCalibrationError(
            f"--calibrate {url}: run {run!r} has no rank_stats (logging.rank_stats_interval)"
        )
    if len(body["steps"]) < 2:
        raise DashboardCalibrationError(
            f"--calibrate {url}: run {run!r} has one rank_stats interval only (start-up, left out)"
        )
    return body


def median_ms(body: dict, field: str) -> float:
    """Per interval the mean over the ranks that report it; the median over the intervals, the
    oldest read left out. NaN when no interval has a value."""
    means = []
    for row in body["values"][field][1:]:
        vals = [v for v in row if isinstance(v, int | float) and math.isfinite(v)]
        if vals:
            means.append(sum(vals) / len(vals))
    return statistics.median(means) if means else math.nan


def spans_hosts(ranks: list[dict], kind: str) -> bool:
    """Whether some group of `kind` (tp: same dp, pp, cp; dp: dp x cp, same tp, pp) holds ranks
    on more than one host."""
    key = ("dp", "pp", "cp") if kind == "tp" else ("tp", "pp")
    hosts: dict[tuple, set] = {}
    for r in ranks:
        hosts.setdefault(tuple(r.get(k, 0) for k in key), set()).add(r.get("host"))
    return any(len(h) > 1 for h in hosts.values())


def _solve(target: float, predicted, low: float, high: float) -> float:
    """The x in [low, high] (log-bisection) where the non-increasing predicted(x) = target."""
    for _ in range(200):
        mid = math.sqrt(low * high)
        if predicted(mid) > target:
            low = mid
        else:
            high = mid
        if high / low < 1 + 1e-13:
            break
    return math.sqrt(low * high)


def fit_links(device: Device, predict_time, measured: dict[str, float], intra: dict):
    """The device with each link that carries a measured kind fitted, and one line per link."""
    lines = []
    for on_intra in (True, False):
        kinds = [k for k, t in measured.items() if intra[k] == on_intra and t > 0]
        field = LINK_FIELD[on_intra]

        def exposed(bw: float, kinds=kinds, field=field, base=device) -> float:
            t = predict_time(dataclasses.replace(base, **{field: bw}))
            return sum(t.exposed_by_kind.get(k2, 0.0) for k in kinds for k2 in MEASURED[k][1])

        kinds = [k for k in kinds if exposed(LOWEST, [k]) > 0]  # with traffic in this layout
        if not kinds:
            continue
        target = sum(measured[k] for k in kinds)
        bw = _solve(target, lambda b, kinds=kinds: exposed(b, kinds), LOWEST, HIGHEST)
        device = dataclasses.replace(device, **{field: bw})
        what = " + ".join(f"{MEASURED[k][0]} {measured[k] * 1e3:.4g} ms" for k in kinds)
        lines.append(
            f"{field} fitted: {bw * device.link_efficiency / 1e9:.4g} GB/s effective "
            f"({bw / 1e9:.4g} GB/s x link_efficiency {device.link_efficiency}) from {what}"
        )
    return device, lines


def calibrate_from_dashboard(device: Device, cfg, url: str) -> tuple[Device, list[str]]:
    """The device fitted to the run at `url` (its own layout: `cfg`), and what was fitted."""
    from nanotron_train.plan.enumerate import predict

    body = fetch_rank_stats(url)
    par = cfg.parallelism
    world = par.dp * par.tp * par.pp * par.context_parallel_size
    if len(body.get("ranks", [])) != world:
        raise DashboardCalibrationError(
            f"--calibrate {url}: the run has {len(body.get('ranks', []))} ranks, the config's "
            f"layout {world}: give the planner the config the run used"
        )
    n = len(body["steps"]) - 1
    compute = median_ms(body, "compute_ms") / 1e3
    if not compute > 0:
        raise DashboardCalibrationError(f"--calibrate {url}: no compute_ms measured")
    t = predict(cfg, device, world, world).time
    device = dataclasses.replace(device, achievable=device.achievable * t.compute / compute)
    lines = [
        f"achievable fitted: {device.achievable:.4g} from compute_ms {compute * 1e3:.4g} ms "
        f"(median of {n} intervals, the oldest read left out)"
    ]
    measured = {k: median_ms(body, f) / 1e3 for k, (f, _) in MEASURED.items()}
    measured = {k: v for k, v in measured.items() if math.isfinite(v)}
    intra = {k: not spans_hosts(body["ranks"], k) for k in MEASURED}
    # the run's ranks per host: the planner's links then are the run's (contiguous ranks)
    per_host = max(Counter(r.get("host") for r in body["ranks"]).values())
    device, link_lines = fit_links(
        device, lambda d: predict(cfg, d, world, per_host).time, measured, intra
    )
    kept = [f for f in LINK_FIELD.values() if not any(line.startswith(f) for line in link_lines)]
    lines += link_lines + [f"{f} kept: no measured traffic on it" for f in kept]
    source = f"{device.source}; fitted from {url}"
    return dataclasses.replace(device, source=source), lines
