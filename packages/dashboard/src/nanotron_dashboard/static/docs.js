// The API reference, drawn from this server's /openapi.json: no script from anywhere else.
"use strict";
(async () => {
  const status = document.getElementById("docs-status");
  const out = document.getElementById("endpoints");
  let spec;
  try { spec = await NT.json("/openapi.json"); }
  catch (e) { status.textContent = "could not load /openapi.json: " + e.message; return; }
  status.textContent = `${spec.info.title} ${spec.info.version}`;
  const params = (op) => (op.parameters || []).map((p) =>
    NT.el("li", {}, NT.el("code", {}, p.name), ` (${p.in}${p.required ? ", required" : ""}) `,
      (p.schema && (p.schema.type || (p.schema.anyOf || []).map((s) => s.type).join("|"))) || "",
      p.description ? ": " + p.description : ""));
  for (const [path, ops] of Object.entries(spec.paths).sort()) {
    for (const [method, op] of Object.entries(ops)) {
      out.append(NT.el("section", { class: "endpoint" },
        NT.el("h3", {}, NT.el("code", {}, method.toUpperCase() + " " + path)),
        NT.el("p", {}, op.summary || ""),
        op.description ? NT.el("pre", {}, op.description) : "",
        NT.el("ul", {}, ...params(op))));
    }
  }
})();
