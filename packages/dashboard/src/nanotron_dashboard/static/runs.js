// The run list: one page from /api/runs (more on demand), then kept current from /ws/runs:
// each runs_changed message refetches only the runs it names. Ages tick locally.
"use strict";
(() => {
  const tbody = document.querySelector("#runs tbody");
  const more = document.getElementById("more");
  const filters = ["project", "name", "status", "tag"].map((k) => document.getElementById("f-" + k));
  const PAGE = 100;
  let stallSeconds = 120;
  let cursor = null;
  const shown = new Map();  // run id -> {run, seenAt (ms), tr}

  function query(extra) {
    const q = new URLSearchParams(extra || {});
    for (const f of filters) if (f.value) q.set(f.id.slice(2), f.value);
    return q;
  }

  function age(entry) {  // the heartbeat age now, from the age when fetched
    const a = entry.run.age_s;
    return a === null || a === undefined ? null : a + (Date.now() - entry.seenAt) / 1000;
  }

  function statusNow(entry) {
    const a = age(entry);
    return entry.run.status === "running" && a !== null && a > stallSeconds ? "stalled" : entry.run.status;
  }

  function row(entry) {
    const r = entry.run;
    const link = NT.el("a", { href: "/runs/" + encodeURIComponent(r.id) }, r.name || r.id);
    const parent = r.resumed_from
      ? NT.el("a", { href: "/runs/" + encodeURIComponent(r.resumed_from.run_id) },
        r.resumed_from.run_id + " @ " + (r.resumed_from.step ?? "?"))
      : "";
    const status = NT.el("span", {}, NT.badge(statusNow(entry)));
    if (r.nonfinite) status.append(" ", NT.nanBadge(r.nonfinite));
    const name = NT.el("span", {}, link, ...(r.tags || []).map((t) =>  // a tag filters the list
      NT.el("span", { class: "tag", "data-tag": t, onclick: () => { filters[3].value = t; refilter(); } }, t)));
    const badges = NT.el("span", { class: "events" }, ...Object.entries(r.events || {}).map(([kind, e]) =>
      NT.el("span", { class: "badge ev " + e.severity, "data-kind": kind, title: e.count + " " + kind + " event(s), worst: " + e.severity },
        kind + " " + e.count)));
    const cells = [status, r.project, name, r.step ?? "",
      NT.num(r.last.lm_loss), NT.num(r.last.tokens_per_sec, 1), NT.age(age(entry)), parent, badges];
    const tr = NT.el("tr", { "data-run-id": r.id });
    cells.forEach((c, i) => tr.append(NT.el("td", { class: [3, 4, 5].includes(i) ? "num" : "" }, c)));
    return tr;
  }

  const refilter = NT.throttle(() => page(true), 300);

  function order(a, b) { return (b.run.started || 0) - (a.run.started || 0); }

  function render() {
    const entries = Array.from(shown.values()).sort(order);
    for (const e of entries) e.tr = row(e);
    tbody.replaceChildren(...entries.map((e) => e.tr));
    document.getElementById("empty").hidden = entries.length > 0;
    more.hidden = cursor === null;
  }

  async function page(reset) {
    const q = query({ limit: PAGE });
    if (!reset && cursor) q.set("cursor", cursor);
    const r = await fetch("/api/runs?" + q, { credentials: "same-origin" });
    if (!r.ok) return;
    const runs = await r.json();
    if (reset) shown.clear();
    cursor = r.headers.get("X-Next-Cursor");
    const now = Date.now();
    for (const run of runs) shown.set(run.id, { run, seenAt: now });
    render();
  }

  // Only the named runs: updated, added (if they match the filters), or dropped.
  async function changed(ids) {
    const runs = await NT.json("/api/runs?" + query({ ids: ids.join(","), limit: 1000 }));
    const now = Date.now();
    const got = new Set(runs.map((r) => r.id));
    for (const id of ids) if (!got.has(id)) shown.delete(id);
    for (const run of runs) shown.set(run.id, { run, seenAt: now });
    render();
  }

  let pending = new Set();
  const flush = NT.throttle(() => { const ids = Array.from(pending); pending = new Set(); if (ids.length) changed(ids); }, 300);
  function onMessage(msg) {
    if (msg.type !== "runs_changed") return;
    msg.ids.forEach((id) => pending.add(id));
    flush();
  }

  filters.forEach((f) => f.addEventListener("input", refilter));
  more.addEventListener("click", () => page(false));
  setInterval(render, 5000);  // ages and the stalled status move without any message
  (async () => {
    const s = await NT.session();
    stallSeconds = s.stall_seconds;
    await page(true);
    NT.live("/ws/runs", onMessage, () => page(true));
  })();
})();
