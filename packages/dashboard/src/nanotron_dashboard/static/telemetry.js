// The run page's views of a parallel run: the rank x interval heatmap, the pipeline Gantt
// chart, the events list (and the markers run.js draws from it), samples, tags and note.
// Drawn on plain canvases; every text from the trainer goes through textContent or fillText.
"use strict";
const NTT = (() => {
  const $ = (id) => document.getElementById(id);
  const SEVERITY_COLORS = { critical: "#e01e5a", warning: "#f2a900", info: "#7a7f87" };
  // Span colours by the order in which a timeline's kinds first start (forward, then backward,
  // then e.g. a zero-bubble schedule's weight-gradient "W"): the kinds come from the data.
  const SPAN_COLORS = ["#2b7de9", "#e9692b", "#2e9d4c", "#9b3fd1", "#d2333f", "#11949b"];
  const FIELDS = {
    step_ms: "step time (ms)", busy_ms: "not waiting: compute + optimizer + data (ms)",
    compute_ms: "compute (ms)", tp_comm_ms: "tp communication (ms)",
    all_to_all_ms: "expert all-to-all (ms)", pp_wait_ms: "pipeline wait (ms)",
    dp_wait_ms: "dp reduction wait (ms)", optimizer_ms: "optimizer (ms)", data_ms: "data (ms)",
    mem_bytes: "peak memory (bytes)", mem_reserved_bytes: "reserved memory (bytes)",
    gpu_util_pct: "GPU utilisation (%)", gpu_power_w: "GPU power (W)", cpu_util_pct: "CPU utilisation (%)",
  };
  const BUSY = ["compute_ms", "optimizer_ms", "data_ms"];
  const MAX_ROWS = 4000;  // a canvas cannot be taller than ~32k pixels
  let ctx = null;  // {runId, state, api}
  const view = { events: [], heat: null, timeline: null, editing: false };

  // A canvas sized in CSS pixels, drawn in device pixels (sharp on high-DPI screens).
  function canvas(el, w, h) {
    const dpr = window.devicePixelRatio || 1;
    el.width = Math.round(w * dpr); el.height = Math.round(h * dpr);
    el.style.width = w + "px"; el.style.height = h + "px";
    const g = el.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { g, dpr };
  }

  // cool blue -> pale -> hot red
  function ramp(t) {
    const stops = [[49, 130, 189], [255, 255, 191], [215, 48, 39]];
    const x = Math.min(Math.max(t, 0), 1) * 2, i = Math.min(Math.floor(x), 1), f = x - i;
    const c = stops[i].map((v, k) => Math.round(v + (stops[i + 1][k] - v) * f));
    return "rgb(" + c.join(",") + ")";
  }

  function rankName(r) {
    return "rank " + r.rank + " (dp=" + r.dp + " tp=" + r.tp + " pp=" + r.pp + (r.cp ? " cp=" + r.cp : "") +
      (r.host ? ", host " + r.host : "") + ")";
  }

  // --- heatmap ----------------------------------------------------------------------------
  async function loadHeat() {
    const field = $("heat-field").value;
    const fields = field === "busy_ms" ? BUSY : [field];
    const width = Math.max($("heat-box").clientWidth - 240, 100);
    const q = new URLSearchParams({ fields: fields.join(","), max_steps: Math.min(400, Math.floor(width / 3)) });
    const h = await ctx.api("/rank_stats?" + q);
    if (field === "busy_ms") {  // the time a rank spends not waiting for the others
      h.values.busy_ms = h.values.compute_ms.map((col, j) => col.map((_, i) => {
        const parts = BUSY.map((f) => h.values[f][j][i]).filter((v) => v !== null);
        return parts.length ? parts.reduce((a, b) => a + b, 0) : null;
      }));
    }
    view.heat = { h, field };
    addPhases(h.available || []);
    drawHeat();
  }

  // A phase the trainer timed that this page does not know ("name_ms") is listed by its own
  // label, made from its name: a new communication shows up without a dashboard release.
  const label = (f) => FIELDS[f] || f.replace(/_ms$/, "").replace(/_/g, " ") + " (ms, phase)";
  function addPhases(available) {
    const sel = $("heat-field"), have = new Set([...sel.options].map((o) => o.value));
    for (const f of available) if (!have.has(f)) sel.append(NT.el("option", { value: f, "data-phase": "unknown" }, label(f)));
  }

  function stragglerRanks() {
    return new Set(view.events.filter((e) => e.kind === "straggler" && Number.isInteger((e.details || {}).rank))
      .map((e) => e.details.rank));
  }

  function median(col) {
    const vals = col.filter((v) => v !== null).sort((a, b) => a - b);
    const n = vals.length;
    return n ? (n % 2 ? vals[(n - 1) / 2] : (vals[n / 2 - 1] + vals[n / 2]) / 2) : null;
  }

  // The colour of a cell is its deviation from its interval's median on a fixed scale, so
  // that 1% apart looks alike and 25% apart looks hot: min-to-max colouring painted two ranks
  // 1.3% apart full blue and full red. Beyond the range the colour saturates.
  const HEAT_RANGE = 0.25;
  const heatT = (dev) => 0.5 + dev / (2 * HEAT_RANGE);

  // A field's value for people: bytes in MiB, times in ms, with the unit
  function fieldValue(field, v) {
    if (v === null || v === undefined) return "no value";
    if (field.endsWith("_bytes")) return NT.num(v / 1048576, 1) + " MiB";
    const unit = field.endsWith("_ms") ? " ms" : field.endsWith("_pct") ? " %" : field.endsWith("_w") ? " W" : "";
    return NT.num(v, 2) + unit;
  }

  function drawScale(el) {  // the colour bar with its ticks: -25% .. 0 .. +25%
    const w = 240, h = 30, { g } = canvas(el, w, h);
    for (let x = 0; x < w - 20; x++) { g.fillStyle = ramp(x / (w - 21)); g.fillRect(10 + x, 0, 1, 12); }
    g.fillStyle = "#1d2330"; g.font = "10px system-ui, sans-serif"; g.textBaseline = "top";
    [-HEAT_RANGE, -HEAT_RANGE / 2, 0, HEAT_RANGE / 2, HEAT_RANGE].forEach((d) => {
      const x = 10 + heatT(d) * (w - 21);
      g.fillRect(x, 12, 1, 4);
      g.textAlign = "center";
      g.fillText((d > 0 ? "+" : d < 0 ? "\u2212" : "") + Math.round(Math.abs(d) * 100) + "%", Math.min(Math.max(x, 12), w - 14), 17);
    });
  }

  function drawHeat() {
    const el = $("heatmap");
    const empty = !view.heat || !view.heat.h.steps.length;
    $("ranks-section").hidden = empty;
    if (empty) return;
    const { h, field } = view.heat;
    // [interval][rank]: each value's deviation from its interval's median, so that a rank
    // slower than the others stands out even while the whole run speeds up or slows down
    const medians = h.values[field].map(median);
    const grid = h.values[field].map((col, j) => col.map((v) => (v === null || !(medians[j] > 0) ? null : v / medians[j] - 1)));
    const ranks = h.ranks.slice(0, MAX_ROWS);
    const left = 230, top = 8, bottom = 24;
    const cellH = Math.max(1, Math.min(18, Math.floor(480 / ranks.length)));
    const plotW = Math.max($("heat-box").clientWidth - left - 10, 100);
    const cellW = plotW / h.steps.length;
    const { g, dpr } = canvas(el, left + plotW + 10, top + ranks.length * cellH + bottom);
    let lo = Infinity, hi = -Infinity;  // of the values themselves, for the legend
    for (const col of h.values[field]) for (const v of col.slice(0, MAX_ROWS)) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle"; g.fillStyle = "#1d2330";
    const every = Math.ceil(11 / cellH);
    ranks.forEach((r, i) => {
      if (i % every === 0) g.fillText(rankName(r).slice(0, 40), 2, top + i * cellH + cellH / 2);
    });
    grid.forEach((col, j) => ranks.forEach((_, i) => {
      const v = col[i];
      g.fillStyle = v === null ? "#e3e6eb" : ramp(heatT(v));
      g.fillRect(left + j * cellW, top + i * cellH, Math.ceil(cellW), cellH);
    }));
    const slow = stragglerRanks();
    g.strokeStyle = "#000"; g.lineWidth = 2;
    ranks.forEach((r, i) => { if (slow.has(r.rank)) g.strokeRect(left - 1, top + i * cellH - 1, plotW + 2, cellH + 2); });
    g.fillStyle = "#1d2330"; g.textBaseline = "top";
    const tickEvery = Math.max(1, Math.ceil(h.steps.length / Math.max(Math.floor(plotW / 60), 1)));
    for (let j = 0; j < h.steps.length; j += tickEvery) {  // a label per ~60 px of columns
      g.fillText(String(h.steps[j]), left + j * cellW, top + ranks.length * cellH + 6);
    }
    drawScale($("heat-scale"));
    $("heat-legend").textContent = label(field) + ": colour = deviation from each interval's median (blue faster, red slower, " +
      "\u00b1" + HEAT_RANGE * 100 + "% and beyond saturated); values " + (lo === Infinity ? "none" : fieldValue(field, lo) + " .. " + fieldValue(field, hi)) +
      " · columns: intervals, labelled by their last step · " + h.steps.length + " of " + h.total + " intervals" +
      (h.ranks.length > MAX_ROWS ? " · first " + MAX_ROWS + " ranks" : "");
    view.heatGeom = { left, top, cellW, cellH, dpr, steps: h.steps, rows: ranks.map((r) => r.rank), field, lo, hi, range: HEAT_RANGE, medians };
    ctx.state.heatmap = view.heatGeom;
  }

  function heatTip(ev) {
    const geo = view.heatGeom;
    if (!geo) return;
    const rect = $("heatmap").getBoundingClientRect();
    const j = Math.floor((ev.clientX - rect.left - geo.left) / geo.cellW);
    const i = Math.floor((ev.clientY - rect.top - geo.top) / geo.cellH);
    const r = view.heat.h.ranks[i];
    if (j < 0 || j >= geo.steps.length || !r) { $("heat-tip").textContent = ""; return; }
    const v = view.heat.h.values[geo.field][j][i], m = geo.medians[j];
    const from = geo.steps[j] - (view.heat.h.intervals[j] || 1) + 1;
    const dev = v !== null && m > 0 ? " (" + (v >= m ? "+" : "\u2212") + NT.num(Math.abs(v / m - 1) * 100, 1) + "% vs the interval's median " + fieldValue(geo.field, m) + ")" : "";
    $("heat-tip").textContent = rankName(r) + ", steps " + from + "\u2013" + geo.steps[j] + ": " + fieldValue(geo.field, v) + dev;
  }

  function showStraggler() {
    const last = view.events.filter((e) => e.kind === "straggler").pop();
    const box = $("straggler");
    box.hidden = !last;
    if (!last) return;
    const d = last.details || {};
    const who = Number.isInteger(d.rank) ? rankName({ rank: d.rank, dp: d.dp, tp: d.tp, pp: d.pp, cp: d.cp, host: d.host }) : "";
    box.replaceChildren(NT.el("strong", {}, "Straggler" + (who ? ": " + who : "")),
      " at step " + (last.step ?? "?") + ": ", NT.el("span", { class: "straggler-message" }, last.message));
  }

  // --- pipeline timeline --------------------------------------------------------------------
  async function loadTimelines() {
    const list = await ctx.api("/timelines");
    $("pipeline-section").hidden = !list.length;
    if (!list.length) return;
    const sel = $("tl-step"), keep = sel.value;
    sel.replaceChildren(...list.map((t) => NT.el("option", { value: t.step }, "step " + t.step)));
    sel.value = list.some((t) => String(t.step) === keep) ? keep : String(list[list.length - 1].step);
    await loadTimeline();
  }

  async function loadTimeline() {
    view.timeline = await ctx.api("/timelines/" + encodeURIComponent($("tl-step").value));
    drawGantt();
  }

  function pct(v) { return v === null || v === undefined ? "?" : (100 * v).toFixed(1) + "%"; }

  // kind -> colour, for the kinds this timeline holds; past the palette, hues 137.5 deg apart
  function spanColors(spans) {
    const first = new Map();
    for (const sp of spans) {
      const t = first.get(sp.kind);
      if (t === undefined || sp.start_ms < t) first.set(sp.kind, sp.start_ms);
    }
    const kinds = [...first.keys()].sort((a, b) => first.get(a) - first.get(b) || (a < b ? -1 : a > b ? 1 : 0));
    return new Map(kinds.map((k, i) => [k, SPAN_COLORS[i] ||
      "hsl(" + Math.round((i * 137.5) % 360) + ", 60%, 45%)"]));
  }

  function showLegend(colors) {
    $("tl-legend").replaceChildren(...[...colors].map(([kind, color]) => {
      const sw = NT.el("span", { class: "swatch" });
      sw.style.background = color;  // a CSSOM property: allowed under the page's CSP
      return NT.el("span", { class: "legend-kind", "data-kind": kind }, sw, kind);
    }));
  }

  function drawGantt() {
    const t = view.timeline;
    if (!t) return;
    const left = 70, top = 6, rowH = 30, barH = 22, bottom = 22;
    const plotW = Math.max($("gantt-box").clientWidth - left - 20, 100);
    const end = Math.max(...t.spans.map((s) => s.end_ms), 1e-9);
    const scale = plotW / end;
    const { g, dpr } = canvas($("gantt"), left + plotW + 20, top + t.pp * rowH + bottom);
    const colors = spanColors(t.spans);
    showLegend(colors);
    g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle";
    for (let s = 0; s < t.pp; s++) {
      g.fillStyle = "#1d2330"; g.fillText("stage " + s, 4, top + s * rowH + rowH / 2);
      g.fillStyle = "#f6f7f9"; g.fillRect(left, top + s * rowH + (rowH - barH) / 2, plotW, barH);
    }
    for (const sp of t.spans) {
      const x = left + sp.start_ms * scale, w = Math.max((sp.end_ms - sp.start_ms) * scale - 1, 1);
      const y = top + sp.stage * rowH + (rowH - barH) / 2;
      g.fillStyle = colors.get(sp.kind);
      if (sp.chunk > 0) g.globalAlpha = 0.7;  // a later virtual chunk (interleaved): lighter
      g.fillRect(x, y, w, barH);
      g.globalAlpha = 1;
      const label = String(sp.micro_batch) + (t.chunks > 1 ? "/" + sp.chunk : "");
      if (w >= 7 * label.length + 4) { g.fillStyle = "#fff"; g.fillText(label, x + 3, y + barH / 2 + 1); }
    }
    g.fillStyle = "#1d2330"; g.textBaseline = "top";
    for (let k = 0; k <= 5; k++) {  // 3 significant digits; the end label ends at the axis end
      const ms = end * k / 5;
      g.textAlign = k === 0 ? "left" : k === 5 ? "right" : "center";
      g.fillText(String(+ms.toPrecision(3)) + " ms", left + ms * scale, top + t.pp * rowH + 6);
    }
    g.textAlign = "left";
    const bad = (t.clock && t.clock.order_violations) || 0;  // rank clocks that disagree
    const measured = bad ? "no bubble measured: " + bad + " spans start before their input was sent (the ranks' clocks disagree)"
      : "bubble measured " + pct(t.bubble_measured);
    $("tl-bubble").textContent = measured + " · formula " + pct(t.bubble_formula) +
      " (" + t.schedule + ", pp=" + t.pp + ", micro-batches=" + t.micro_batches + ", chunks=" + t.chunks + ")" +
      (t.clock && t.clock.uncertainty_ms && t.clock.uncertainty_ms.length
        ? " · rank clocks aligned to \u00b1" + NT.num(Math.max(...t.clock.uncertainty_ms), 2) + " ms" : "");
    ctx.state.gantt = { left, top, rowH, barH, scale, dpr, step: t.step, colors: Object.fromEntries(colors) };
  }

  // --- events -------------------------------------------------------------------------------
  async function loadEvents() {
    view.events = await ctx.api("/events");
    ctx.state.events = view.events;
    $("events-section").hidden = !view.events.length;
    $("events").querySelector("tbody").replaceChildren(...view.events.slice().reverse().map((e) =>
      NT.el("tr", { "data-kind": e.kind, "data-event-id": e.id },
        NT.el("td", { class: "num" }, e.step ?? ""),
        NT.el("td", {}, e.time ? new Date(e.time * 1000).toISOString().replace("T", " ").slice(0, 19) : ""),
        NT.el("td", {}, NT.el("span", { class: "badge ev " + e.severity }, e.kind)),
        NT.el("td", { class: "event-message" }, e.message),
        NT.el("td", { class: "details" }, Object.keys(e.details || {}).length ? JSON.stringify(e.details).slice(0, 300) : ""),
        NT.el("td", {}, e.source))));
    showStraggler();
    if (view.heat) drawHeat();
    ctx.onEvents();
  }

  // Vertical lines at the event steps, on every chart (a uPlot plugin; run.js maps steps to x).
  function markersPlugin(xOfStep) {
    return { hooks: { draw: (u) => {
      const g = u.ctx, b = u.bbox, drawn = [], dpr = window.devicePixelRatio || 1;
      let labelEnd = -Infinity;  // labels that would overlap the previous one are left out
      g.save(); g.lineWidth = 2 * dpr;
      g.font = (10 * dpr) + "px system-ui, sans-serif"; g.textBaseline = "top";
      for (const e of view.events) {
        if (e.step === null || e.step === undefined) continue;
        const x = xOfStep(e.step);
        if (x === null || x === undefined) continue;
        const px = u.valToPos(x, "x", true);
        if (px < b.left || px > b.left + b.width) continue;
        g.strokeStyle = SEVERITY_COLORS[e.severity] || SEVERITY_COLORS.info;
        g.beginPath(); g.moveTo(px, b.top); g.lineTo(px, b.top + b.height); g.stroke();
        // the marker says what it is: its kind, and the step
        const label = e.kind.replace(/_/g, " ") + " @ " + e.step;
        const w = g.measureText(label).width;
        const labelled = px + 3 > labelEnd;
        if (labelled) {
          g.fillStyle = g.strokeStyle; g.fillText(label, px + 3 * dpr, b.top + 2 * dpr);
          labelEnd = px + 3 * dpr + w + 4 * dpr;
        }
        drawn.push({ step: e.step, kind: e.kind, x, px, label: labelled ? label : null });
      }
      g.restore();
      u.markers = drawn;
    } } };
  }

  // --- samples ------------------------------------------------------------------------------
  async function loadSamples() {
    const list = await ctx.api("/samples");
    view.samples = list;
    $("samples-section").hidden = !list.length;
    if (!list.length) return;
    const sel = $("sample-step"), keep = sel.value;
    sel.replaceChildren(...list.map((s) => NT.el("option", { value: s.step }, "step " + s.step)));
    sel.value = list.some((s) => String(s.step) === keep) ? keep : String(list[list.length - 1].step);
    showSamples();
  }

  // Whitespace a model generated, made visible: a completion of newlines was a tall blank
  // row. Line ends show as a return sign, tabs as an arrow; a text of whitespace only (or
  // nothing) shows each space as a dot too, and says so.
  function visible(text) {
    const marked = text.replace(/\t/g, "\u2192\t").replace(/\n/g, "\u21b5\n");
    if (text.trim()) return marked;
    return marked.replace(/ /g, "\u00b7") + " (" + (text.length ? text.length + " whitespace characters" : "empty") + ")";
  }

  // A cell of bounded height (a few lines); a click shows the whole text, another folds it.
  function sampleCell(cls, text) {
    const pre = NT.el("pre", { class: cls + " clip", title: "click to show it all" }, visible(text));
    pre.addEventListener("click", () => pre.classList.toggle("open"));
    return NT.el("td", {}, pre);
  }

  function showSamples() {
    const s = (view.samples || []).find((x) => String(x.step) === $("sample-step").value);
    if (!s) return;
    $("samples").querySelector("tbody").replaceChildren(...s.samples.map((x) =>
      NT.el("tr", {}, sampleCell("prompt", x.prompt), sampleCell("completion", x.completion))));
  }

  // --- tags and note ------------------------------------------------------------------------
  function showLabels(run) {
    $("run-tags").replaceChildren(...(run.tags || []).map((t) => NT.el("span", { class: "tag" }, t)));
    if (view.editing) return;  // never overwrite what the user is typing
    $("tags-input").value = (run.tags || []).join(" ");
    $("note-input").value = run.note || "";
  }

  // The server's rule for a tag (telemetry_api.Tag), said in words before anything is sent
  const TAG_RE = /^[A-Za-z0-9._:-]{1,64}$/, MAX_TAGS = 32;
  function tagProblem(tags) {
    const bad = tags.find((t) => !TAG_RE.test(t));
    if (bad !== undefined) {
      return "tag \u201c" + bad.slice(0, 80) + "\u201d: a tag is 1 to 64 letters, digits or . _ : - (no spaces or other signs)";
    }
    return tags.length > MAX_TAGS ? tags.length + " tags: at most " + MAX_TAGS : null;
  }

  async function saveLabels() {
    const tags = $("tags-input").value.split(/[\s,]+/).filter((t) => t);
    const problem = tagProblem(tags);
    if (problem) { $("labels-result").textContent = "not saved: " + problem; return; }
    try {
      const res = await NT.json("/api/runs/" + encodeURIComponent(ctx.runId), {
        method: "PATCH", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ tags, note: $("note-input").value }),
      });
      view.editing = false;
      $("labels-result").textContent = "saved";
      showLabels({ tags: res.tags, note: res.note });
    } catch (e) { $("labels-result").textContent = "not saved: " + (e.message || e); }
  }

  function init(c) {
    ctx = c;
    $("heat-field").replaceChildren(...Object.entries(FIELDS).map(([k, v]) => NT.el("option", { value: k }, v)));
    $("heat-field").addEventListener("change", loadHeat);
    $("heatmap").addEventListener("mousemove", heatTip);
    $("tl-step").addEventListener("change", loadTimeline);
    $("sample-step").addEventListener("change", showSamples);
    $("labels-save").addEventListener("click", saveLabels);
    for (const id of ["tags-input", "note-input"]) $(id).addEventListener("input", () => { view.editing = true; });
    window.addEventListener("resize", NT.throttle(() => { drawHeat(); drawGantt(); }, 200));
  }

  const safe = (fn) => () => fn().catch((e) => { $("error").textContent = String(e.message || e); });
  return {
    init, showLabels, markersPlugin, canvas, ramp, loadAll: () => Promise.all([loadHeat(), loadTimelines(), loadEvents(), loadSamples()]),
    onLive: {
      rank_stats: NT.throttle(safe(loadHeat), 1000), pipeline_timeline: NT.throttle(safe(loadTimelines), 1000),
      event: NT.throttle(safe(loadEvents), 500), samples: NT.throttle(safe(loadSamples), 1000),
    },
  };
})();
