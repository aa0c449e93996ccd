"""The per-layer statistics heatmap in headless Chromium: one cell per (layer, detail step),
coloured by log10 of the value between whole decades (the smallest blue, the largest red), a
NaN purple and a missing value grey; the colour bar labels its decades; the statistic selector
switches statistics; the hover names the step, the layer and its value."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

RUN = "layer-view"
ROWS = ["embedding.weight", "decoder.0.attn.qkv.weight", "decoder.0.mlp.down.weight", "decoder.0"]
PIXEL = """([id, x, y]) => { const c = document.getElementById(id);
    return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }"""
BLUE, RED, PURPLE, GREY = (49, 130, 189), (215, 48, 39), (142, 68, 173), (227, 230, 235)


def message(step):
    # grad norm: row 0 at 1e-3, row 1 at 10 (the scale's ends), row 2 NaN at step 5, row 3 none
    grad = [1e-3, 10.0, "nan" if step == 5 else 1.0, None]
    return {"type": "layer_stats", "run_id": RUN, "step": step, "rows": ROWS,
            "stats": {"grad_norm": grad, "weight_norm": [2.0, 3.0, 4.0, None]}}  # fmt: skip


def test_layer_heatmap(browser, live_dashboard):
    d = live_dashboard
    d.post("/api/ingest", {"type": "run_start", "run_id": RUN, "name": "layers"})
    d.post("/api/ingest", [message(s) for s in range(1, 11)])
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(r.url) if r.status >= 400 else None)
    page.goto(d.url + f"/runs/{RUN}")
    page.wait_for_function("() => window.__nt.layers && window.__nt.layers.steps.length === 10")
    geo = page.evaluate("() => window.__nt.layers")
    assert geo["stat"] == "grad_norm" and geo["rows"] == 4 and geo["cells"] == 40
    assert geo["ticks"] == ["1e-3", "1e-2", "1e-1", "1e0", "1e1"]

    def cell(row, j):
        g = page.evaluate("() => window.__nt.layers")
        x = (g["left"] + (j + 0.5) * g["cellW"]) * g["dpr"]
        y = (g["top"] + (row + 0.5) * g["cellH"]) * g["dpr"]
        return page.evaluate(PIXEL, ["layer-heatmap", int(x), int(y)])

    assert cell(0, 0) == list(BLUE) and cell(1, 9) == list(RED)
    assert cell(2, 4) == list(PURPLE) and cell(3, 2) == list(GREY)
    assert cell(2, 3) not in (list(BLUE), list(RED), list(GREY))  # 1.0: in between
    legend = page.locator("#layer-legend").inner_text()
    assert "1e-3 (blue) to 1e1 (red)" in legend and "10 of 10 detail steps" in legend

    page.locator("#layer-heatmap").scroll_into_view_if_needed()
    box = page.locator("#layer-heatmap").bounding_box()
    page.mouse.move(
        box["x"] + geo["left"] + 4.5 * geo["cellW"], box["y"] + geo["top"] + 2.5 * geo["cellH"]
    )
    assert page.locator("#layer-tip").inner_text() == (
        "step 5, decoder.0.mlp.down.weight: gradient norm (before clipping) NaN"
    )
    page.select_option("#layer-stat", "weight_norm")
    page.wait_for_function("() => window.__nt.layers.stat === 'weight_norm'")
    assert page.evaluate("() => window.__nt.layers.ticks") == ["1e0", "1e1"]
    assert errors == []
    page.close()


ALERT_RUN = "layer-alert"
ALERT_ROWS = ["embedding.weight", "decoder.0.attn.qkv.weight", "decoder.0.mlp.down.weight",
              "decoder.1.attn.qkv.weight", "decoder.1.mlp.down.weight", "final_norm.weight"]  # fmt: skip


def alert_message(step):
    """Gradient norms that wiggle by 2% around each row's level until decoder.1's MLP leaves
    it at step 190 (x1.3), decoder.0's attention at step 200 (x2), every row at 210 (x10)."""
    wiggle = (0.98, 1.0, 1.02)[step // 10 % 3]
    grad = [(i + 1) * wiggle for i in range(len(ALERT_ROWS))]
    if step >= 190:
        grad[4] *= 1.3
    if step >= 200:
        grad[1] *= 2.0
    if step >= 210:
        grad = [10 * g for g in grad]
    return {"type": "layer_stats", "run_id": ALERT_RUN, "step": step, "rows": ALERT_ROWS,
            "stats": {"grad_norm": grad}}  # fmt: skip


def test_an_alert_opens_the_layers_that_moved_first(browser, live_dashboard):
    d = live_dashboard
    d.post("/api/ingest", {"type": "run_start", "run_id": ALERT_RUN, "name": "alert"})
    d.post("/api/ingest", [alert_message(s) for s in range(10, 310, 10)])
    d.post("/api/ingest", [
        {"type": "event", "run_id": ALERT_RUN, "step": 205, "kind": "loss_spike",
         "message": "loss 9.1 is 4.2 x the median of the last 50 steps"},
        {"type": "event", "run_id": ALERT_RUN, "step": 100, "kind": "throughput_drop",
         "severity": "info", "message": "tokens/s down 30%"},
    ])  # fmt: skip
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(r.url) if r.status >= 400 else None)
    page.goto(d.url + f"/runs/{ALERT_RUN}")
    page.wait_for_function("() => window.__nt.layers && window.__nt.layers.steps.length === 30")
    button = page.locator("#events .moved-first")
    button.wait_for()
    assert button.count() == 1  # the spike has one; the throughput drop is no alert
    button.click()
    page.wait_for_function("() => window.__nt.layers.focus !== null")
    geo = page.evaluate("() => window.__nt.layers")
    # the lead (180, 190, 200) against the 8 detail steps before: the window 100 .. 300
    assert geo["steps"] == list(range(100, 310, 10)) and geo["focus"]["step"] == 205
    first = ["decoder.1.mlp.down.weight", "decoder.0.attn.qkv.weight"]
    assert geo["order"][:2] == first and sorted(geo["order"]) == sorted(ALERT_ROWS)
    items = page.locator("#layer-moved li").all_inner_texts()
    assert [t.split(":")[0] for t in items] == first
    assert items[0].startswith("decoder.1.mlp.down.weight: step 190,")
    assert items[1].startswith("decoder.0.attn.qkv.weight: step 200,")
    assert "before the loss spike at step 205" in page.locator("#layer-focus-text").inner_text()
    column = geo["focus"]["column"]
    assert geo["steps"][column] == 200  # the line after the newest detail step before 205
    x = round(geo["left"] + (column + 1) * geo["cellW"]) * geo["dpr"]  # a 2-pixel black line
    y = (geo["top"] + 0.5 * geo["cellH"]) * geo["dpr"]
    assert page.evaluate(PIXEL, ["layer-heatmap", int(x) - 1, int(y)]) == [0, 0, 0]
    page.click("#layer-unfocus")
    page.wait_for_function("() => window.__nt.layers.focus === null")
    assert page.evaluate("() => window.__nt.layers.steps.length") == 30
    assert page.locator("#layer-focus").is_hidden() and errors == []
    page.close()
