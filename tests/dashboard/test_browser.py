"""The pages in headless Chromium (Debian's package, driven by Playwright)."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

import pytest
from dashboard_helpers import LAUNCH_TOKEN, start_dashboard

from nanotron_dashboard.db import open_database

pytestmark = pytest.mark.browser


def seed(d, run_id: str, tmp: Path, steps: int = 300) -> None:
    d.post(
        "/api/ingest",
        {
            "type": "run_start",
            "run_id": run_id,
            "project": "proj",
            "name": "<img src=x onerror=alert(1)>",
            "config": {"note": "<script>x</script>", "tokens": {"train_steps": steps}},
            "command": [sys.executable, "-c", "print(1)"],
            "world_size": 2,
            "topology": {"dp": 2, "tp": 1, "pp": 1},
            "cwd": str(tmp),
            "checkpoints_path": str(tmp / "ck"),
        },
        token=LAUNCH_TOKEN,  # the owner's trainer: the Resume button may run this command
    )
    d.post(
        "/api/ingest",
        [
            {
                "type": "metrics",
                "run_id": run_id,
                "step": s,
                "values": {
                    "lm_loss": 10.0 / s,
                    "grad_norm": 1.0 + s % 5,
                    "lr": 1e-3,
                    "tokens_per_sec": 5000.0 + s,
                    **({"val_loss": 12.0 / s} if s % 50 == 0 else {}),  # every 50 steps
                },
            }
            for s in range(1, steps + 1)
        ],
    )
    d.post(
        "/api/ingest",
        {
            "type": "checkpoint",
            "run_id": run_id,
            "step": steps,
            "path": str(tmp / "ck" / str(steps)),
            "consumed_tokens": 1234,
        },
    )


def test_run_list_and_run_page(browser, any_live_dashboard, tmp_path):
    d = any_live_dashboard  # on SQLite and on PostgreSQL
    seed(d, "br-1", tmp_path)
    ctx = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    page = ctx.new_page()
    dialogs = []
    page.on("dialog", lambda dlg: (dialogs.append(dlg.message), dlg.dismiss()))
    page.goto(d.url + "/?token=" + LAUNCH_TOKEN)  # the owner signs in once (a cookie)
    assert page.url == d.url + "/"
    row = page.locator('tr[data-run-id="br-1"]')
    row.wait_for(timeout=10_000)
    assert row.locator("td").nth(2).inner_text() == "<img src=x onerror=alert(1)>"  # shown as text
    assert row.locator(".badge").inner_text() == "running"
    assert row.locator("td").nth(4).inner_text() == "0.0333"  # last loss 10/300
    # live: a new run appears in the list without reloading
    d.post(
        "/api/ingest", {"type": "run_start", "run_id": "br-new", "project": "proj", "name": "fresh"}
    )
    page.locator('tr[data-run-id="br-new"]').wait_for(timeout=5_000)

    row.locator("a").first.click()
    page.wait_for_url("**/runs/br-1")
    chart = page.locator('.chart[data-metric="lm_loss"] canvas')
    chart.wait_for(timeout=10_000)
    for metric in ("lm_loss", "grad_norm", "tokens_per_sec"):
        assert page.locator(f'.chart[data-metric="{metric}"] canvas').count() == 1
    # a constant lr takes no chart slot: the run summary says it
    assert page.locator('.chart[data-metric="lr"]').count() == 0
    assert "lr = 0.0010 learning rate" in page.locator("#run-summary").inner_text()
    # The plotted line itself: pixels of the series colour (run.js COLORS[0], #2b7de9) inside
    # the plot area (uPlot's bbox, in canvas pixels), not axes, grid or labels.
    drawn = page.evaluate(
        """() => { const u = window.__nt.charts.lm_loss.plot, b = u.bbox;
                   const c = document.querySelector('.chart[data-metric="lm_loss"] canvas');
                   const px = c.getContext('2d').getImageData(b.left, b.top, b.width, b.height).data;
                   let n = 0;
                   for (let i = 0; i < px.length; i += 4)
                     if (Math.abs(px[i] - 43) < 40 && Math.abs(px[i + 1] - 125) < 40
                         && Math.abs(px[i + 2] - 233) < 40 && px[i + 3] > 128) n++;
                   return n; }"""
    )
    assert drawn > 100, drawn
    # val_loss: its own chart, and drawn over the training loss (6 points, at steps 50..300)
    assert page.locator('.chart[data-metric="val_loss"] canvas').count() == 1
    overlay = page.evaluate(
        """() => { const p = window.__nt.charts.lm_loss.plot;
                   const i = p.series.findIndex((s) => s.label.endsWith(' val_loss'));
                   return i < 0 ? null : p.data[0].flatMap((x, k) => p.data[i][k] == null ? []
                                                             : [[x, p.data[i][k]]]); }"""
    )
    assert overlay == [[s, 12.0 / s] for s in range(50, 301, 50)], overlay
    assert "<script>x</script>" in page.locator("#config").inner_text()

    # a new point arrives live (x=step) and appears in the chart's data
    d.post(
        "/api/ingest",
        {"type": "metrics", "run_id": "br-1", "step": 301, "values": {"lm_loss": 0.01234}},
    )
    page.wait_for_function(
        "() => { const x = window.__nt.charts.lm_loss.plot.data[0]; return x[x.length - 1] === 301; }",
        timeout=5_000,
    )

    # copy the resume command
    ck_row = page.locator('#checkpoints tr[data-step="300"]')
    ck_row.wait_for(timeout=5_000)
    # the final checkpoint says that resuming it alone trains nothing, and how to train on
    assert ck_row.locator(".final-checkpoint").inner_text() == (
        "tokens.train_steps (300) is reached here: add --override tokens.train_steps=N "
        "(N > 300) to train on"
    )
    ck_row.locator("button.copy").click()
    page.wait_for_function("() => document.querySelector('button.copy').textContent === 'copied'")
    copied = page.evaluate("() => navigator.clipboard.readText()")
    assert copied.startswith(f"cd {tmp_path} && ") and copied.endswith(
        f"--resume {tmp_path}/ck/300"
    )

    # resume (the shared dashboard runs with --allow-launch): first the exact command and the
    # layout, then the launch, then a link to the new run once its run_start names this one
    ck_row.locator("button.resume").click()
    ask = page.locator("#resume-confirm").inner_text()
    assert "Resume from the checkpoint of step 300?" in ask and f"runs in {tmp_path}" in ask
    assert copied.split(" && ", 1)[1] in ask and "2 processes (dp=2 tp=1 pp=1)" in ask, ask
    page.click("#resume-go")
    page.wait_for_function(
        "() => document.querySelector('#launch-result').textContent.startsWith('started pid')"
    )
    child = {
        "type": "run_start",
        "run_id": f"{d.port}-child",
        "resumed_from": {"run_id": "br-1", "step": 300},
    }
    d.post("/api/ingest", child)
    page.locator("#new-run-link").wait_for(timeout=10_000)
    assert page.locator("#new-run-link").get_attribute("href") == f"/runs/{d.port}-child"
    assert not dialogs
    ctx.close()


def fill_100k(db: Path) -> None:
    """A run of 100k steps written straight into a new database (the dashboard seals it into
    blocks at start): the page's cost is the subject here, not 20 ingest requests'."""
    open_database(db).dispose()  # the schema
    with sqlite3.connect(db) as c:
        c.execute(
            "INSERT INTO runs(id, project, name, status, config, topology, command, started, "
            "updated, heartbeat, step) VALUES ('big', '', 'big', 'running', '{}', '{}', '[]', "
            "0, 0, 0, 99999)"
        )
        c.executemany(
            "INSERT INTO metrics(run_pk, name, step, value, time) VALUES (1, 'lm_loss', ?, ?, ?)",
            ((s, 1.0 + 1.0 / (s + 1), float(s)) for s in range(100_000)),
        )
        c.execute("INSERT INTO latest VALUES (1, 'lm_loss', 99999, 1.00001)")


def test_page_stays_fluid_with_100k_steps(browser, tmp_path):
    fill_100k(tmp_path / "big.db")
    d = start_dashboard(tmp_path / "big.db")
    try:
        page_of_100k_steps(browser, d)
    finally:
        d.stop()


def page_of_100k_steps(browser, d) -> None:
    page = browser.new_page()
    t0 = time.perf_counter()
    page.goto(d.url + "/runs/big")
    page.locator('.chart[data-metric="lm_loss"] canvas').wait_for(timeout=20_000)
    elapsed = time.perf_counter() - t0
    points = page.evaluate("() => window.__nt.charts.lm_loss.plot.data[0].length")
    assert points <= 2000, points  # downsampled: the browser never holds the 100k points
    assert elapsed < 10, elapsed
    page.close()


def test_nan_is_shown_as_a_badge_and_a_gap(browser, live_dashboard):
    """NaN/inf values are training events: stored, a badge on the run, a gap in the
    line (not bridged), and listed under the chart."""
    d = live_dashboard
    d.post("/api/ingest", {"type": "run_start", "run_id": "br-nan", "name": "nan run"})
    d.post(
        "/api/ingest",
        [
            {"type": "metrics", "run_id": "br-nan", "step": s, "values": {"lm_loss": v}}
            for s, v in ((1, 3.0), (2, "nan"), (3, 2.0), (4, 1.5))
        ],
    )
    page = browser.new_page()
    page.goto(d.url + "/")
    badge = page.locator('tr[data-run-id="br-nan"] .badge.nan')
    badge.wait_for(timeout=10_000)
    assert badge.inner_text() == "NaN @ 2"
    page.goto(d.url + "/runs/br-nan")
    page.locator('.chart[data-metric="lm_loss"] canvas').wait_for(timeout=10_000)
    assert page.locator("#run-status .badge.nan").inner_text() == "NaN @ 2"
    ys = page.evaluate("() => window.__nt.charts.lm_loss.plot.data[1]")
    assert ys == [3.0, None, 2.0, 1.5]
    assert page.evaluate("() => window.__nt.charts.lm_loss.plot.series[1].spanGaps") is False
    assert "step 2 = NaN" in page.locator('.chart[data-metric="lm_loss"] .nonfinite').inner_text()
    page.close()
