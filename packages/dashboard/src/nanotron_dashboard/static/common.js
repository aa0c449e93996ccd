// Shared helpers. User text only ever goes through textContent (never innerHTML).
"use strict";
const NT = {
  csrf: null,
  // The session (launch allowed?, CSRF token, stall threshold), fetched once.
  async session() {
    if (!NT._session) NT._session = NT.json("/api/session");
    const s = await NT._session;
    NT.csrf = s.csrf;
    return s;
  },
  // State-changing requests carry the CSRF token (a header no other site's page can set).
  async json(url, opts) {
    opts = Object.assign({ credentials: "same-origin" }, opts || {});
    if (opts.method && opts.method !== "GET") opts.headers = Object.assign({ "X-CSRF-Token": NT.csrf || "" }, opts.headers || {});
    const r = await fetch(url, opts);
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.detail ? JSON.stringify(body.detail) : r.statusText);
    return body;
  },
  el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return e;
  },
  num(v, digits) {
    if (v === null || v === undefined) return "";
    if (typeof v === "string") return v;  // "NaN", "Infinity", "-Infinity"
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(digits || 3);
    return Number.isInteger(v) ? String(v) : v.toFixed(digits || 4);
  },
  age(s) {
    if (s === null || s === undefined) return "";
    if (s < 60) return Math.round(s) + "s";
    if (s < 3600) return Math.round(s / 60) + "m";
    if (s < 86400) return (s / 3600).toFixed(1) + "h";
    return (s / 86400).toFixed(1) + "d";
  },
  // A run that logged NaN/inf: a badge naming the first step and metric.
  nanBadge(nf) {
    return NT.el("span", { class: "badge nan", "data-nonfinite": nf.step, title: "first non-finite value: " + nf.metric + " at step " + nf.step }, "NaN @ " + nf.step);
  },
  badge(status) { return NT.el("span", { class: "badge " + status, "data-status": status }, status); },
  // A websocket that reconnects; onOpen lets the page refetch what it may have missed.
  live(path, onMessage, onOpen) {
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
    let delay = 500;
    const connect = () => {
      const ws = new WebSocket(url);
      ws.onopen = () => { delay = 500; if (onOpen) onOpen(); };
      ws.onmessage = (ev) => onMessage(JSON.parse(ev.data));
      ws.onclose = () => { setTimeout(connect, delay); delay = Math.min(delay * 2, 10000); };
    };
    connect();
  },
  throttle(fn, ms) {
    let pending = false;
    return () => { if (pending) return; pending = true; setTimeout(() => { pending = false; fn(); }, ms); };
  },
};
