"""End to end, the straggler view: a real 4-process run (dp=2 x pp=2, gloo) streams to a real
dashboard while the test slows one worker from outside (SIGSTOP/SIGCONT in a loop, 60 ms of
every 70, as in tests/train/test_telemetry.py; rank 3: dp=1 tp=0 pp=1); then real Chromium on the run page. What the trainer measured must be what
the dashboard stored (REST) and what the page draws: the slowed rank's heatmap row framed and
hotter than its stage peer, every cell in the colour of its value, the event naming the rank
with its coordinates and host, and the Gantt chart's bars where the recorded timeline puts
them. Screenshots go to $NANOTRON_SCREENSHOTS (default: the test's temporary folder)."""

from __future__ import annotations

import math
import os
import socket
import statistics
from pathlib import Path

import pytest

from tests.train.telemetry_helpers import Torchrun4, telemetry_config

pytestmark = pytest.mark.browser

LAYOUT = {"dp": 2, "tp": 1, "pp": 2}
STEPS, INTERVAL, TIMELINE_EVERY, M = 40, 2, 10, 2
MARGIN, SLOW_INTERVALS = 0.5, 6  # the detector's defaults; the slowed rank is 2.5-5x its peer
SLOW_RANK, PEER = 3, 2  # ranks are pp-major: 3 is dp=1 pp=1; 2 (dp=0 pp=1) does the same work
PROJECT, NAME = "e2e", "straggler"
FORWARD, BACKWARD = (43, 125, 233), (233, 105, 43)
RGBA = """([id, x, y]) => Array.from(document.getElementById(id).getContext('2d')
    .getImageData(x, y, 1, 1).data)"""
ROW = """([id, y]) => { const c = document.getElementById(id);
    return Array.from(c.getContext('2d').getImageData(0, y, c.width, 1).data); }"""


def coordinates(rank: int) -> dict:
    dp, tp = LAYOUT["dp"], LAYOUT["tp"]
    return {"dp": (rank // tp) % dp, "tp": rank % tp, "pp": rank // (dp * tp), "cp": 0}


def ramp(t: float) -> tuple[int, ...]:
    """The heatmap's colour scale (telemetry.js): cool blue -> pale -> hot red."""
    stops = [(49, 130, 189), (255, 255, 191), (215, 48, 39)]
    x = min(max(t, 0.0), 1.0) * 2
    i = min(math.floor(x), 1)
    f = x - i
    return tuple(round(a + (b - a) * f) for a, b in zip(stops[i], stops[i + 1]))


def near(rgb, want, tol) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(rgb, want))


@pytest.fixture(scope="module")
def trained(live_dashboard, tmp_path_factory):
    """The run, trained to the end against the shared dashboard: (dashboard, run id, log)."""
    d = live_dashboard
    tmp = tmp_path_factory.mktemp("straggler-e2e")
    cfg = telemetry_config(
        tmp, "run", LAYOUT, STEPS,
        tokens={"micro_batch_size": 1, "batch_accumulation_per_replica": M},
        rank_stats_interval=INTERVAL, pipeline_timeline_interval=TIMELINE_EVERY,
    )  # fmt: skip
    cfg.write_text(cfg.read_text().replace("project: test", f"project: {PROJECT}"))
    cfg.write_text(cfg.read_text().replace("run: ckpt", f"run: {NAME}"))
    run = Torchrun4(cfg, d.url)
    status = run.wait_with_a_slowed_rank(SLOW_RANK, 0.06, 0.01, after=tmp / "run.jsonl")
    out = run.output()
    assert status == 0, out[-4000:]
    runs = [r for r in d.get("/api/runs") if r["project"] == PROJECT and r["name"] == NAME]
    assert len(runs) == 1, runs
    assert runs[0]["status"] == "finished" and runs[0]["step"] == STEPS, runs[0]
    return d, runs[0]["id"], out


def stored(d, run_id: str) -> dict:
    heat = d.get(
        f"/api/runs/{run_id}/rank_stats?fields=compute_ms,optimizer_ms,data_ms,step_ms&max_steps=1000"
    )
    timelines = d.get(f"/api/runs/{run_id}/timelines")
    newest = d.get(f"/api/runs/{run_id}/timelines/{timelines[-1]['step']}") if timelines else None
    return {
        "heat": heat,
        "stragglers": d.get(f"/api/runs/{run_id}/events?kind=straggler"),
        "timelines": timelines,
        "timeline": newest,
    }


def busy_grid(heat: dict) -> list[list[float]]:
    """[interval][rank] compute + optimizer + data: the time a rank spends not waiting."""
    v = heat["values"]
    return [
        [sum(v[f][j][i] for f in ("compute_ms", "optimizer_ms", "data_ms")) for i in range(4)]
        for j in range(len(heat["steps"]))
    ]


def test_rest_api_stored_the_straggler_rank_stats_and_timelines(trained):
    d, run_id, out = trained
    s = stored(d, run_id)
    host = socket.gethostname()

    heat = s["heat"]
    assert heat["total"] == STEPS // INTERVAL
    assert heat["steps"] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert heat["intervals"] == [INTERVAL] * (STEPS // INTERVAL)
    assert heat["ranks"] == [{"rank": r, **coordinates(r), "host": host} for r in range(4)]
    for field in ("compute_ms", "optimizer_ms", "step_ms"):
        assert all(v is not None and v > 0 for col in heat["values"][field] for v in col), field

    named = [e for e in s["stragglers"] if e["details"]["rank"] == SLOW_RANK]
    assert named, (s["stragglers"], out[-3000:])
    e = named[0]
    assert {k: e["details"][k] for k in ("rank", "host", "dp", "tp", "pp", "cp")} == {
        "rank": SLOW_RANK, "host": host, **coordinates(SLOW_RANK)
    }  # fmt: skip
    assert e["severity"] == "warning" and e["details"]["ratio"] > 1 + MARGIN
    assert e["message"].startswith(f"rank 3 (dp=1 tp=0 pp=1, host {host})")
    assert f"straggler: {e['message']}" in out  # the trainer's log line says the same
    # the stored intervals show what the trainer saw: the slowed rank's non-waiting time over
    # its stage peer's by more than the margin in the interval that named it, and across the
    # window of intervals before (their ratios less the highest and lowest, geometric mean)
    busy = busy_grid(heat)
    j = heat["steps"].index(e["step"])
    assert busy[j][SLOW_RANK] > (1 + MARGIN) * busy[j][PEER], busy[j]
    logs = sorted(math.log(c[SLOW_RANK] / c[PEER]) for c in busy[j - SLOW_INTERVALS + 1 : j + 1])
    assert statistics.fmean(logs[1:-1]) > math.log1p(MARGIN), logs

    assert [t["step"] for t in s["timelines"]] == list(
        range(TIMELINE_EVERY, STEPS + 1, TIMELINE_EVERY)
    )
    t = s["timeline"]
    assert (t["schedule"], t["pp"], t["chunks"], t["micro_batches"]) == ("1f1b", 2, 1, M)
    assert t["bubble_formula"] == pytest.approx(1 / (M + 1))
    keys = sorted((sp["stage"], sp["micro_batch"], sp["kind"]) for sp in t["spans"])
    assert keys == sorted(
        (st, mb, k) for st in (0, 1) for mb in range(M) for k in ("forward", "backward")
    )


@pytest.fixture()
def shots(tmp_path):
    folder = Path(os.environ.get("NANOTRON_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_run_page_shows_the_straggler_and_the_real_pipeline(browser, trained, shots):
    d, run_id, _ = trained
    s = stored(d, run_id)
    host = socket.gethostname()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(r.url) if r.status >= 400 else None)
    page.goto(f"{d.url}/runs/{run_id}")

    # heatmap of the time not waiting (what the detector compares), once events are in
    n = len(s["heat"]["steps"])
    page.wait_for_function(
        "n => window.__nt.heatmap && window.__nt.heatmap.steps.length === n"
        " && (window.__nt.events || []).length > 0",
        arg=n,
    )
    page.select_option("#heat-field", "busy_ms")
    page.wait_for_function("() => window.__nt.heatmap.field === 'busy_ms'")
    geo = page.evaluate("() => window.__nt.heatmap")
    assert geo["rows"] == [0, 1, 2, 3] and geo["steps"] == s["heat"]["steps"]
    busy = busy_grid(s["heat"])
    lo, hi = min(map(min, busy)), max(map(max, busy))
    assert geo["lo"] == pytest.approx(lo) and geo["hi"] == pytest.approx(hi)
    medians = [statistics.median(col) for col in busy]
    assert geo["medians"] == pytest.approx(medians) and geo["range"] == 0.25

    def pixel(x: float, y: float) -> list[int]:
        return page.evaluate(RGBA, ["heatmap", int(x * geo["dpr"]), int(y * geo["dpr"])])

    def cell(rank: int, j: int) -> list[int]:
        i = geo["rows"].index(rank)
        return pixel(geo["left"] + (j + 0.5) * geo["cellW"], geo["top"] + (i + 0.5) * geo["cellH"])

    # every cell in the colour of its deviation from its interval's median (+-25% scale)
    for j, col in enumerate(busy):
        for rank in range(4):
            want = ramp(0.5 + (col[rank] / medians[j] - 1) / 0.5)
            assert near(cell(rank, j), (*want, 255), 3), (rank, j, col, want)
    # hot: in the interval that named it, the slowed rank is the hottest cell of its column
    # (drawn in its value's colour above), well above its stage peer
    event = next(e for e in s["stragglers"] if e["details"]["rank"] == SLOW_RANK)
    j = s["heat"]["steps"].index(event["step"])
    assert busy[j][SLOW_RANK] == max(busy[j]), busy[j]
    hot, cool = cell(SLOW_RANK, j), cell(PEER, j)
    assert sum(abs(a - b) for a, b in zip(hot, cool)) > 30, (j, hot, cool)
    # flagged: a black frame around the rows of the ranks named stragglers, and only those
    flagged = {e["details"]["rank"] for e in s["stragglers"]}
    right = geo["left"] + len(geo["steps"]) * geo["cellW"] + 1  # the frame's right edge
    for i, rank in enumerate(geo["rows"]):
        edge = pixel(right, geo["top"] + (i + 0.5) * geo["cellH"])
        assert (edge == [0, 0, 0, 255]) == (rank in flagged), (rank, edge, flagged)
    assert SLOW_RANK in flagged
    page.locator("#heatmap").screenshot(path=str(shots / "e2e_heatmap.png"))

    # the events list and the banner name the rank with its coordinates and host
    who = f"rank 3 (dp=1 tp=0 pp=1, host {host})"
    rows = page.locator('#events tbody tr[data-kind="straggler"]')
    messages = rows.locator(".event-message").all_inner_texts()
    assert len(messages) == len(s["stragglers"]) and event["message"] in messages
    assert any(m.startswith(who) for m in messages), messages
    last = s["stragglers"][-1]
    d_last = last["details"]
    banner = page.locator("#straggler").inner_text()
    want = (
        f"Straggler: rank {d_last['rank']} (dp={d_last['dp']} tp={d_last['tp']} "
        f"pp={d_last['pp']}, host {d_last['host']}) at step {last['step']}"
    )
    assert banner.startswith(want), banner

    # Gantt of the newest recorded step: per stage, the pixels of each kind's colour along
    # the bars' row are as many as the recorded spans' durations make
    t = s["timeline"]
    page.wait_for_function(
        "step => window.__nt.gantt && window.__nt.gantt.step === step", arg=t["step"]
    )
    g = page.evaluate("() => window.__nt.gantt")
    for stage in range(t["pp"]):
        y = (g["top"] + stage * g["rowH"] + (g["rowH"] - g["barH"]) / 2 + 2) * g["dpr"]
        px = page.evaluate(ROW, ["gantt", int(y)])
        line = [px[k : k + 3] for k in range(0, len(px), 4)]
        for kind, colour in (("forward", FORWARD), ("backward", BACKWARD)):
            spans = [sp for sp in t["spans"] if sp["stage"] == stage and sp["kind"] == kind]
            assert len(spans) == M
            widths = [max((sp["end_ms"] - sp["start_ms"]) * g["scale"] - 1, 1) for sp in spans]
            drawn = sum(near(p, colour, 30) for p in line) / g["dpr"]
            # each bar's two edges may be blended with the background
            assert abs(drawn - sum(widths)) <= 2 * len(spans), (stage, kind, drawn, widths)
            for sp, w in zip(spans, widths):  # and each bar of some width at its place
                if w >= 4:
                    x = (g["left"] + sp["start_ms"] * g["scale"] + w / 2) * g["dpr"]
                    assert near(line[int(x)], colour, 30), (sp, line[int(x)])
    bubble = page.locator("#tl-bubble").inner_text()
    bad = t["clock"]["order_violations"]  # the rank clocks disagreed: flagged, no number
    measured = (
        f"no bubble measured: {bad} spans start before their input was sent"
        if bad
        else f"bubble measured {100 * t['bubble_measured']:.1f}% · formula 33.3% (1f1b, pp=2"
    )
    assert bubble.startswith(measured), bubble
    page.locator("#gantt").screenshot(path=str(shots / "e2e_gantt.png"))
    page.screenshot(path=str(shots / "e2e_run_page.png"), full_page=True)
    for name in ("e2e_heatmap.png", "e2e_gantt.png", "e2e_run_page.png"):
        assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert errors == []
    page.close()
