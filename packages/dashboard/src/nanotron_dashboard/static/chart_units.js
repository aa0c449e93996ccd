// The run page's chart formatting: compact tick labels, each metric's unit, the x range of
// a lone point. Shared by run.js (plain functions, no state).
"use strict";
const NTU = (() => {
  // Compact tick labels: 1.2M tokens, 3e-4 learning rates.
  function si(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e9) return +(v / 1e9).toPrecision(3) + "G";
    if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
    if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "k";
    if (a < 1e-2) return v.toExponential(1);
    return String(+v.toPrecision(3));
  }

  // Each metric's unit: the y axis label and the legend values. Bytes are shown in MiB (as
  // the trainer's log lines print them).
  const UNITS = {
    lm_loss: "nats/token", val_loss: "nats/token", grad_norm: "L2 norm", lr: "learning rate",
    tokens_per_sec: "tokens/s", tokens_per_sec_per_gpu: "tokens/s per GPU", time_per_iteration_ms: "ms",
    model_tflops_per_gpu: "TFLOP/s per GPU", mfu: "fraction of peak", memory: "MiB",
    global_batch_size: "sequences", consumed_tokens: "tokens",
    // SFT: the tokens trained on (the assistant's), per step and per second
    labelled_tokens: "labelled tokens", labelled_tokens_per_sec: "labelled tokens/s",
  };
  const MIB = 1024 * 1024;
  function unitOf(name) {
    if (UNITS[name]) return UNITS[name];
    if (/(_|^)bytes$|mem/.test(name)) return "MiB";
    if (/_ms$/.test(name)) return "ms";
    if (/_pct$/.test(name)) return "%";
    if (/_w$/.test(name)) return "W";
    if (/_z$/.test(name)) return "robust z-score";
    return "";
  }
  const isBytes = (name) => unitOf(name) === "MiB";
  const X_UNITS = { step: "step", tokens: "tokens", time: "s since start" };
  // One point (or one x value): its own range around it, not uPlot's default from 0
  function xRange(u, min, max) {
    if (min === null || max === null) return [0, 1];
    if (min !== max) return [min, max];
    const pad = Math.max(1, Math.abs(min) * 0.05);
    return [min - pad, max + pad];
  }

  return { si, MIB, unitOf, isBytes, X_UNITS, xRange };
})();
