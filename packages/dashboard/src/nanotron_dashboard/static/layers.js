// The run page's per-layer statistics heatmap (metrics_logging.log_level 1): one statistic
// at a time (weight norm, gradient norm, update/weight ratio, activation RMS, attention max
// logit, router entropy), layers down in
// the model's order, detail steps across. Colour: log10 of the value on a scale whose ends are
// the whole decades around the view's values (labelled), blue low, red high; grey: no value;
// purple: NaN or infinite. Drawn on a plain canvas; trainer text only through textContent/fillText.
// From an alert (layer_focus.js): the detail steps around its step, the rows ranked by how early
// they departed from their baseline, a black line after the alert's column.
"use strict";
const NTL = (() => {
  const $ = (id) => document.getElementById(id);
  const MAX_ROWS = 4096;  // the ingest's bound on rows
  const NONE = "#e3e6eb", NONFINITE = "#8e44ad";
  const LABELS = { weight_norm: "weight norm", grad_norm: "gradient norm (before clipping)",
    update_ratio: "update / weight ratio", act_rms: "activation RMS (block output)",
    attn_max_logit: "attention max logit (q·k/√d)", router_entropy: "router entropy (nats)" };
  let ctx = null;  // {runId, state, api}
  const view = { h: null, geo: null, alert: null, moved: null };

  const finite = (v) => typeof v === "number" && Number.isFinite(v);
  const label = (s) => LABELS[s] || s;

  async function load() {
    const sel = $("layer-stat");
    const width = Math.max($("layer-section").parentElement.clientWidth - 260, 100);
    const q = new URLSearchParams({ max_steps: Math.min(400, Math.floor(width / 3)) });
    if (sel.value !== "") q.set("stat", sel.value);
    let moved = null;
    if (view.alert) {  // the window around the alert and the server's ranking of the rows
      const m = new URLSearchParams({ step: view.alert.step });
      if (sel.value !== "") m.set("stat", sel.value);
      moved = await ctx.api("/layer_stats/moved_first?" + m);
      if (moved.from_step !== null) { q.set("from_step", moved.from_step); q.set("to_step", moved.to_step); }
    }
    const h = await ctx.api("/layer_stats?" + q);
    $("layer-section").hidden = !h.stats.length;
    if (!h.stats.length) return;
    sel.replaceChildren(...h.stats.map((s) => NT.el("option", { value: s }, label(s))));
    sel.value = h.stat;
    view.moved = moved;
    view.h = moved ? NTLF.reorder(h, moved) : h;
    NTLF.show(moved, view.alert, label(h.stat));
    draw();
    linkAlerts();
  }

  // An alert's button: the heatmap around its step, ranked (null: back to every step).
  function focus(alert) {
    view.alert = alert;
    return load().then(() => { if (alert) $("layer-section").scrollIntoView(); });
  }

  function linkAlerts() {
    if (ctx && view.h && view.h.stats.length) NTLF.linkAlerts(ctx.state.events, (e) => focus(e).catch(fail));
  }

  function decades(h) {  // [lo, hi]: whole decades around the positive finite values
    let lo = Infinity, hi = -Infinity;
    for (const col of h.values) for (const v of col) if (finite(v) && v > 0) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (lo === Infinity) return [0, 1];
    const a = Math.floor(Math.log10(lo)), b = Math.ceil(Math.log10(hi));
    return [a, Math.max(b, a + 1)];
  }

  function colour(v, lo, hi) {
    if (v === null || v === undefined) return NONE;
    if (!finite(v)) return NONFINITE;
    return NTT.ramp(v > 0 ? (Math.log10(v) - lo) / (hi - lo) : 0);
  }

  function drawScale(lo, hi) {  // the colour bar with one tick per decade
    const w = 260, pad = 16, bar = w - 2 * pad, { g } = NTT.canvas($("layer-scale"), w, 30);
    for (let x = 0; x < bar; x++) { g.fillStyle = NTT.ramp(x / (bar - 1)); g.fillRect(pad + x, 0, 1, 12); }
    g.fillStyle = "#1d2330"; g.font = "10px system-ui, sans-serif"; g.textBaseline = "top"; g.textAlign = "center";
    const every = Math.ceil((hi - lo) / 6), ticks = [];
    for (let d = lo; d <= hi; d += every) {
      const x = pad + ((d - lo) / (hi - lo)) * (bar - 1);
      g.fillRect(x, 12, 1, 4);
      g.fillText("1e" + d, x, 17);
      ticks.push("1e" + d);
    }
    return ticks;
  }

  function draw() {
    const h = view.h;
    if (!h || !h.steps.length) return;
    const R = Math.min(h.rows.length, MAX_ROWS), [lo, hi] = decades(h);
    const left = 230, top = 8, bottom = 24;
    const cellH = Math.max(1, Math.min(14, Math.floor(640 / R)));
    const plotW = Math.max($("layer-box").clientWidth - left - 10, 100);
    const cellW = plotW / h.steps.length;
    const { g, dpr } = NTT.canvas($("layer-heatmap"), left + plotW + 10, top + R * cellH + bottom);
    g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle"; g.fillStyle = "#1d2330";
    const every = Math.ceil(11 / cellH);
    for (let i = 0; i < R; i += every) g.fillText(h.rows[i].slice(0, 36), 2, top + i * cellH + cellH / 2);
    h.values.forEach((col, j) => {
      for (let i = 0; i < R; i++) {
        g.fillStyle = colour(col[i], lo, hi);
        g.fillRect(left + j * cellW, top + i * cellH, Math.ceil(cellW), cellH);
      }
    });
    let focus = null;
    if (view.moved) {  // the alert: a line after the newest detail step at or before it
      const j = NTLF.markerColumn(h.steps, view.moved.step), x = Math.round(left + (j + 1) * cellW);
      g.fillStyle = "#000"; g.fillRect(x - 1, top, 2, R * cellH);
      focus = { step: view.moved.step, column: j, ranked: view.moved.ranked.map((r) => r.row) };
    }
    g.fillStyle = "#1d2330"; g.textBaseline = "top";
    const tickEvery = Math.max(1, Math.ceil(h.steps.length / Math.max(Math.floor(plotW / 60), 1)));
    for (let j = 0; j < h.steps.length; j += tickEvery) g.fillText(String(h.steps[j]), left + j * cellW, top + R * cellH + 6);
    const ticks = drawScale(lo, hi);
    $("layer-legend").textContent = label(h.stat) + ": colour = log10 of the value, 1e" + lo + " (blue) to 1e" + hi +
      " (red); grey: no value, purple: NaN or infinite · rows: " + h.rows.length + " layers · columns: " +
      h.steps.length + " of " + h.total + " detail steps" + (h.rows.length > MAX_ROWS ? " · first " + MAX_ROWS + " rows" : "");
    view.geo = { left, top, cellW, cellH, dpr, steps: h.steps, stat: h.stat, rows: R, cells: R * h.steps.length, ticks,
      order: h.rows.slice(0, R), focus };
    ctx.state.layers = view.geo;
  }

  function tip(ev) {
    const geo = view.geo, h = view.h;
    if (!geo) return;
    const rect = $("layer-heatmap").getBoundingClientRect();
    const j = Math.floor((ev.clientX - rect.left - geo.left) / geo.cellW);
    const i = Math.floor((ev.clientY - rect.top - geo.top) / geo.cellH);
    if (j < 0 || j >= geo.steps.length || i < 0 || i >= geo.rows) { $("layer-tip").textContent = ""; return; }
    const v = h.values[j][i];
    $("layer-tip").textContent = "step " + geo.steps[j] + ", " + h.rows[i] + ": " + label(h.stat) + " " +
      (v === null || v === undefined ? "no value" : finite(v) ? NT.num(v, 4) : String(v));
  }

  const fail = (e) => { $("error").textContent = String(e.message || e); };

  function init(c) {
    ctx = c;
    $("layer-stat").addEventListener("change", () => load().catch(fail));
    $("layer-unfocus").addEventListener("click", () => focus(null).catch(fail));
    $("layer-heatmap").addEventListener("mousemove", tip);
    window.addEventListener("resize", NT.throttle(draw, 200));
  }

  const safe = () => load().catch(fail);
  return { init, load, linkAlerts, onLive: { layer_stats: NT.throttle(safe, 1000) } };
})();
