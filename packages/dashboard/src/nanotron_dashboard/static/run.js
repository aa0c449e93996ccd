// The run page: downsampled series from the API, live points from /ws/runs/{id}.
"use strict";
(() => {
  const runId = decodeURIComponent(location.pathname.split("/").pop());
  const DEFAULT_ORDER = ["lm_loss", "val_loss", "grad_norm", "tokens_per_sec", "lr", "moe/aux_loss", "moe/load_imbalance"];
  const COLORS = ["#2b7de9", "#e9692b", "#2e9d4c", "#9b3fd1", "#d2333f", "#11949b"];
  const MAX_POINTS = 2000;
  const DEFAULT_CHARTS = 12;  // a run may log up to 1000 metrics: more are picked by hand
  // Series drawn over another chart too: the held-out loss over the training loss.
  const OVERLAYS = { lm_loss: ["val_loss"] };
  // The series to fetch and follow live: the charted ones and what is overlaid on them.
  const followed = () => Array.from(new Set(state.shown.flatMap((n) => [n, ...(OVERLAYS[n] || [])])));
  const $ = (id) => document.getElementById(id);
  const state = { run: null, session: null, charts: {}, data: {}, compare: [], started: null, shown: [], constants: {},
    labels: {}, parent: null };
  window.__nt = state;  // for debugging in the console and for the browser tests

  const opt = () => ({ x: $("x-axis").value, smoothing: parseFloat($("smoothing").value), log: $("log-y").checked });

  // Several runs (each its own x values) on one chart: merge the x values, null where absent.
  function align(seriesList) {
    const xs = Array.from(new Set(seriesList.flatMap((s) => s.x))).sort((a, b) => a - b);
    const pos = new Map(xs.map((x, i) => [x, i]));
    const cols = seriesList.map((s) => {
      // undefined where a run has no point at this x (spanned); null is a NaN/inf value (a gap)
      const col = new Array(xs.length).fill(undefined);
      s.x.forEach((x, i) => { col[pos.get(x)] = s.y[i]; });
      return col;
    });
    return [xs, ...cols];
  }

  // The parent's history up to the step this run resumed from, greyed in before this run's
  // own points: a user thinks of the lineage as one run.
  function parentSeries(name) {
    const p = state.parent, s = p && (state.data[p.id] || {})[name];
    if (!s || opt().x === "time") return [];
    const keep = s.step.map((st) => st <= p.step);
    const pick = (a) => a.filter((_, i) => keep[i]);
    return [{ label: "parent " + p.label + " (to step " + p.step + ")", x: pick(s.x), y: pick(s.y), stroke: "#9aa0a8", metric: name }];
  }

  function seriesFor(name) {
    const out = parentSeries(name);
    const o = opt();
    for (const [i, rid] of [runId, ...state.compare].entries()) {
      const color = COLORS[i % COLORS.length];
      const runLabel = rid === runId ? (state.run.name || rid) : (state.labels[rid] || rid);
      for (const metric of [name, ...(OVERLAYS[name] || [])]) {
        const s = (state.data[rid] || {})[metric];
        if (!s) continue;
        const label = metric === name ? runLabel : runLabel + " " + metric;
        const dash = metric === name ? undefined : [6, 4];  // overlaid series: dashed, with points
        if (o.smoothing > 0 && s.smooth && metric === name) {
          out.push({ label: label + " (raw)", x: s.x, y: s.y, stroke: color + "40" });
          out.push({ label, x: s.x, y: s.smooth, stroke: color });
        } else out.push({ label, x: s.x, y: s.y, stroke: color, dash, metric });
      }
    }
    return out;
  }

  const { si, MIB, unitOf, isBytes, X_UNITS, xRange } = NTU;

  // The x value in words, for the legend: "step 24", "1.2M tokens", "35 s"
  function xText(v) {
    if (v === null || v === undefined) return "--";
    const x = opt().x;
    return x === "step" ? "step " + v : x === "tokens" ? si(v) + " tokens" : si(v) + " s";
  }
  function positiveOnly(col) { return col.map((v) => (v !== null && v > 0 ? v : null)); }

  function draw(name) {
    const list = seriesFor(name);
    if (!list.length) return;
    if (foldConstant(name, list)) return;
    const o = opt();
    let data = align(list);
    if (isBytes(name)) data = [data[0], ...data.slice(1).map((col) => col.map((v) => (typeof v === "number" ? v / MIB : v)))];
    if (o.log) data = [data[0], ...data.slice(1).map(positiveOnly)];
    const unit = unitOf(name), few = data[0].length <= 2, one = data[0].length === 1;
    let entry = state.charts[name];
    const key = list.map((s) => s.label).join("|") + o.log + o.x + few + one;
    if (entry && entry.key === key) { entry.plot.setData(data); }
    else {
      if (entry) entry.plot.destroy();
      const box = entry ? entry.box : makeBox(name);
      const plot = new uPlot({
        width: Math.max(box.clientWidth - 16, 300), height: 240,
        plugins: [NTT.markersPlugin((step) => xOfStep(name, step))],
        // uPlot spans 0..2x for a lone x value (0-600 for step 300): a range around it instead
        scales: { x: one ? { time: false, auto: false, range: xRange(null, data[0][0], data[0][0]) } : { time: false },
          y: { distr: o.log ? 3 : 1 } },
        axes: [{ label: X_UNITS[o.x], values: (u, vals) => vals.map(si) },
          { label: unit, values: (u, vals) => vals.map(si), size: 60 }],
        // Overlaid series are sparse by design (a val_loss every N steps): points shown, and
        // a series of one or two points is drawn as points (a line needs two).
        series: [{ label: X_UNITS[o.x], value: (u, v) => xText(v) },
          ...list.map((s) => ({ label: s.label, stroke: s.stroke, spanGaps: false, width: 1.5,
            dash: s.dash, points: { show: !!s.dash || few, size: 7 },
            value: (u, v) => (v === null || v === undefined ? "--" : NT.num(v) + (unit ? " " + unit : "")) }))],
      }, data, box.querySelector(".plot"));
      entry = state.charts[name] = { plot, box, key };
    }
    const bad = ((state.data[runId] || {})[name] || {}).nonfinite || [];
    entry.box.querySelector(".nonfinite").textContent = bad.length
      ? "non-finite values: " + bad.slice(0, 20).map((p) => "step " + p.step + " = " + p.value).join(", ")
      : "";
  }

  // A series that never changed (global_batch_size) takes no chart slot: one line of the
  // run summary says its value. Compared runs keep their charts (their values may differ).
  function foldConstant(name, list) {
    const own = list.filter((s) => !s.label.startsWith("parent "));
    const ys = own.length === 1 && list.length === 1 && !state.compare.length ? own[0].y : null;
    const constant = ys && ys.length >= 2 && ys.every((v) => typeof v === "number" && v === ys[0]);
    if (!constant) { if (state.constants[name] !== undefined) { delete state.constants[name]; showSummary(); } return false; }
    const entry = state.charts[name];
    if (entry) { entry.plot.destroy(); entry.box.remove(); delete state.charts[name]; }
    state.constants[name] = ys[0];
    showSummary();
    return true;
  }

  function showSummary() {
    const names = Object.keys(state.constants).sort();
    $("run-summary").hidden = !names.length;
    $("run-summary").replaceChildren(NT.el("strong", {}, "constant over the run: "),
      ...names.map((n, i) => NT.el("span", { class: "constant", "data-metric": n },
        (i ? ", " : "") + n + " = " + NT.num(isBytes(n) ? state.constants[n] / MIB : state.constants[n]) +
        (unitOf(n) ? " " + unitOf(n) : ""))));
  }

  // An event's step on this chart's x axis: the x of the first point at or after it.
  function xOfStep(name, step) {
    if (opt().x === "step") return step;
    const s = (state.data[runId] || {})[name];
    if (!s) return null;
    const i = s.step.findIndex((v) => v >= step);
    return i < 0 ? null : s.x[i];
  }

  function makeBox(name) {
    const unit = unitOf(name);  // also on the y axis (drawn on the canvas)
    const box = NT.el("div", { class: "chart", "data-metric": name },
      NT.el("h3", {}, name, unit ? NT.el("span", { class: "unit" }, " (" + unit + ")") : ""),
      NT.el("div", { class: "plot" }), NT.el("div", { class: "nonfinite" }));
    const system = name.startsWith("system/");  // CPU/GPU utilisation, memory, power
    $(system ? "system-charts" : "charts").append(box);
    if (system) $("system-section").hidden = false;
    return box;
  }

  async function fetchRun(rid) {
    const o = opt();
    const q = new URLSearchParams({ max_points: MAX_POINTS, x: o.x, smoothing: o.smoothing, names: followed().join(",") });
    const res = await NT.json("/api/runs/" + encodeURIComponent(rid) + "/metrics?" + q);
    state.data[rid] = res.series;
  }

  // The default order, then the downstream scores (eval/<task>/<metric>) after the held-out
  // loss, then the rest by name.
  function orderOf(name) {
    const i = DEFAULT_ORDER.indexOf(name);
    return i >= 0 ? i : name.startsWith("eval/") ? DEFAULT_ORDER.indexOf("val_loss") + 0.5 : 99;
  }
  function byDefaultOrder(names) {
    return names.slice().sort((a, b) => orderOf(a) - orderOf(b) || a.localeCompare(b));
  }

  function metricNames() {
    const have = state.data[runId] || {};
    return state.shown.filter((n) => n !== "consumed_tokens" && have[n]);
  }

  // The metric picker: every name of the run, the first DEFAULT_CHARTS ticked.
  function buildPicker(names) {
    const all = byDefaultOrder(names.filter((n) => n !== "consumed_tokens"));
    const isSystem = (n) => n.startsWith("system/");
    if (!state.shown.length) state.shown = [...all.filter((n) => !isSystem(n)).slice(0, DEFAULT_CHARTS), ...all.filter(isSystem)];
    const boxes = all.map((n) => {
      const cb = NT.el("input", { type: "checkbox", value: n });
      cb.checked = state.shown.includes(n);
      cb.addEventListener("change", () => {
        state.shown = all.filter((m) => $("picker").querySelector('input[value="' + CSS.escape(m) + '"]').checked);
        for (const [name, entry] of Object.entries(state.charts)) {
          if (!state.shown.includes(name)) { entry.plot.destroy(); entry.box.remove(); delete state.charts[name]; }
          $("system-section").hidden = !$("system-charts").children.length;
        }
        reload();
      });
      return NT.el("label", { "data-metric": n }, cb, " " + n);
    });
    $("picker").replaceChildren(NT.el("span", {}, all.length + " metrics:"), ...boxes);
  }

  async function reload() {
    try {
      const rf = state.run && state.run.resumed_from;
      state.parent = rf ? { id: rf.run_id, step: rf.step, label: rf.run_id } : null;
      const parent = state.parent ? [fetchRun(state.parent.id).catch(() => { state.parent = null; })] : [];
      await Promise.all([...[runId, ...state.compare].map(fetchRun), ...parent]);
      $("error").textContent = "";
    } catch (e) { $("error").textContent = String(e.message || e); return; }
    metricNames().forEach(draw);
  }

  // Live points: appended to the current run's series (EMA continued exactly as the server's).
  function onPoints(msg) {
    if (msg.type === "run_changed") { loadRun(); return; }
    const lives = [NTT, NTM, NTL, NTP].map((m) => m.onLive[msg.type]).filter(Boolean);
    if (lives.length) { lives.forEach((f) => f()); return; }
    if (msg.type !== "points") return;
    const o = opt();
    const series = state.data[runId] || (state.data[runId] = {});
    const tokensAt = new Map((msg.points.consumed_tokens || []).map((p) => [p[0], p[1]]));
    let needRefetch = false;
    for (const [name, pts] of Object.entries(msg.points)) {
      if (!followed().includes(name)) {  // a metric not charted: only a new one matters
        if (state.run && !state.run.metric_names.includes(name)) scheduleRunReload();
        continue;
      }
      let s = series[name];
      if (!s) { needRefetch = true; continue; }
      for (const [step, value, t] of pts) {
        if (s.step.length && step <= s.step[s.step.length - 1]) { needRefetch = true; continue; }
        const x = o.x === "step" ? step : o.x === "time" ? t - (state.started ?? t) : tokensAt.get(step);
        if (x === undefined) continue;
        const y = typeof value === "number" ? value : null;
        s.x.push(x); s.step.push(step); s.y.push(y); s.count += 1;
        if (y === null) s.nonfinite.push({ x, step, value });
        if (s.smooth) {
          const a = o.smoothing, n = s.count - 1, prev = s.smooth[s.smooth.length - 1];
          const raw = prev === null || prev === undefined ? 0 : prev * (1 - Math.pow(a, n));
          const v = y === null ? (s._last ?? 0) : y;
          s.smooth.push((a * raw + (1 - a) * v) / (1 - Math.pow(a, n + 1)));
        }
        if (y !== null) s._last = y;
      }
      if (s.x.length > 3 * MAX_POINTS) needRefetch = true;
    }
    if (needRefetch) scheduleReload(); else scheduleDraw();
  }
  const scheduleDraw = NT.throttle(() => metricNames().forEach(draw), 100);
  const scheduleReload = NT.throttle(reload, 1000);
  const scheduleRunReload = NT.throttle(() => loadRun(), 2000);

  async function loadRun() {
    const run = await NT.json("/api/runs/" + encodeURIComponent(runId));
    state.run = run;
    state.started = run.started;
    document.title = "nanotron: " + (run.name || run.id);
    $("run-name").textContent = run.name || run.id;
    $("run-status").replaceChildren(NT.badge(run.status), run.nonfinite ? NT.nanBadge(run.nonfinite) : "",
      run.attempts && run.attempts.length > 1 ? NT.el("span", { id: "run-attempts" }, " " + run.attempts.length + " attempts") : "");
    const before = state.run_names || "";
    state.run_names = run.metric_names.join(",");
    if (before !== state.run_names) buildPicker(run.metric_names);
    if (before && before !== state.run_names) scheduleReload();
    $("run-project").textContent = run.project;
    $("run-parent").replaceChildren(run.resumed_from
      ? NT.el("a", { href: "/runs/" + encodeURIComponent(run.resumed_from.run_id), id: "parent-link" },
        "resumed from " + run.resumed_from.run_id + " @ " + run.resumed_from.step) : "");
    $("run-error").textContent = run.error || "";
    NTT.showLabels(run);
    $("run-children").replaceChildren(...run.resumed_runs.map((c) =>
      NT.el("a", { href: "/runs/" + encodeURIComponent(c), class: "child-run" }, "resumed as " + c + " ")));
    $("config").textContent = JSON.stringify(run.config, null, 2);
    $("csv").href = "/api/runs/" + encodeURIComponent(runId) + "/metrics.csv";
    loadCheckpoints();
  }

  async function copy(text, button) {
    try { await navigator.clipboard.writeText(text); }
    catch (e) {  // no clipboard permission (plain http on another host): select-and-copy
      const ta = NT.el("textarea", {}, text); document.body.append(ta); ta.select();
      document.execCommand("copy"); ta.remove();
    }
    button.textContent = "copied";
  }

  // Resume asks first: the exact command, where it runs and how many processes it starts.
  function confirmResume(ck, button) {
    const run = state.run || {}, topo = run.topology || {};
    const layout = Object.entries(topo).filter(([, v]) => Number.isInteger(v)).map(([k, v]) => k + "=" + v).join(" ");
    const go = NT.el("button", { id: "resume-go" }, "Launch");
    const cancel = NT.el("button", { id: "resume-cancel" }, "Cancel");
    const box = NT.el("div", { id: "resume-confirm", class: "confirm" },
      NT.el("strong", {}, "Resume from the checkpoint of step " + ck.step + "?"),
      NT.el("div", {}, "runs in " + (run.cwd || "?") + ":"),
      NT.el("code", { class: "cmd" }, ck.resume_command || "(no command recorded)"),
      NT.el("div", { class: "layout" }, (run.world_size ? run.world_size + " processes" : "processes: as the command says") +
        (layout ? " (" + layout + ")" : "")), go, " ", cancel);
    $("launch-result").replaceChildren(box);
    cancel.addEventListener("click", () => $("launch-result").replaceChildren());
    go.addEventListener("click", () => resume(ck, button));
  }

  async function resume(ck, button) {
    button.disabled = true;
    const before = new Set((state.run && state.run.resumed_runs) || []);
    try {
      const res = await NT.json("/api/checkpoints/" + ck.id + "/resume", {
        method: "POST", headers: { "X-CSRF-Token": state.session.csrf } });
      $("launch-result").replaceChildren("started pid " + res.pid + " in " + res.cwd + " (log: " + res.log + "); ",
        NT.el("span", { id: "new-run" }, "waiting for the new run to report..."));
      watchForChild(before, Date.now() + 10 * 60 * 1000);
    } catch (e) { $("launch-result").textContent = "resume failed: " + (e.message || e); }
    button.disabled = false;
  }

  // The launched trainer's run_start names this run as its parent: link to it when it does.
  async function watchForChild(before, until) {
    const run = await NT.json("/api/runs/" + encodeURIComponent(runId)).catch(() => null);
    const child = run && run.resumed_runs.find((c) => !before.has(c));
    if (child) {
      $("new-run").replaceChildren("new run: ", NT.el("a", { href: "/runs/" + encodeURIComponent(child), id: "new-run-link" }, child));
      return;
    }
    if (Date.now() < until) setTimeout(() => watchForChild(before, until), 1000);
    else $("new-run").textContent = "no run reported within 10 minutes: see the log";
  }

  async function loadCheckpoints() {
    // POST: stores checkpoints found on disk so that they can be resumed (a GET never writes);
    // only a page given the CSRF token may write: an anonymous visitor of a server with
    // credentials reads the list
    const base = "/api/runs/" + encodeURIComponent(runId) + "/checkpoints";
    const cks = state.session && state.session.csrf
      ? await NT.json(base + "/scan", { method: "POST" }).catch(() => NT.json(base)) : await NT.json(base);
    $("checkpoints").querySelector("tbody").replaceChildren(...cks.map((ck) => {
      const copyBtn = NT.el("button", { class: "copy" }, "copy");
      copyBtn.addEventListener("click", () => copy(ck.resume_shell || ck.resume_command || "", copyBtn));
      const actions = NT.el("td", {}, copyBtn);
      if (state.session && state.session.allow_launch) {
        const b = NT.el("button", { class: "resume" }, "Resume");
        b.addEventListener("click", () => confirmResume(ck, b));
        actions.append(" ", b);
      }
      // binary units, as the trainer's listing prints them
      const size = ck.size == null ? "" : (ck.size / 1048576).toFixed(1) + " MiB";
      const command = NT.el("td", {}, NT.el("code", { class: "cmd" }, ck.resume_command || "(no command recorded)"));
      const steps = state.run && state.run.config && state.run.config.tokens ? state.run.config.tokens.train_steps : null;
      if (steps != null && ck.step >= steps) {  // resuming it alone trains nothing
        command.append(NT.el("div", { class: "note final-checkpoint" },
          "tokens.train_steps (" + steps + ") is reached here: add --override tokens.train_steps=N (N > " + steps + ") to train on"));
      }
      return NT.el("tr", { "data-step": ck.step }, NT.el("td", {}, ck.step), NT.el("td", {}, ck.consumed_tokens ?? ""),
        NT.el("td", {}, size), NT.el("td", {}, ck.complete ? "yes" : "no"), command, actions);
    }));
  }

  async function deleteRun() {
    if (!confirm("Delete run " + runId + " and its metrics from the dashboard? (Checkpoint files stay.)")) return;
    try {
      await NT.json("/api/runs/" + encodeURIComponent(runId), { method: "DELETE" });
      location.href = "/";
    } catch (e) { $("error").textContent = "delete failed: " + (e.message || e); }
  }

  // Runs of the same project and name are told apart by their start, step and status; the
  // legend gets a short label (name and start), not a run id that wraps onto four lines.
  function started(t) {
    return t ? new Date(t * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC" : "start unknown";
  }

  async function loadCompareChoices() {
    const runs = await NT.json("/api/runs?limit=200");
    for (const r of runs) state.labels[r.id] = (r.name || r.id).slice(0, 40) + " (" + started(r.started).slice(5) + ")";
    $("compare").replaceChildren(...runs.filter((r) => r.id !== runId).map((r) =>
      NT.el("option", { value: r.id }, (r.project ? r.project + "/" : "") + (r.name || r.id) + " \u00b7 started " +
        started(r.started) + " \u00b7 step " + (r.step ?? "-") + " \u00b7 " + r.status)));
  }

  $("x-axis").addEventListener("change", reload);
  $("log-y").addEventListener("change", () => metricNames().forEach(draw));
  $("smoothing").addEventListener("change", reload);
  $("smoothing").addEventListener("input", () => { $("smoothing-value").textContent = $("smoothing").value; });
  $("compare").addEventListener("change", () => {
    state.compare = Array.from($("compare").selectedOptions).map((o) => o.value);
    reload();
  });

  (async () => {
    state.session = await NT.session();
    const api = (path) => NT.json("/api/runs/" + encodeURIComponent(runId) + path);
    NTT.init({ runId, state, api, onEvents: () => { Object.values(state.charts).forEach((e) => e.plot.redraw()); NTL.linkAlerts(); } });
    NTM.init({ runId, state, api });
    NTL.init({ runId, state, api });
    NTP.init({ runId, state, api });
    $("delete").addEventListener("click", deleteRun);
    try { await loadRun(); } catch (e) { $("error").textContent = String(e.message || e); return; }
    await reload();
    Promise.all([NTT.loadAll(), NTM.load(), NTL.load(), NTP.load()]).catch((e) => { $("error").textContent = String(e.message || e); });
    loadCompareChoices();
    NT.live("/ws/runs/" + encodeURIComponent(runId), onPoints, scheduleReload);
  })();
})();
