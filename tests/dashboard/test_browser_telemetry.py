"""The telemetry views in headless Chromium: the rank heatmap with a straggler, the pipeline
Gantt chart (with a span kind it learns from the data), event markers and list, samples shown
as text, the System group, tags and the run list's badges. Each assertion reads drawn pixels or shown text that depends on the data
posted; screenshots go to $NANOTRON_SCREENSHOTS (default: the test's temporary folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import telemetry_data as td
from dashboard_helpers import LAUNCH_TOKEN

pytestmark = pytest.mark.browser

RUN = "tele"
XSS_PROMPT = "<script>window.__pwned = 1</script>"
XSS_COMPLETION = '<img src=x onerror="window.__pwned = 1">'
FORWARD, BACKWARD, IDLE = (43, 125, 233), (233, 105, 43), (246, 247, 249)
THIRD_KIND = (46, 157, 76)  # the third span kind to start in a timeline (#2e9d4c)
WARNING, CRITICAL = (242, 169, 0), (224, 30, 90)
NEUTRAL = (255, 255, 191)  # the middle of the heatmap's scale: the interval's median
PIXEL = """([id, x, y]) => { const c = document.getElementById(id);
    return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }"""


def near(rgb, want, tol=30):
    return all(abs(a - b) <= tol for a, b in zip(rgb, want))


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


def test_a_span_kind_the_page_never_heard_of_is_drawn_in_its_own_colour(browser, seeded):
    # a zero-bubble schedule's weight-gradient spans ("W"): no list of kinds in the page
    msg = {**td.timeline("zb", 7, pp=2, m=4), "schedule": "zb-h1"}
    msg["spans"] = td.with_weight_grad(msg["spans"])
    seeded.post("/api/ingest", [{"type": "run_start", "run_id": "zb"}, msg])
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(seeded.url + "/runs/zb")
    page.wait_for_function("() => window.__nt.gantt && window.__nt.gantt.step === 7")
    g = page.evaluate("() => window.__nt.gantt")
    assert g["colors"] == {"forward": "#2b7de9", "backward": "#e9692b", "W": "#2e9d4c"}
    legend = page.locator("#tl-legend .legend-kind")
    assert legend.all_inner_texts() == ["forward", "backward", "W"]
    want = {"forward": FORWARD, "backward": BACKWARD, "W": THIRD_KIND}
    for s in msg["spans"]:  # each bar, 2 px into it, in its kind's colour
        x = (g["left"] + s["start_ms"] * g["scale"] + 2) * g["dpr"]
        y = (g["top"] + s["stage"] * g["rowH"] + (g["rowH"] - g["barH"]) / 2 + 2) * g["dpr"]
        assert near(page.evaluate(PIXEL, ["gantt", int(x), int(y)]), want[s["kind"]]), s
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


def test_what_a_user_reads_close_ranks_units_one_point_constants_and_markers(browser, seeded):
    """Two ranks 1.3% apart are both near neutral (min-to-max colouring painted them full
    blue and full red); axes carry units, the legend says `step N`; a one-point series is
    drawn near its step; a constant series is a line of the run summary; markers say what."""
    d, run = seeded, "views"
    d.post("/api/ingest", {"type": "run_start", "run_id": run, "name": "views"})
    close = td.rank_stats(run, 10, n=2)
    close["ranks"][0]["compute_ms"], close["ranks"][1]["compute_ms"] = 41.54, 42.07
    metrics = [
        {"type": "metrics", "run_id": run, "step": s,
         "values": {"lm_loss": 5.0 - s / 100, "tokens_per_sec": 1000.0 + s,
                    "memory": (300 + s % 3) * 2**20, "global_batch_size": 8.0,
                    **({"grad_norm_spike_z": 9.0} if s == 240 else {})}}
        for s in range(1, 301)
    ]  # fmt: skip
    blank, long = "\n" * 30, "line\n" * 40
    samples = td.samples(run, 300, [("p", blank), ("q", long)])
    d.post("/api/ingest", [close, *metrics, td.event(run, "grad_norm_spike", 240), samples])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(d.url + f"/runs/{run}")
    page.wait_for_function("() => window.__nt.heatmap && window.__nt.heatmap.steps.length === 1")
    page.select_option("#heat-field", "compute_ms")
    page.wait_for_function("() => window.__nt.heatmap.field === 'compute_ms'")
    geo = page.evaluate("() => window.__nt.heatmap")
    for i in (0, 1):
        x, y = (
            (geo["left"] + 0.5 * geo["cellW"]) * geo["dpr"],
            (geo["top"] + (i + 0.5) * geo["cellH"]) * geo["dpr"],
        )
        rgb = page.evaluate(PIXEL, ["heatmap", int(x), int(y)])
        assert near(rgb, NEUTRAL, 20), (i, rgb)  # +-0.6%: 2.5% of the way to either end
    page.locator("#heatmap").hover(
        position={"x": geo["left"] + 0.5 * geo["cellW"], "y": geo["top"] + 1.5 * geo["cellH"]}
    )
    tip = page.locator("#heat-tip").inner_text()
    assert tip.startswith("rank 1 (dp=0 tp=1 pp=0, host node-b), steps 1–10: 42.07 ms (+0.6% vs"), (
        tip
    )
    # charts: units on the y axes, `step N` in the legend, MiB for bytes
    page.wait_for_function("() => window.__nt.charts.lm_loss && window.__nt.charts.memory")
    title = lambda m: page.locator(f'.chart[data-metric="{m}"] h3').inner_text()  # noqa: E731
    assert title("lm_loss") == "lm_loss (nats/token)" and title("memory") == "memory (MiB)"
    assert title("tokens_per_sec") == "tokens_per_sec (tokens/s)"
    axes = page.evaluate(
        "() => ['lm_loss', 'memory'].map((m) => { const u = window.__nt.charts[m].plot;"
        " return [u.axes[0].label, u.axes[1].label, u.scales.y.min, u.scales.y.max]; })"
    )
    assert axes[0][:2] == ["step", "nats/token"] and axes[1][:2] == ["step", "MiB"], axes
    assert 299 <= axes[1][2] <= 300 and 302 <= axes[1][3] <= 303, axes  # in MiB, not bytes
    over = page.locator('.chart[data-metric="lm_loss"] .u-over')
    box = over.bounding_box()
    over.hover(position={"x": box["width"] * 0.5, "y": box["height"] * 0.5})
    legend = page.locator('.chart[data-metric="lm_loss"] .u-legend').inner_text()
    assert "step " in legend and "Value" not in legend and "nats/token" in legend, legend
    # the one-point series: an x range around step 240 (not 0-600), its point drawn
    u = page.evaluate(
        "() => { const s = window.__nt.charts.grad_norm_spike_z.plot.scales.x; return [s.min, s.max]; }"
    )
    assert u[0] < 240 < u[1] and u[1] - u[0] < 50, u
    drawn = page.evaluate(
        """() => { const u = window.__nt.charts.grad_norm_spike_z.plot;
        // 3 px left of its centre: the event marker at step 240 runs through the centre
        const x = Math.round(u.valToPos(240, 'x', true)) - 3, y = Math.round(u.valToPos(9, 'y', true));
        return Array.from(u.ctx.getImageData(x, y, 1, 1).data.slice(0, 3)); }"""
    )
    assert near(drawn, FORWARD, 60), drawn  # the run's colour (#2b7de9) at the point
    # constants: no chart, one line of the run summary
    assert page.locator('.chart[data-metric="global_batch_size"]').count() == 0
    summary = page.locator("#run-summary").inner_text()
    assert "global_batch_size = 8 sequences" in summary, summary
    # the event marker is labelled with its kind and step
    marks = page.evaluate("() => window.__nt.charts.lm_loss.plot.markers")
    assert [m["label"] for m in marks] == ["grad norm spike @ 240"], marks
    # samples: whitespace shown, rows of bounded height, a click shows it all
    page.wait_for_function("() => document.querySelectorAll('#samples tbody tr').length === 2")
    cells = page.locator("#samples pre.completion")
    assert cells.nth(0).inner_text().startswith("↵\n↵\n") and "(30 whitespace characters)" in (
        cells.nth(0).text_content()
    )
    rows = page.locator("#samples tbody tr")
    assert all(rows.nth(i).bounding_box()["height"] < 120 for i in (0, 1))
    folded = cells.nth(1).bounding_box()["height"]
    cells.nth(1).click()
    assert cells.nth(1).bounding_box()["height"] > 4 * folded

    # a resumed run: the parent's history up to the resume step greyed in before its own;
    # the compare list tells runs apart by start, step and status
    child = f"{run}-child"
    d.post("/api/ingest", {"type": "run_start", "run_id": child, "name": "views",
                           "resumed_from": {"run_id": run, "step": 250}})  # fmt: skip
    d.post("/api/ingest", [{"type": "metrics", "run_id": child, "step": s,
                            "values": {"lm_loss": 2.0 - s / 1000}} for s in range(251, 261)])  # fmt: skip
    page.goto(d.url + f"/runs/{child}")
    page.wait_for_function(
        "() => window.__nt.charts.lm_loss && window.__nt.charts.lm_loss.plot.series.length === 3"
    )
    lineage = page.evaluate(
        "() => { const u = window.__nt.charts.lm_loss.plot;"
        " return [u.series.map((s) => s.label), u.data[0], u.data[1].filter((v) => v != null).length]; }"
    )
    assert lineage[0][1:] == [f"parent {run} (to step 250)", "views"], lineage[0]
    assert lineage[1][0] == 1 and lineage[1][-1] == 260 and lineage[2] == 250  # steps 1-250 greyed
    option = page.locator(f'#compare option[value="{run}"]').inner_text()
    assert option.startswith("views · started ") and option.endswith(" UTC · step 300 · running"), (
        option
    )
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


def test_downstream_scores_are_charted_against_tokens_and_compared(browser, seeded):
    """A run's evaluation records (eval/<task>/<metric> with the checkpoint's consumed_tokens,
    as the trainer's in-process evaluation or `evaluate --watch` sends them) are a chart among
    the run's others, placed after the losses (before the gradient norm), against tokens, and a compared run's scores are
    drawn on it."""
    d = seeded
    for run, scale in (("scores-a", 1.0), ("scores-b", 0.5)):
        d.post("/api/ingest", {"type": "run_start", "run_id": run, "name": run})
        steps = [{"type": "metrics", "run_id": run, "step": s,
                  "values": {"lm_loss": 5.0 - s / 10, "grad_norm": 1.0 + s % 3,
                             "consumed_tokens": 1024.0 * s}}
                 for s in range(1, 21)]  # fmt: skip
        evals = [{"type": "metrics", "run_id": run, "step": s,
                  "values": {"consumed_tokens": 1024.0 * s, "eval/dt_mc/acc": scale * s / 40,
                             "eval/seconds": 2.0 + s / 10}}
                 for s in (10, 20)]  # fmt: skip
        d.post("/api/ingest", [*steps, *evals])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(d.url + "/runs/scores-a")
    page.wait_for_function("() => window.__nt.charts['eval/dt_mc/acc']")
    order = page.evaluate(
        "() => Array.from(document.querySelectorAll('#charts .chart')).map((c) => c.dataset.metric)"
    )
    assert order == ["lm_loss", "eval/dt_mc/acc", "eval/seconds", "grad_norm"], order
    page.select_option("#x-axis", "tokens")
    page.select_option("#compare", "scores-b")
    page.wait_for_function(
        "() => { const u = window.__nt.charts['eval/dt_mc/acc'].plot;"
        " return u.series.length === 3 && u.data[0][0] === 10240; }"
    )
    chart = page.evaluate(
        """() => { const u = window.__nt.charts['eval/dt_mc/acc'].plot;
                   return [u.axes[0].label, u.series.map((s) => s.label), u.data]; }"""
    )
    assert chart[0] == "tokens"
    assert chart[1][1] == "scores-a" and chart[1][2].startswith("scores-b (")  # + its start
    assert chart[2] == [[10240, 20480], [0.25, 0.5], [0.125, 0.25]]
    page.close()
