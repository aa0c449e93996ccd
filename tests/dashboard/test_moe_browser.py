"""The expert load heatmap in headless Chromium: an expert at twice the uniform share is drawn
hot, a uniform one neutral, an under-loaded one cool; the colour bar has its tick labels; the
hover names the step, the expert and its share; the layer selector switches layers; a new
moe_load reaches the open page. The rank heatmap lists the all-to-all phase and one it does
not know, by name."""

from __future__ import annotations

import pytest
import telemetry_data as td

pytestmark = pytest.mark.browser

RUN = "moe-view"
NEUTRAL = (255, 255, 191)  # the middle of the scale: uniform
PIXEL = """([id, x, y]) => { const c = document.getElementById(id);
    return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }"""
# layer 1: expert 0 takes 2x its uniform share, expert 1 exactly uniform, 2 and 3 half of it;
# layer 3: uniform but for expert 3, idle
LOADS = {1: [8, 4, 2, 2], 3: [4, 4, 4, 0]}


def near(rgb, want, tol=25):
    return all(abs(a - b) <= tol for a, b in zip(rgb, want))


def moe_load(step, loads):
    layers = [{"layer": k, "counts": [c * step for c in v]} for k, v in loads.items()]
    return {"type": "moe_load", "run_id": RUN, "step": step, "layers": layers}


def test_expert_load_heatmap(browser, live_dashboard):
    d = live_dashboard
    d.post("/api/ingest", {"type": "run_start", "run_id": RUN, "name": "moe"})
    d.post("/api/ingest", [moe_load(s, LOADS) for s in range(1, 11)])
    per_layer = [f"moe/layer_{i}/{k}" for i in range(8) for k in ("aux_loss", "load_imbalance")]
    names = ["lm_loss", "moe/aux_loss", "moe/load_imbalance", *per_layer]
    d.post("/api/ingest", [{"type": "metrics", "run_id": RUN, "step": s,
                            "values": {n: 3.0 - s / 10 for n in names}} for s in range(1, 11)])  # fmt: skip
    stats = td.rank_stats(RUN, 10, n=2)
    for r in stats["ranks"]:
        r |= {"all_to_all_ms": 2.0 + r["rank"], "expert_sync_ms": 1.0}
    d.post("/api/ingest", stats)
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(r.url) if r.status >= 400 else None)
    page.goto(d.url + f"/runs/{RUN}")
    page.wait_for_function("() => window.__nt.moe && window.__nt.moe.steps.length === 10")
    geo = page.evaluate("() => window.__nt.moe")
    assert geo["layer"] == 1 and geo["experts"] == 4 and geo["steps"] == list(range(1, 11))

    def cell(expert, j):
        g = page.evaluate("() => window.__nt.moe")
        x = (g["left"] + (j + 0.5) * g["cellW"]) * g["dpr"]
        y = (g["top"] + (expert + 0.5) * g["cellH"]) * g["dpr"]
        return page.evaluate(PIXEL, ["moe-heatmap", int(x), int(y)])

    hot, uniform, cool = cell(0, 4), cell(1, 4), cell(2, 4)
    assert near(uniform, NEUTRAL) and not near(hot, NEUTRAL) and not near(cool, NEUTRAL)
    # 2x is a quarter of the scale towards red (4x), 0.5x a quarter towards blue (1/4)
    assert near(hot, (235, 152, 115), 8) and near(cool, (152, 192, 190), 8), (hot, cool)
    assert cell(0, 0) == cell(0, 9)  # a share, not a count: every step alike
    # the colour bar: its tick labels, drawn as dark text under the bar
    assert geo["ticks"] == ["0.25x", "0.5x", "1x", "2x", "4x"]
    dark = page.evaluate(
        """() => { const c = document.getElementById('moe-scale'), r = window.devicePixelRatio || 1;
            const px = c.getContext('2d').getImageData(0, 17 * r, c.width, 10 * r).data;
            let n = 0; for (let i = 0; i < px.length; i += 4) if (px[i + 3] > 0 && px[i] < 100) n++;
            return n; }"""
    )
    assert dark > 20
    legend = page.locator("#moe-legend").inner_text()
    assert "relative to uniform (1/4 = 25%)" in legend and "10 of 10 steps" in legend

    page.locator("#moe-heatmap").scroll_into_view_if_needed()
    box = page.locator("#moe-heatmap").bounding_box()
    page.mouse.move(
        box["x"] + geo["left"] + 4.5 * geo["cellW"], box["y"] + geo["top"] + 0.5 * geo["cellH"]
    )
    assert page.locator("#moe-tip").inner_text() == "step 5, expert 0: 40 tokens (50%, 2 x uniform)"

    page.select_option("#moe-layer", "3")
    page.wait_for_function("() => window.__nt.moe.layer === 3")
    # layer 3: experts at 4/3 of uniform, the idle one saturated blue
    assert near(cell(3, 2), (49, 130, 189), 8) and near(cell(0, 2), (247, 212, 159), 8)

    d.post("/api/ingest", moe_load(11, LOADS))  # live: the open page follows
    page.wait_for_function("() => window.__nt.moe.steps.length === 11")

    page.wait_for_function(
        "() => document.querySelector('#heat-field option[value=expert_sync_ms]')"
    )
    options = page.locator("#heat-field option").all_inner_texts()
    assert "expert all-to-all (ms)" in options and "expert sync (ms, phase)" in options
    page.select_option("#heat-field", "expert_sync_ms")
    page.wait_for_function("() => window.__nt.heatmap.field === 'expert_sync_ms'")
    assert page.locator("#heat-legend").inner_text().startswith("expert sync (ms, phase): colour")
    # the overall aux loss and imbalance are charted by default, before the per-layer ones
    page.wait_for_function("() => document.querySelector('#charts .chart[data-metric=lm_loss]')")
    charted = page.evaluate(
        "() => [...document.querySelectorAll('#charts .chart')].map((c) => c.dataset.metric)"
    )
    assert "moe/aux_loss" in charted and "moe/load_imbalance" in charted, charted
    assert errors == []
    page.close()
