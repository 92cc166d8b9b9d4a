// Formatting and small DOM helpers shared by the dashboard's scripts.
"use strict";

const GiB = 2 ** 30;
const WARN_FRACTION = 0.85;  // usage + committed at or above this share of the ceiling: warning
const $ = (id) => document.getElementById(id);

// ---------- formatting ----------
function fmtBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Math.abs(n), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return (n < 0 ? "-" : "") + v.toFixed(digits) + " " + units[i];
}
function fmtSecs(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "—";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}
const fmtNum = (n) => (Number.isFinite(n) ? n.toLocaleString() : "—");
const fmtRate = (n) => (Number.isFinite(n) ? n.toFixed(n < 10 ? 1 : 0) + " tok/s" : "—");
const fmtTime = (unix) => new Date(unix * 1000).toLocaleTimeString();
const fmtClock = (unix) => new Date(unix * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
const gibText = (bytes) => String(+(bytes / GiB).toPrecision(6));

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function setStats(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v, cls, title]) => {
    const dt = el("dt", k);
    if (title) dt.title = title;
    return [dt, el("dd", v, cls)];
  }));
}

// ok, warn (from 85 % of the ceiling) or bad (over it)
function level(fraction) {
  if (!Number.isFinite(fraction)) return "";
  return fraction >= 1 ? "bad" : fraction >= WARN_FRACTION ? "warn" : "ok";
}
