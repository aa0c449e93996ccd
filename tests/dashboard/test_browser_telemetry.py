"""The telemetry views of one seeded run in headless Chromium: the rank heatmap with a
straggler, the pipeline Gantt chart, event markers and list, samples shown as text, the System
group, tags and the run list's badges, the planner's prediction beside the measurement. Each
assertion reads drawn pixels or shown text that depends on the data posted; screenshots go to
$NANOTRON_SCREENSHOTS (default: the test's temporary folder). What a user reads on runs of
their own data: test_browser_telemetry_views.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import telemetry_data as td
from dashboard_helpers import LAUNCH_TOKEN
from telemetry_canvas import BACKWARD, FORWARD, NEUTRAL, PIXEL, near

pytestmark = pytest.mark.browser

RUN = "tele"
XSS_PROMPT = "<script>window.__pwned = 1</script>"
XSS_COMPLETION = '<img src=x onerror="window.__pwned = 1">'
IDLE = (246, 247, 249)
WARNING, CRITICAL = (242, 169, 0), (224, 30, 90)


@pytest.fixture(scope="module")
def seeded(live_dashboard):
    d = live_dashboard
    d.post("/api/ingest", {"type": "run_start", "run_id": RUN, "name": "telemetry run"})
    d.post("/api/ingest", {"type": "run_start", "run_id": "other", "name": "untagged"})
    d.post(
        "/api/ingest",
        [
            {
                "type": "metrics",
                "run_id": RUN,
                "step": s,
                "values": {
                    "lm_loss": 5.0 - s / 50,
                    "system/cpu_util_pct": 90.0 + s % 7,
                    "system/rss_bytes": 1e9 + s * 1e6,
                    **({"val_loss": 5.5 - s / 50} if s % 25 == 0 else {}),
                },
            }
            for s in range(1, 101)
        ],
    )
    d.post("/api/ingest", [td.rank_stats(RUN, s, n=4, slow=3) for s in range(10, 101, 10)])
    d.post("/api/ingest", {**td.PREDICTION, "run_id": RUN})  # the planner's, once at start
    d.post("/api/ingest", [td.timeline(RUN, 50, pp=2, m=4), td.timeline(RUN, 100, pp=4, m=8)])
    d.post(
        "/api/ingest",
        [
            td.straggler(RUN, 50, rank=3, host="node-b"),
            td.event(RUN, "nonfinite_loss", 80, severity="critical", message="loss is <nan>"),
        ],
    )
    d.post("/api/ingest", td.samples(RUN, 50, [("def f():", "pass")]))
    d.post("/api/ingest", td.samples(RUN, 100, [(XSS_PROMPT, XSS_COMPLETION), ("x = ", "1")]))
    return d


@pytest.fixture()
def shots(tmp_path):
    folder = Path(os.environ.get("NANOTRON_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def screenshot(page, path):
    page.screenshot(path=str(path), full_page=True)
    head = path.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n", path


def test_run_page_draws_the_parallel_views(browser, seeded, shots):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    dialogs, errors = [], []
    page.on("dialog", lambda dlg: (dialogs.append(dlg.message), dlg.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    # script errors and CSP refusals; a failed request by its URL (the browser's own
    # /favicon.ico request, which this server does not serve, is no page's)
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("response", lambda r: errors.append(r.url) if r.status >= 400 else None)
    page.goto(seeded.url + f"/runs/{RUN}")

    # heatmap, coloured by compute: the straggler's row is hot, a normal rank's is cool
    page.wait_for_function("() => window.__nt.heatmap && window.__nt.heatmap.steps.length === 10")
    page.select_option("#heat-field", "compute_ms")
    page.wait_for_function("() => window.__nt.heatmap.field === 'compute_ms'")
    geo = page.evaluate("() => window.__nt.heatmap")
    assert geo["rows"] == [0, 1, 2, 3] and geo["steps"] == list(range(10, 101, 10))

    def cell(rank, j):
        i = geo["rows"].index(rank)
        x = (geo["left"] + (j + 0.5) * geo["cellW"]) * geo["dpr"]
        y = (geo["top"] + (i + 0.5) * geo["cellH"]) * geo["dpr"]
        return page.evaluate(PIXEL, ["heatmap", int(x), int(y)])

    # colour = deviation from the interval's median (101.5 ms): the straggler (~2x) saturated
    # red, the others (1-2% off) all close to the neutral middle of the scale
    for j in (0, 9):
        assert near(cell(3, j), (215, 48, 39), 10), cell(3, j)
        for rank in (0, 1, 2):
            assert near(cell(rank, j), NEUTRAL, 25), (rank, cell(rank, j))
    assert geo["range"] == 0.25 and geo["medians"][0] == pytest.approx(101.51)
    legend = page.locator("#heat-legend").inner_text()
    assert "deviation from each interval's median" in legend and "±25%" in legend
    assert "values 100.01 ms .. 206.20 ms" in legend and "labelled by their last step" in legend
    banner = page.locator("#straggler").inner_text()
    assert "Straggler: rank 3 (dp=1 tp=1 pp=0, host node-b)" in banner and "at step 50" in banner

    # Gantt of the newest recorded step (pp=4, 8 micro-batches): every span drawn where its
    # times say, in its kind's colour; a stage waiting before its first forward is idle
    page.wait_for_function("() => window.__nt.gantt && window.__nt.gantt.step === 100")
    g = page.evaluate("() => window.__nt.gantt")
    spans = td.timeline(RUN, 100, pp=4, m=8)["spans"]

    def at(stage, ms):
        x = (g["left"] + ms * g["scale"]) * g["dpr"]
        y = (g["top"] + stage * g["rowH"] + (g["rowH"] - g["barH"]) / 2 + 2) * g["dpr"]
        return page.evaluate(PIXEL, ["gantt", int(x + 2 * g["dpr"]), int(y)])

    for s in spans:
        want = FORWARD if s["kind"] == "forward" else BACKWARD
        assert near(at(s["stage"], s["start_ms"]), want), s
    assert near(at(3, 1.0), IDLE)  # stage 3 starts at 30 ms
    bubble = page.locator("#tl-bubble").inner_text()
    assert bubble.startswith("bubble measured 27.3% · formula 27.3% (1f1b, pp=4"), bubble
    page.select_option("#tl-step", "50")
    page.wait_for_function("() => window.__nt.gantt.step === 50")
    g = page.evaluate("() => window.__nt.gantt")
    assert near(at(1, 0.5), IDLE) and near(at(1, 10.5), FORWARD) and near(at(1, 20.5), BACKWARD)

    # event markers: a vertical line at each event's step, in its severity's colour
    page.wait_for_function("() => (window.__nt.charts.lm_loss.plot.markers || []).length === 2")

    def marker_pixels(step, colour):
        return page.evaluate(
            """([step, c]) => { const u = window.__nt.charts.lm_loss.plot, b = u.bbox;
                const x = Math.round(u.valToPos(step, 'x', true));
                const cv = document.querySelector('.chart[data-metric="lm_loss"] canvas');
                const px = cv.getContext('2d').getImageData(x, b.top, 1, b.height).data;
                let n = 0;
                for (let i = 0; i < px.length; i += 4)
                  if (Math.abs(px[i] - c[0]) < 30 && Math.abs(px[i + 1] - c[1]) < 30
                      && Math.abs(px[i + 2] - c[2]) < 30) n++;
                return n / b.height; }""",
            [step, list(colour)],
        )

    assert marker_pixels(50, WARNING) > 0.8 and marker_pixels(80, CRITICAL) > 0.8
    # no line at 65 (the label of the marker before it may reach over: its top 12 px)
    assert marker_pixels(65, WARNING) < 0.1 and marker_pixels(65, CRITICAL) < 0.1
    rows = page.locator("#events tbody tr")
    assert rows.count() == 2
    assert rows.nth(0).locator(".event-message").inner_text() == "loss is <nan>"  # as text

    # samples: the newest checkpoint's; markup in them is text, never run
    page.wait_for_function("() => document.querySelectorAll('#samples tbody tr').length === 2")
    assert page.locator("#samples pre.prompt").nth(0).inner_text() == XSS_PROMPT
    assert page.locator("#samples pre.completion").nth(0).inner_text() == XSS_COMPLETION
    assert page.evaluate("() => window.__pwned") is None and not dialogs

    # System group: system/ metrics in their own charts; val_loss still over the loss
    for name in ("system/cpu_util_pct", "system/rss_bytes"):
        assert page.locator(f'#system-charts .chart[data-metric="{name}"] canvas').count() == 1
        assert page.locator(f'#charts .chart[data-metric="{name}"]').count() == 0
    overlay = page.evaluate(
        """() => { const p = window.__nt.charts.lm_loss.plot;
                   const i = p.series.findIndex((s) => s.label.endsWith(' val_loss'));
                   return i < 0 ? null : p.data[i].filter((v) => v != null).length; }"""
    )
    assert overlay == 4
    screenshot(page, shots / "run_page_telemetry.png")

    # live: a new event reaches the open page (list and a third marker)
    seeded.post("/api/ingest", td.event(RUN, "loss_spike", 90, message="spike"))
    page.wait_for_function("() => window.__nt.charts.lm_loss.plot.markers.length === 3")
    assert page.locator("#events tbody tr").count() == 3
    assert errors == []  # no script error, no CSP violation
    page.close()


def test_tags_round_trip_and_run_list_badges(browser, seeded, shots):
    from playwright.sync_api import expect  # as conftest: only where a browser runs

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    # editing writes: the server has credentials (a launch token), so the page signs in
    page.goto(seeded.url + f"/runs/{RUN}?token={LAUNCH_TOKEN}")
    page.locator("#tags-input").wait_for()
    page.wait_for_function("() => window.__nt.run !== null")
    page.fill("#tags-input", "baseline lr=3e-4")  # '=' is not a tag's: said in words
    page.click("#labels-save")
    said = page.locator("#labels-result").inner_text()
    assert said == (
        "not saved: tag “lr=3e-4”: a tag is 1 to 64 letters, digits or . _ : - "
        "(no spaces or other signs)"
    ), said
    page.fill("#tags-input", "baseline exp:1")
    page.fill("#note-input", "<b>first</b> try")
    page.click("#labels-save")
    page.wait_for_function("() => document.getElementById('labels-result').textContent === 'saved'")
    assert page.locator("#run-tags .tag").all_inner_texts() == ["baseline", "exp:1"]
    page.reload()
    page.wait_for_function("() => document.getElementById('tags-input').value !== ''")
    assert page.input_value("#tags-input") == "baseline exp:1"
    assert page.input_value("#note-input") == "<b>first</b> try"
    assert seeded.get(f"/api/runs/{RUN}")["note"] == "<b>first</b> try"

    page.goto(seeded.url + "/")
    row = page.locator(f'tr[data-run-id="{RUN}"]')
    row.wait_for()
    badges = {
        b.get_attribute("data-kind"): (b.inner_text(), b.get_attribute("class"))
        for b in row.locator(".events .badge").all()
    }
    assert badges["straggler"] == ("straggler 1", "badge ev warning")
    assert badges["nonfinite_loss"] == ("nonfinite_loss 1", "badge ev critical")
    # critical stands out. Read in one step with the element it finds: the list re-renders
    # its rows (when /ws/runs opens, every 5 s, on each message), and a badge replaced between
    # finding it and reading it (locator.evaluate) has no computed style: "".
    red = row.locator('.badge[data-kind="nonfinite_loss"]')
    expect(red).to_have_css("background-color", "rgb(224, 30, 90)")
    assert row.locator(".tag").all_inner_texts() == ["baseline", "exp:1"]
    page.locator('tr[data-run-id="other"]').wait_for()
    # live: an event stored now shows its badge without a reload
    seeded.post("/api/ingest", td.event(RUN, "throughput_drop", 95, message="slower"))
    live = row.locator('.badge[data-kind="throughput_drop"]')
    live.wait_for()
    assert live.inner_text() == "throughput_drop 1"
    screenshot(page, shots / "run_list_badges.png")
    row.locator('.tag[data-tag="exp:1"]').click()  # a tag filters the list
    page.wait_for_function("() => !document.querySelector('tr[data-run-id=\"other\"]')")
    assert page.input_value("#f-tag") == "exp:1"
    assert page.locator("#runs tbody tr").count() == 1
    page.close()


def test_run_page_shows_the_prediction_next_to_the_measurement(browser, seeded):
    """The planner's prediction beside what rank_stats measured (step 460 ms: the median of
    steps 20..100), the parts off by more than 20% flagged."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(seeded.url + f"/runs/{RUN}")
    page.wait_for_function("() => window.__nt.prediction !== undefined")
    assert page.locator("#prediction-section").is_visible()
    assert page.evaluate("() => window.__nt.prediction.off") == ["step_ms", "comm_ms"]
    row = page.locator('#prediction tr[data-part="step_ms"] td')
    assert row.all_inner_texts() == [
        "step time", "300 ms", "460 ms", "0.65x", "off by 35% (> 20%)"
    ]  # fmt: skip
    mem = page.locator('#prediction tr[data-part="memory_bytes"] td').all_inner_texts()
    assert mem[:3] == ["peak memory (worst rank)", "3.7 MiB", "3.8 MiB"]
    assert mem[4] == "within 3%"
    compute = page.locator('#prediction tr[data-part="compute_ms"]')
    assert compute.get_attribute("class") == "" and "within 6%" in compute.inner_text()
    idle = page.locator('#prediction tr[data-part="idle_ms"] td').all_inner_texts()
    assert idle == ["pipeline idle", "0.00 ms", "0.00 ms", "—", "negligible"]
    red = page.evaluate(
        """() => getComputedStyle(document.querySelector(
               '#prediction tr[data-part="comm_ms"] td')).backgroundColor"""
    )
    assert red == "rgb(253, 232, 234)"
    page.close()
