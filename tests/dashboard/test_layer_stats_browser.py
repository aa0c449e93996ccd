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
