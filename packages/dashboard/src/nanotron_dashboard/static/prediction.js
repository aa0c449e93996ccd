// The run page's "Predicted vs measured" table: the layout planner's prediction for the run's
// layout (sent once by the trainer) next to what the run's rank_stats measured (the server
// computes both and the ratios: prediction_store.py). A part off by more than the threshold
// is flagged. Trainer text only through textContent.
"use strict";
const NTP = (() => {
  const $ = (id) => document.getElementById(id);
  const ROWS = [
    ["memory_bytes", "peak memory (worst rank)"],
    ["step_ms", "step time"],
    ["compute_ms", "compute"],
    ["comm_ms", "exposed communication"],
    ["idle_ms", "pipeline idle"],
    ["optimizer_ms", "optimizer"],
  ];
  let ctx = null;  // {runId, state, api}

  const mib = (b) => (b / 2 ** 20 >= 1024 ? (b / 2 ** 30).toFixed(2) + " GiB" : (b / 2 ** 20).toFixed(1) + " MiB");
  const ms = (v) => (v >= 100 ? v.toFixed(0) : v.toPrecision(3)) + " ms";
  const show = (key, v) => (v === null || v === undefined ? "—" : key === "memory_bytes" ? mib(v) : ms(v));

  function verdict(c, threshold) {
    if (!c || c.negligible) return c && c.negligible ? "negligible" : "";
    if (c.ratio === null) return c.off ? "off: measured 0" : "";
    const pct = Math.round(Math.abs(c.ratio - 1) * 100);
    return c.off ? "off by " + pct + "% (> " + Math.round(threshold * 100) + "%)" : "within " + pct + "%";
  }

  async function load() {
    const body = await ctx.api("/prediction");
    const p = body.predicted;
    $("prediction-section").hidden = !p;
    if (!p) return;
    const m = body.measured || {}, cmp = body.compare || {};
    $("prediction-device").textContent = "device " + p.device + " (" + p.device_source + ")" +
      (body.measured ? ", measured over " + m.intervals + " rank_stats intervals" : ", nothing measured yet");
    const rows = ROWS.map(([key, label]) => {
      const c = cmp[key];
      const ratio = c && c.ratio !== null && c.ratio !== undefined ? c.ratio.toFixed(2) + "x" : "—";
      return NT.el("tr", { class: c && c.off ? "off" : "", "data-part": key },
        NT.el("td", {}, label), NT.el("td", { class: "num" }, show(key, p[key])),
        NT.el("td", { class: "num" }, show(key, m[key])), NT.el("td", { class: "num" }, ratio),
        NT.el("td", { class: "verdict" }, verdict(c, body.off_threshold)));
    });
    $("prediction").tBodies[0].replaceChildren(...rows);
    ctx.state.prediction = { off: ROWS.map(([k]) => k).filter((k) => cmp[k] && cmp[k].off) };
  }

  function init(c) { ctx = c; }

  const safe = () => load().catch((e) => { $("error").textContent = String(e.message || e); });
  // rank_stats: new measurements; prediction: a restarted attempt's
  const live = NT.throttle(safe, 2000);
  return { init, load, onLive: { prediction: live, rank_stats: live } };
})();
