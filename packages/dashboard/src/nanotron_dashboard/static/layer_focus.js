// The layers that moved first before an alert: a button on each alert of the events list
// (non-finite loss, loss spike, grad-norm spike) opens the Layers heatmap on a window of detail
// steps centred on the alert's step, its rows in the order the server ranked them
// (/layer_stats/moved_first: how early, then how far, each row departed from its own baseline),
// and lists the rows that departed. Trainer text only through textContent.
"use strict";
const NTLF = (() => {
  const $ = (id) => document.getElementById(id);
  const ALERTS = new Set(["nonfinite_loss", "loss_spike", "grad_norm_spike"]);
  const LISTED = 10;  // departed rows named in the list (the heatmap shows them all, in order)

  // On every alert row of the events table that has a step, once: the button.
  function linkAlerts(events, onPick) {
    const byId = new Map((events || []).map((e) => [String(e.id), e]));
    for (const tr of document.querySelectorAll("#events tbody tr[data-event-id]")) {
      const e = byId.get(tr.getAttribute("data-event-id"));
      if (!e || !ALERTS.has(e.kind) || !Number.isInteger(e.step) || tr.querySelector(".moved-first")) continue;
      const b = NT.el("button", { class: "moved-first", "data-step": e.step, type: "button",
        title: "the Layers heatmap around step " + e.step + ", layers ranked by how early they left their baseline" },
      "layers that moved first");
      b.addEventListener("click", () => onPick(e));
      tr.querySelector(".event-message").append(" ", b);
    }
  }

  // The heatmap response with its rows in the ranked order (rows not ranked: after, as they were).
  function reorder(h, moved) {
    const at = new Map(h.rows.map((r, i) => [r, i]));
    const first = moved.ranked.map((r) => at.get(r.row)).filter((i) => i !== undefined);
    const taken = new Set(first);
    const perm = [...first, ...h.rows.map((_, i) => i).filter((i) => !taken.has(i))];
    return Object.assign({}, h, { rows: perm.map((i) => h.rows[i]), values: h.values.map((col) => perm.map((i) => col[i])) });
  }

  function describe(r) {
    return r.row + ": step " + r.first_step + ", " + NT.num(r.departure, 3) + " spreads (" +
      NT.num(r.value, 4) + " against a median of " + NT.num(r.median, 4) + ")";
  }

  // The list above the heatmap; hidden when no alert is in focus.
  function show(moved, alert, statLabel) {
    $("layer-focus").hidden = !moved;
    if (!moved) return;
    const departed = moved.ranked.filter((r) => r.first_step !== null);
    const what = alert.kind.replace(/_/g, " ") + " at step " + moved.step;
    $("layer-focus-text").textContent = moved.lead_steps.length
      ? "Layers that moved first before the " + what + ": " + statLabel + " at the detail steps " +
        moved.lead_steps.join(", ") + " against each layer's median over the " + moved.baseline_steps.length +
        " before, in robust spreads (departed: " + NT.num(moved.threshold, 3) + " or more); rows ranked, earliest first."
      : "No detail step at or before the " + what + ".";
    $("layer-moved").replaceChildren(...(departed.length
      ? departed.slice(0, LISTED).map((r) => NT.el("li", { "data-row": r.row }, describe(r)))
      : moved.lead_steps.length ? [NT.el("li", {}, "no layer departed from its baseline")] : []));
  }

  // x of the alert on the heatmap: after the column of the newest detail step at or before it.
  function markerColumn(steps, step) {
    let j = -1;
    steps.forEach((s, i) => { if (s <= step) j = i; });
    return j;
  }

  return { linkAlerts, reorder, show, markerColumn };
})();
