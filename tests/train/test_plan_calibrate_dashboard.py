"""`plan --calibrate http://HOST:PORT/runs/RUN_ID`: the planner reads the run's rank_stats from
a real dashboard (seeded with known values, token required) and fits the device's achievable
FLOP/s from compute_ms, the intra-node bandwidth from the tp bytes / tp_comm_ms (tp inside a
host) and the inter-node one from the dp bytes / dp_wait_ms (dp across the two hosts, the
reduction's overlap with the last backward added back), medians over the intervals with the
oldest left out; an unreachable dashboard, an unknown run, a run without rank_stats and a
missing token are one line naming the URL and exit status 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))
from dashboard_helpers import free_port, start_dashboard  # noqa: E402

from nanotron_models.families import family_of  # noqa: E402
from nanotron_train.config import load_config  # noqa: E402
from nanotron_train.plan.cli import main  # noqa: E402
from nanotron_train.plan.comm import collectives  # noqa: E402
from nanotron_train.plan.devices import DEVICES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-llama-cpu.yaml"
LAYOUT = ["--override", "parallelism.dp=2", "--override", "parallelism.tp=2"]
TOKEN = "calibration-token"
# per interval: (compute_ms, tp_comm_ms, dp_wait_ms) of rank 0; rank r adds r / 10 to each
INTERVALS = [(900.0, 90.0, 900.0), (40.0, 4.0, 20.0), (50.0, 6.0, 30.0), (45.0, 5.0, 25.0)]


def rank_stats(run_id: str, step: int, compute: float, tp: float, dp: float) -> dict:
    """dp=2 x tp=2 on two hosts: each tp pair on one host, each dp pair across them."""
    ranks = [
        {"rank": r, "host": f"node-{r // 2}", "dp": r // 2, "tp": r % 2, "pp": 0, "cp": 0,
         "step_ms": 200.0, "compute_ms": compute + r / 10, "tp_comm_ms": tp + r / 10,
         "pp_wait_ms": 0.0, "dp_wait_ms": dp + r / 10, "optimizer_ms": 1.0, "data_ms": 1.0,
         "mem_bytes": 1000, "mem_reserved_bytes": None, "gpu_util_pct": None,
         "gpu_power_w": None, "cpu_util_pct": None}
        for r in range(4)
    ]  # fmt: skip
    return {"type": "rank_stats", "run_id": run_id, "step": step, "time": 1.7e9 + step,
            "interval": 10, "ranks": ranks}  # fmt: skip


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    d = start_dashboard(tmp_path_factory.mktemp("cal") / "runs.db", token=TOKEN)
    for run in ("cal", "quiet"):
        d.post("/api/ingest", {"type": "run_start", "run_id": run})
    for i, values in enumerate(INTERVALS):
        d.post("/api/ingest", rank_stats("cal", 10 * (i + 1), *values))
    yield d
    d.stop()


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["--config-file", str(TINY), *LAYOUT, "--world", "4", "--device", "cpu", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def by_hand() -> tuple[float, float, float]:
    """(achievable, intra-node and inter-node bandwidth x link_efficiency) from the seeded
    values: medians over intervals 2-4 of the means over the ranks (+ 0.15 ms)."""
    cfg = load_config(TINY, LAYOUT[1::2])
    mc, tok = cfg.model.model_config, cfg.tokens
    compute, tp, dp = (0.045 + 0.00015, 0.005 + 0.00015, 0.025 + 0.00015)
    flops = family_of(mc).training_flops_per_token(mc, tok.sequence_length)
    m = tok.batch_accumulation_per_replica
    flops *= tok.micro_batch_size * m * tok.sequence_length / 2  # this rank's tokens (tp = 2)
    params = family_of(mc).num_parameters(mc) // 2
    wire = {"tp": 0.0, "dp": 0.0}
    for c in collectives(cfg, params, 0, mc.num_hidden_layers):
        wire[c.kind] += c.bytes * c.factor()
    # dp_wait is the reduction's part after the last backward: 2/3 of a micro-batch's compute
    # hides the rest (step_time.py)
    return (
        flops / DEVICES["cpu"].peak_flops / compute,
        wire["tp"] / tp,
        wire["dp"] / (dp + compute * 2 / 3 / m),
    )


def test_fits_compute_and_both_links_from_the_run_s_rank_stats(dashboard, capsys, monkeypatch):
    monkeypatch.setenv("NANOTRON_DASHBOARD_TOKEN", TOKEN)
    url = f"{dashboard.url}/runs/cal"
    code, out, err = plan(capsys, "--calibrate", url, "--json")
    assert code == 0, err
    body = json.loads(out)
    dev, eff = body["device"], DEVICES["cpu"].link_efficiency
    achievable, intra, inter = by_hand()
    assert dev["achievable"] == pytest.approx(achievable, rel=1e-9)
    assert dev["intra_node_bandwidth"] * eff == pytest.approx(intra, rel=1e-9)
    assert dev["inter_node_bandwidth"] * eff == pytest.approx(inter, rel=1e-9)
    assert dev["source"].endswith(f"fitted from {url}")
    lines = body["calibration"]
    assert lines[0].startswith("achievable fitted: ") and "compute_ms 45.15 ms" in lines[0]
    assert lines[1].startswith("intra_node_bandwidth fitted: ") and "tp_comm_ms 5.15 ms" in lines[1]
    assert (
        lines[2].startswith("inter_node_bandwidth fitted: ") and "dp_wait_ms 25.15 ms" in lines[2]
    )
    # the table form prints the same lines first; the api URL form is accepted too
    code, out, _ = plan(capsys, "--calibrate", f"{dashboard.url}/api/runs/cal")
    assert code == 0 and out.splitlines()[:3] == lines


def test_errors_are_one_line_naming_the_url(dashboard, capsys, monkeypatch):
    monkeypatch.setenv("NANOTRON_DASHBOARD_TOKEN", TOKEN)
    cases = [
        (f"http://127.0.0.1:{free_port()}/runs/cal", "the dashboard does not answer"),
        (f"{dashboard.url}/runs/nope", "the dashboard has no run 'nope'"),
        (f"{dashboard.url}/runs/quiet", "run 'quiet' has no rank_stats"),
        (f"{dashboard.url}/settings", "expected the run's dashboard page"),
    ]
    for url, why in cases:
        code, out, err = plan(capsys, "--calibrate", url)
        assert code == 2 and out == "", (url, out)
        assert err.startswith(f"error: --calibrate {url}: {why}"), err
        assert len(err.splitlines()) == 1, err
    monkeypatch.delenv("NANOTRON_DASHBOARD_TOKEN")
    code, _, err = plan(capsys, "--calibrate", f"{dashboard.url}/runs/cal")
    assert code == 2 and "wants a token: NANOTRON_DASHBOARD_TOKEN is unset or wrong" in err, err
