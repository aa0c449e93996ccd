// The run page's expert load heatmap (mixture-of-experts runs): one MoE layer at a time,
// experts down, logged steps across. A cell's colour is the expert's share of the step's
// (token, slot) assignments relative to uniform (1/E), on a fixed diverging scale in log2:
// pale = uniform, red = over-loaded (2x, 4x), blue = under-loaded (0.5x, 0.25x); beyond 4x
// (or under 0.25x, an idle expert included) the colour saturates, so that two runs or two
// layers read alike. Drawn on a plain canvas; trainer text only through textContent/fillText.
"use strict";
const NTM = (() => {
  const $ = (id) => document.getElementById(id);
  const RANGE = 2;  // log2 of the ratio at which the scale saturates: 4x and 1/4
  const TICKS = [0.25, 0.5, 1, 2, 4];
  const MAX_ROWS = 1024;  // the ingest's bound on experts
  let ctx = null;  // {runId, state, api}
  const view = { h: null, geo: null };

  const ratioT = (r) => 0.5 + (r > 0 ? Math.log2(r) : -Infinity) / (2 * RANGE);
  const times = (r) => String(+r.toPrecision(3)) + "x";

  async function load() {
    const sel = $("moe-layer");
    // the section may still be hidden (no width): the page's width stands for the plot's
    const width = Math.max($("moe-section").parentElement.clientWidth - 100, 100);
    const q = new URLSearchParams({ max_steps: Math.min(400, Math.floor(width / 3)) });
    if (sel.value !== "") q.set("layer", sel.value);
    const h = await ctx.api("/moe_load?" + q);
    $("moe-section").hidden = !h.layers.length;
    if (!h.layers.length) return;
    const keep = String(h.layer);
    sel.replaceChildren(...h.layers.map((l) => NT.el("option", { value: l }, "layer " + l)));
    sel.value = keep;
    view.h = h;
    draw();
  }

  function drawScale() {  // the colour bar with its ticks: 0.25x .. 1x .. 4x uniform
    const w = 260, pad = 16, bar = w - 2 * pad, { g } = NTT.canvas($("moe-scale"), w, 30);
    for (let x = 0; x < bar; x++) { g.fillStyle = NTT.ramp(x / (bar - 1)); g.fillRect(pad + x, 0, 1, 12); }
    g.fillStyle = "#1d2330"; g.font = "10px system-ui, sans-serif"; g.textBaseline = "top"; g.textAlign = "center";
    for (const r of TICKS) {
      const x = pad + ratioT(r) * (bar - 1);
      g.fillRect(x, 12, 1, 4);
      g.fillText(times(r), x, 17);
    }
    view.scaleTicks = TICKS.map(times);
  }

  function draw() {
    const h = view.h;
    if (!h || !h.steps.length) return;
    const E = Math.min(h.num_experts, MAX_ROWS);
    const left = 80, top = 8, bottom = 24;
    const cellH = Math.max(1, Math.min(16, Math.floor(480 / E)));
    const plotW = Math.max($("moe-box").clientWidth - left - 10, 100);
    const cellW = plotW / h.steps.length;
    const { g, dpr } = NTT.canvas($("moe-heatmap"), left + plotW + 10, top + E * cellH + bottom);
    g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle"; g.fillStyle = "#1d2330";
    const every = Math.ceil(11 / cellH);
    for (let e = 0; e < E; e += every) g.fillText("expert " + e, 2, top + e * cellH + cellH / 2);
    h.counts.forEach((col, j) => {
      const uniform = h.tokens[j] / col.length;
      for (let e = 0; e < E; e++) {
        const known = uniform > 0 && col[e] !== undefined;  // a step may hold fewer experts
        g.fillStyle = known ? NTT.ramp(ratioT(col[e] / uniform)) : "#e3e6eb";
        g.fillRect(left + j * cellW, top + e * cellH, Math.ceil(cellW), cellH);
      }
    });
    g.fillStyle = "#1d2330"; g.textBaseline = "top";
    const tickEvery = Math.max(1, Math.ceil(h.steps.length / Math.max(Math.floor(plotW / 60), 1)));
    for (let j = 0; j < h.steps.length; j += tickEvery) g.fillText(String(h.steps[j]), left + j * cellW, top + E * cellH + 6);
    drawScale();
    $("moe-legend").textContent = "layer " + h.layer + ": colour = an expert's share of the step's tokens relative to uniform (1/" +
      h.num_experts + " = " + NT.num(100 / h.num_experts, 2) + "%): red over-loaded, blue under-loaded, " +
      "4x and 1/4 and beyond saturated · columns: logged steps · " + h.steps.length + " of " + h.total + " steps" +
      (h.num_experts > MAX_ROWS ? " · first " + MAX_ROWS + " experts" : "");
    view.geo = { left, top, cellW, cellH, dpr, steps: h.steps, layer: h.layer, experts: E, ticks: view.scaleTicks };
    ctx.state.moe = view.geo;
  }

  function tip(ev) {
    const geo = view.geo, h = view.h;
    if (!geo) return;
    const rect = $("moe-heatmap").getBoundingClientRect();
    const j = Math.floor((ev.clientX - rect.left - geo.left) / geo.cellW);
    const e = Math.floor((ev.clientY - rect.top - geo.top) / geo.cellH);
    if (j < 0 || j >= geo.steps.length || e < 0 || e >= geo.experts) { $("moe-tip").textContent = ""; return; }
    const n = h.counts[j][e], total = h.tokens[j], share = total > 0 ? n / total : 0;
    if (n === undefined) { $("moe-tip").textContent = "step " + geo.steps[j] + ", expert " + e + ": no count"; return; }
    $("moe-tip").textContent = "step " + geo.steps[j] + ", expert " + e + ": " + n + " tokens (" +
      NT.num(100 * share, 1) + "%, " + NT.num(share * h.counts[j].length, 2) + " x uniform)";
  }

  function init(c) {
    ctx = c;
    $("moe-layer").addEventListener("change", () => load().catch((e) => { $("error").textContent = String(e.message || e); }));
    $("moe-heatmap").addEventListener("mousemove", tip);
    window.addEventListener("resize", NT.throttle(draw, 200));
  }

  const safe = () => load().catch((e) => { $("error").textContent = String(e.message || e); });
  return { init, load, onLive: { moe_load: NT.throttle(safe, 1000) } };
})();
