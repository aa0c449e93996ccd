"""What a user reads on the telemetry pages in headless Chromium, each test on runs of its own
data: a span kind the page never heard of in its own colour; close ranks near neutral, units on
axes, a one-point series, constants in the summary, labelled markers, samples' whitespace, a
resumed run's lineage; downstream scores charted against tokens and compared. The seeded run's
views: test_browser_telemetry.py."""

from __future__ import annotations

import pytest
import telemetry_data as td
from telemetry_canvas import BACKWARD, FORWARD, NEUTRAL, PIXEL, THIRD_KIND, near

pytestmark = pytest.mark.browser


def test_a_span_kind_the_page_never_heard_of_is_drawn_in_its_own_colour(browser, live_dashboard):
    # a zero-bubble schedule's weight-gradient spans ("W"): no list of kinds in the page
    msg = {**td.timeline("zb", 7, pp=2, m=4), "schedule": "zb-h1"}
    msg["spans"] = td.with_weight_grad(msg["spans"])
    live_dashboard.post("/api/ingest", [{"type": "run_start", "run_id": "zb"}, msg])
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(live_dashboard.url + "/runs/zb")
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


def test_what_a_user_reads_close_ranks_units_one_point_constants_and_markers(
    browser, live_dashboard
):
    """Two ranks 1.3% apart are both near neutral (min-to-max colouring painted them full
    blue and full red); axes carry units, the legend says `step N`; a one-point series is
    drawn near its step; a constant series is a line of the run summary; markers say what."""
    d, run = live_dashboard, "views"
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


def test_downstream_scores_are_charted_against_tokens_and_compared(browser, live_dashboard):
    """A run's evaluation records (eval/<task>/<metric> with the checkpoint's consumed_tokens,
    as the trainer's in-process evaluation or `evaluate --watch` sends them) are a chart among
    the run's others, placed after the losses (before the gradient norm), against tokens, and a compared run's scores are
    drawn on it."""
    d = live_dashboard
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
