// The run list: fetched from /api/runs, refreshed when /ws/runs says something changed.
"use strict";
(() => {
  const tbody = document.querySelector("#runs tbody");
  const filters = ["project", "name", "status"].map((k) => document.getElementById("f-" + k));

  function row(r) {
    const link = NT.el("a", { href: "/runs/" + encodeURIComponent(r.id) }, r.name || r.id);
    const parent = r.resumed_from
      ? NT.el("a", { href: "/runs/" + encodeURIComponent(r.resumed_from.run_id) },
        r.resumed_from.run_id + " @ " + (r.resumed_from.step ?? "?"))
      : "";
    const cells = [NT.badge(r.status), r.project, link, r.step ?? "",
      NT.num(r.last.lm_loss), NT.num(r.last.tokens_per_sec, 1), NT.age(r.age_s), parent];
    const tr = NT.el("tr", { "data-run-id": r.id });
    cells.forEach((c, i) => tr.append(NT.el("td", { class: [3, 4, 5].includes(i) ? "num" : "" }, c)));
    return tr;
  }

  async function refresh() {
    const q = new URLSearchParams();
    for (const f of filters) if (f.value) q.set(f.id.slice(2), f.value);
    const runs = await NT.json("/api/runs?" + q.toString());
    tbody.replaceChildren(...runs.map(row));
    document.getElementById("empty").hidden = runs.length > 0;
  }

  const soon = NT.throttle(refresh, 500);
  filters.forEach((f) => f.addEventListener("input", soon));
  NT.live("/ws/runs", soon, soon);
  setInterval(refresh, 5000);  // ages and the stalled status move without any message
  refresh();
})();
