// mlx-headroom dashboard: polls the server's own JSON endpoints; no dependencies, no build step.
// URLs are relative to /dashboard/, so the page also works behind a path prefix on the same origin.
"use strict";

const API = {
  memory: "../v1/memory",
  stats: "../v1/stats",
  guard: "../v1/memory-guard",
  version: "../v1/version",
  health: "../health",
};
const FAST_MS = 1000;        // normal polling interval
const SLOW_MS = 5000;        // after an auth failure or when the server is unreachable
const WINDOW_S = 900;        // the chart's span: the server keeps 15 minutes of 1 Hz samples
const WARN_FRACTION = 0.85;  // usage + committed at or above this share of the ceiling: warning
const KEY_STORE = "mlx-headroom.apiKey";
const ADMIN_STORE = "mlx-headroom.adminKey";
const GiB = 2 ** 30;

const $ = (id) => document.getElementById(id);
const view = {
  memory: null,              // the last /v1/memory answer
  guard: null,               // the server's guard state, as last read
  guardKnown: false,         // false until a read succeeds: no made-up state, no controls
  busy: false,               // a guard change is in flight
  pending: null,             // "custom" chosen, no ceiling applied yet: the server state it began from
  history: { at: [], usage: [], committed: [], ceiling: [] },
};

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

// ---------- keys: kept for the tab (sessionStorage) unless the user asks to remember them ----------
function storedKey(name) { return sessionStorage.getItem(name) || localStorage.getItem(name) || ""; }
// The server takes either key for reads; the admin key (or the API key when it covers admin) for changes.
const readKey = () => storedKey(KEY_STORE) || storedKey(ADMIN_STORE);
const writeKey = () => storedKey(ADMIN_STORE) || storedKey(KEY_STORE);

function saveKeys() {
  const remember = $("remember").checked;
  for (const [id, name] of [["api-key", KEY_STORE], ["admin-key", ADMIN_STORE]]) {
    const value = $(id).value.trim();
    sessionStorage.removeItem(name);
    localStorage.removeItem(name);
    if (value) (remember ? localStorage : sessionStorage).setItem(name, value);
  }
}

// ---------- HTTP ----------
class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(url, { method = "GET", body, admin = false } = {}) {
  const key = admin ? writeKey() : readKey();
  const headers = { Accept: "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(url, {
    method, headers, cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = null;
  try { data = await res.json(); } catch { /* not JSON */ }
  if (!res.ok) {
    const msg = (data && data.error && data.error.message) || `${res.status} ${res.statusText}`;
    throw new HttpError(res.status, msg);
  }
  return data;
}

function authMessage(err, admin = false) {
  if (err.status === 401) {
    return `Unauthorized (401): enter a valid ${admin ? "admin" : "API"} key above and save it. ${err.message}`;
  }
  if (err.status === 403) return `Forbidden (403): ${err.message}`;
  return null;
}

function showAlert(text) {
  $("alert").hidden = !text;
  $("alert").textContent = text || "";
}

function setStats(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v, cls, title]) => {
    const dt = el("dt", k);
    if (title) dt.title = title;
    return [dt, el("dd", v, cls)];
  }));
}

// ---------- memory ----------
function level(fraction) {
  if (!Number.isFinite(fraction)) return "";
  return fraction >= 1 ? "bad" : fraction >= WARN_FRACTION ? "warn" : "ok";
}

function renderMemory(m) {
  view.memory = m;
  const hard = m.ceiling.hard_bytes, usage = m.usage_bytes, committed = m.committed_bytes;
  const enabled = m.guard.enabled;
  const prefix = Math.min(m.prefix_cache.bytes, usage);
  const other = Math.max(usage - prefix, 0);
  const free = Math.max(hard - usage - committed, 0);
  const scale = Math.max(hard, usage + committed) || 1;
  const pct = (b) => (100 * b / scale).toFixed(3) + "%";
  const fraction = hard ? (usage + committed) / hard : NaN;

  $("usage").textContent = fmtBytes(usage);
  $("committed").textContent = fmtBytes(committed);
  $("ceiling").textContent = fmtBytes(hard);
  const pctEl = $("usage-pct");
  pctEl.textContent = Number.isFinite(fraction)
    ? `${(100 * fraction).toFixed(1)} %` + (enabled ? "" : " (guard off: not enforced)") : "";
  pctEl.className = "pct " + level(fraction);
  $("bar").className = "bar " + level(fraction);
  for (const [id, bytes] of [["seg-prefix", prefix], ["seg-other", other], ["seg-committed", committed]]) {
    $(id).style.width = pct(bytes);
    $(id).style.minWidth = bytes > 0 ? "3px" : "0";   // keep small but non-zero parts visible
  }
  $("bar").setAttribute("aria-label",
    `${fmtBytes(usage)} used plus ${fmtBytes(committed)} committed of a ${fmtBytes(hard)} ceiling`);
  $("lg-prefix").textContent = fmtBytes(prefix);
  $("lg-other").textContent = fmtBytes(other);
  $("lg-committed").textContent = fmtBytes(committed);
  $("lg-free").textContent = fmtBytes(free);
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();

  $("binding-note").textContent = enabled ? "" : "(guard off: none binding)";
  $("components").replaceChildren(...Object.entries(m.ceiling.components || {}).map(([name, bytes]) => {
    const li = el("li");
    if (enabled && name === m.ceiling.binding) li.className = "binding";
    li.append(el("span", name), el("span", fmtBytes(bytes)));
    return li;
  }));

  const q = m.queue;
  setStats($("queue"), [["waiting", fmtNum(q.waiting)], ["prefilling", fmtNum(q.prefilling)],
    ["running (decoding)", fmtNum(q.running)]]);
  const p = m.prefix_cache;
  const lookups = p.hits + p.misses;
  setStats($("prefix"), [["held", `${fmtBytes(p.bytes)} of ${fmtBytes(p.max_bytes)}`],
    ["entries", fmtNum(p.entries)], ["hits", fmtNum(p.hits)], ["misses", fmtNum(p.misses)],
    ["hit rate", lookups ? (100 * p.hits / lookups).toFixed(1) + " %" : "—"],
    ["evictions", fmtNum(p.evictions)]]);
  renderEngine(m.engine || {});
  renderDecisions(m.decisions || []);
  renderGuard(m.guard);
}

const ENGINE_LABELS = {
  steps: ["engine steps", "steps that prefilled or decoded something"],
  decode_steps: ["decode steps"],
  prefill_chunks: ["prefill chunks"],
  max_batch: ["largest decode batch"],
  batched_steps: ["decode steps with several sequences"],
  generated_tokens: ["tokens generated"],
  prompt_tokens: ["prompt tokens prefilled", "excluding tokens reused from the prefix cache"],
  preemptions: ["preemptions", "prefills sent back to wait so another could finish"],
  oom_recoveries: ["device out-of-memory recoveries"],
  kv_bytes: ["KV cache allocated"],
  admission_checks: ["guard checks"],
};
const ENGINE_SKIP = new Set(["waiting", "prefilling", "running", "committed_bytes", "admission_s"]);

function renderEngine(e) {
  const rows = Object.entries(e).filter(([k]) => !ENGINE_SKIP.has(k)).map(([k, v]) => {
    const [label, title] = ENGINE_LABELS[k] || [k.replaceAll("_", " ")];
    return [label, k.endsWith("_bytes") ? fmtBytes(v) : fmtNum(v), "", title];
  });
  if (Number.isFinite(e.admission_s)) {
    const per = e.admission_checks ? ` (${fmtSecs(e.admission_s / e.admission_checks)} each)` : "";
    rows.push(["time spent in guard checks", fmtSecs(e.admission_s) + per, "",
      "engine-thread time spent asking the memory guard: what the guard costs"]);
  }
  setStats($("engine"), rows);
}

function renderDecisions(list) {
  const body = $("decisions");
  if (!list.length) {
    const td = el("td", "No decisions yet.", "muted");
    td.colSpan = 8;
    const tr = el("tr");
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...[...list].sort((a, b) => b.at - a.at).map((d) => {
    const tr = el("tr");
    const cell = (text, cls) => { const td = el("td", text, cls); tr.append(td); return td; };
    cell(fmtTime(d.at), "num");
    cell(d.request_id || "—", "mono");
    cell("").append(el("span", d.outcome, "badge " + d.outcome));
    cell(fmtBytes(d.predicted_bytes), "num");
    cell(fmtBytes(d.needed_bytes), "num " + (d.needed_bytes > d.limit_bytes ? "bad" : ""));
    cell(fmtBytes(d.limit_bytes), "num");
    cell(d.binding || "—");
    cell((d.reason || "").replace(/^[A-Z]+:\s*/, ""), "reason");   // the badge already says it
    return tr;
  }));
}

// ---------- history chart ----------
function addHistory(h) {
  const hist = view.history;
  for (let i = 0; i < h.at.length; i++) {
    if (hist.at.length && h.at[i] <= hist.at[hist.at.length - 1]) continue;
    hist.at.push(h.at[i]);
    hist.usage.push(h.usage_bytes[i]);
    hist.committed.push(h.usage_bytes[i] + h.committed_bytes[i]);
    hist.ceiling.push(h.ceiling_bytes[i]);
  }
  const cut = hist.at.findIndex((t) => t >= hist.at[hist.at.length - 1] - WINDOW_S);
  if (cut > 0) for (const k of Object.keys(hist)) hist[k].splice(0, cut);
}

function niceStep(max, ticks) {
  // A round step in the unit the axis top is written in, so the labels read 0.5, 1.0, 1.5 MiB.
  const unit = [1024 ** 4, 1024 ** 3, 1024 ** 2, 1024, 1].find((u) => u <= max) || 1;
  const raw = max / ticks / unit;
  const nice = [0.05, 0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000];
  return (nice.find((m) => m >= raw) || 1000) * unit;
}

// Time runs left to right over the last 15 minutes; memory from 0 up. The y-axis fits the data,
// so a small process stays visible; the ceiling is drawn when it is in range, and named otherwise.
function drawChart() {
  const canvas = $("chart");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  const hist = view.history;
  const n = hist.at.length;
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = color("--muted");
  if (!n) { ctx.fillText("waiting for samples…", 10, h / 2); return; }

  const peak = Math.max(...hist.committed, ...hist.usage, 1);
  const hard = hist.ceiling[n - 1];
  const ceilingShown = hard <= peak * 1.6;
  const top = (ceilingShown ? Math.max(hard, peak) : peak) * 1.15;
  const step = niceStep(top, 4);
  const yMax = Math.ceil(top / step) * step;
  const unitIndex = Math.max(0, Math.min(4, Math.floor(Math.log(Math.max(top, 1)) / Math.log(1024))));
  const unitName = ["B", "KiB", "MiB", "GiB", "TiB"][unitIndex];
  const axisLabel = (v) => (v ? +(v / 1024 ** unitIndex).toFixed(2) + " " + unitName : "0");
  const left = Math.max(...[0, 1, 2, 3, 4].map((i) => ctx.measureText(axisLabel(i * step)).width)) + 10;
  const right = 8, topPad = 14, bottom = 20;
  const pw = w - left - right, ph = h - topPad - bottom;
  // The span grows with the history up to 15 minutes, so a young server's chart is not a sliver.
  const tEnd = hist.at[n - 1];
  const span = Math.min(WINDOW_S, Math.max(60, Math.ceil((tEnd - hist.at[0]) / 60) * 60));
  const tStart = tEnd - span;
  const x = (t) => left + pw * (t - tStart) / span;
  $("chart-title").textContent = `Last ${span / 60} minute${span > 60 ? "s" : ""}`;
  const y = (b) => topPad + ph - ph * Math.min(b, yMax) / yMax;

  // warning and critical zones against the current ceiling
  if (ceilingShown) {
    ctx.fillStyle = color("--warn-zone");
    ctx.fillRect(left, y(hard), pw, y(hard * WARN_FRACTION) - y(hard));
    ctx.fillStyle = color("--bad-zone");
    ctx.fillRect(left, topPad, pw, y(hard) - topPad);
  }
  // axes and grid
  ctx.strokeStyle = color("--line");
  ctx.lineWidth = 1;
  ctx.setLineDash([]);
  ctx.fillStyle = color("--muted");
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let v = 0; v <= yMax + 1; v += step) {
    ctx.beginPath(); ctx.moveTo(left, y(v) + 0.5); ctx.lineTo(left + pw, y(v) + 0.5); ctx.stroke();
    ctx.fillText(axisLabel(v), left - 5, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let k = 3; k >= 0; k--) {
    const ago = k * span / 3;
    const t = tEnd - ago;
    const agoText = ago >= 120 ? `−${+(ago / 60).toFixed(1)} min` : `−${Math.round(ago)} s`;
    ctx.beginPath(); ctx.moveTo(x(t) + 0.5, topPad); ctx.lineTo(x(t) + 0.5, topPad + ph); ctx.stroke();
    const clock = span < 300 ? fmtTime(t) : fmtClock(t);
    const label = !k ? "now" : pw < 480 ? agoText : `${clock} (${agoText})`;
    ctx.textAlign = k === 3 ? "left" : k === 0 ? "right" : "center";
    ctx.fillText(label, k === 3 ? Math.max(x(t), left) : x(t), topPad + ph + 5);
  }
  const line = (values, colorName, dash, width = 2) => {
    ctx.beginPath();
    ctx.setLineDash(dash);
    ctx.strokeStyle = color(colorName);
    ctx.lineWidth = width;
    let prevT = null;
    for (let i = 0; i < n; i++) {
      if (hist.at[i] < tStart || values[i] > yMax) { prevT = null; continue; }   // off the chart: a gap
      const gap = prevT === null || hist.at[i] - prevT > 5;   // a pause in sampling is not a straight line
      (gap ? ctx.moveTo : ctx.lineTo).call(ctx, x(hist.at[i]), y(values[i]));
      prevT = hist.at[i];
    }
    ctx.stroke();
  };
  if (ceilingShown) line(hist.ceiling, "--bad", [6, 4], 1.5);
  line(hist.committed, "--committed", [4, 3]);
  line(hist.usage, "--prefix", []);
  ctx.setLineDash([]);
  ctx.textAlign = "right";
  ctx.textBaseline = "top";
  ctx.fillStyle = color("--muted");
  ctx.fillText(ceilingShown ? `ceiling ${fmtBytes(hard)}` : `ceiling ${fmtBytes(hard)} is above the scale ↑`,
    left + pw - 2, 1);
}

// ---------- stats: refusals, throughput, prediction ----------
function renderStats(s) {
  addHistory(s.history);
  drawChart();
  const r = s.refusals;
  const hot = (n) => (n > 0 ? "bad" : "");
  setStats($("refusal-counts"), [
    ["refused, last 5 min", fmtNum(r.last_5_min.reject), hot(r.last_5_min.reject)],
    ["refused since start", fmtNum(r.since_start.reject)],
    ["waited for memory, last 5 min", fmtNum(r.last_5_min.wait), r.last_5_min.wait ? "warn" : ""],
    ["waited since start", fmtNum(r.since_start.wait)],
  ]);
  const list = $("refusals");
  if (!r.recent.length) list.replaceChildren(el("li", "None since start.", "muted"));
  else list.replaceChildren(...r.recent.slice(0, 20).map((d) => {
    const li = el("li");
    const head = el("p", "", "event-head");
    head.append(el("span", d.outcome, "badge " + d.outcome), el("span", fmtTime(d.at), "num"),
      el("span", d.request_id || "", "mono"));
    li.append(head, el("p", `needs ${fmtBytes(d.needed_bytes)} against the ${d.binding} ceiling of ` +
      `${fmtBytes(d.limit_bytes)}: ${fmtBytes(d.over_bytes)} over`, "event-numbers"),
    el("p", (d.reason || "").replace(/^[A-Z]+:\s*/, ""), "reason small"));
    return li;
  }));

  const banner = $("banner");
  const latest = r.latest_reject;
  if (r.last_minute > 0 && latest) {
    banner.hidden = false;
    banner.textContent = `${r.last_minute} request${r.last_minute > 1 ? "s" : ""} refused in the last minute. ` +
      `Latest at ${fmtTime(latest.at)}: it needed ${fmtBytes(latest.needed_bytes)}, the binding ` +
      `${latest.binding} ceiling is ${fmtBytes(latest.limit_bytes)}, ${fmtBytes(latest.over_bytes)} short.`;
  } else {
    banner.hidden = true;
  }

  const t = s.throughput, l = s.latency, q = s.in_flight;
  setStats($("perf"), [
    ["prompt tokens/s", fmtRate(t.prompt_tokens_per_s), "", `over the last ${t.window_s} s`],
    ["generated tokens/s", fmtRate(t.generated_tokens_per_s), "", `over the last ${t.window_s} s`],
    ["time to first token p50 / p95", `${fmtSecs(l.ttft_s.p50)} / ${fmtSecs(l.ttft_s.p95)}`, "",
      `${l.requests} requests in the last ${l.window_s / 60} min`],
    ["time per output token p50 / p95", `${fmtSecs(l.tpot_s.p50)} / ${fmtSecs(l.tpot_s.p95)}`],
    ["requests in flight", fmtNum(q.total)],
    ["requests measured (5 min)", fmtNum(l.requests)],
  ]);
  renderChunks(s.chunks);
}

function renderChunks(c) {
  const rows = c.recent.slice(0, 8);
  $("chunks").replaceChildren(...rows.map((k) => {
    const tr = el("tr");
    const ratio = k.predicted_bytes ? k.measured_bytes / k.predicted_bytes : NaN;
    tr.append(el("td", fmtNum(k.tokens), "num"), el("td", fmtBytes(k.predicted_bytes), "num"),
      el("td", fmtBytes(k.measured_bytes), "num " + (ratio > 1 ? "bad" : "")),
      el("td", Number.isFinite(ratio) ? (100 * ratio).toFixed(0) + " %" : "—", "num"));
    return tr;
  }));
  if (!c.recent.length) { $("pred-summary").textContent = "No prefill chunks yet."; return; }
  const ratios = c.recent.filter((k) => k.predicted_bytes > 0).map((k) => k.measured_bytes / k.predicted_bytes)
    .sort((a, b) => a - b);
  const under = ratios.filter((x) => x > 1).length;
  const median = ratios.length ? ratios[Math.floor(ratios.length / 2)] : NaN;
  $("pred-summary").textContent =
    `Learned ${c.ewma_bytes_per_token === null ? "—" : fmtBytes(c.ewma_bytes_per_token)} per prompt token (EWMA). ` +
    `Over the last ${c.recent.length} chunks the peak was a median ${(100 * median).toFixed(0)} % of the prediction; ` +
    (under ? `${under} went over it.` : "none went over it.");
}

// ---------- guard ----------
function guardText(g) {
  const m = view.memory;
  const hard = m ? ` (${fmtBytes(m.ceiling.hard_bytes)} now, ${m.ceiling.binding})` : "";
  const ceiling = g.tier === "custom" ? `custom ceiling ${fmtBytes(g.ceiling_bytes)}` : `tier ${g.tier}${hard}`;
  return g.enabled ? `Server state: on · ${ceiling}`
    : `Server state: off · nothing is refused · ${ceiling} is not enforced`;
}

function syncControls() {
  const known = view.guardKnown && !view.busy;
  const custom = $("g-tier").value === "custom";
  $("g-enabled").disabled = !known;
  $("g-tier").disabled = !known;
  $("g-ceiling").disabled = !known || !custom;
  $("g-apply").disabled = !known || !custom;
}

function renderGuard(g) {
  view.guard = g;
  view.guardKnown = true;
  $("guard-state").textContent = guardText(g);
  if (view.pending !== null && view.pending !== JSON.stringify(g)) {
    view.pending = null;   // the server changed under an unsaved choice: follow the server
    $("guard-note").textContent = "The server's guard changed; your unapplied choice was dropped.";
  }
  if (!view.busy) {
    $("g-enabled").checked = g.enabled;
    if (view.pending === null) {
      $("g-tier").value = g.tier;
      if (document.activeElement !== $("g-ceiling")) {
        $("g-ceiling").value = g.ceiling_bytes ? gibText(g.ceiling_bytes) : "";
      }
    }
  }
  const total = view.memory && view.memory.system.total_bytes;
  const warn = $("guard-warn");
  warn.hidden = !(g.tier === "custom" && total && g.ceiling_bytes > total);
  warn.textContent = warn.hidden ? "" : `The custom ceiling ${fmtBytes(g.ceiling_bytes)} is above this ` +
    `machine's ${fmtBytes(total)} of memory: the guard cannot refuse anything below the device's own limit.`;
  syncControls();
}

function guardUnknown(reason) {
  view.guardKnown = false;
  $("guard-state").textContent = `Server state unknown: ${reason}`;
  syncControls();
}

async function putGuard(change) {
  const err = $("guard-error");
  err.hidden = true;
  view.busy = true;
  syncControls();
  try {
    const g = await api(API.guard, { method: "PUT", body: change, admin: true });
    view.pending = null;
    view.busy = false;
    renderGuard(g);
    $("guard-note").textContent = "Saved at " + new Date().toLocaleTimeString() + ".";
  } catch (e) {
    err.textContent = authMessage(e, true) || e.message;
    err.hidden = false;
    view.pending = null;
    view.busy = false;
    if (view.guard) renderGuard(view.guard);   // back to what the server has
  }
}

function ceilingFromInput() {
  const gib = Number($("g-ceiling").value.trim());
  return Number.isFinite(gib) && gib > 0 ? Math.max(Math.round(gib * GiB), 1) : null;
}

function wireGuard() {
  $("g-enabled").addEventListener("change", (ev) => putGuard({ enabled: ev.target.checked }));
  $("g-tier").addEventListener("change", (ev) => {
    $("guard-error").hidden = true;
    syncControls();
    if (ev.target.value !== "custom") {
      view.pending = null;
      return putGuard({ tier: ev.target.value });
    }
    const bytes = ceilingFromInput();
    if (bytes) return putGuard({ tier: "custom", ceiling_bytes: bytes });
    view.pending = JSON.stringify(view.guard);
    $("guard-note").textContent = `Enter a ceiling in GiB, then Apply; the server stays on tier ${view.guard.tier} until then.`;
    $("g-ceiling").focus();
  });
  $("guard-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const bytes = ceilingFromInput();
    if (!bytes) {
      $("guard-error").textContent = "The ceiling must be a positive number of GiB, such as 12 or 0.5.";
      $("guard-error").hidden = false;
      return;
    }
    putGuard({ tier: "custom", ceiling_bytes: bytes });
  });
}

// ---------- header ----------
async function loadHeader() {
  try {
    const v = await api(API.version);
    $("version").textContent = `v${v.version} · mlx ${v.mlx} · mlx-lm ${v.mlx_lm} · ${v.backend}`;
  } catch (e) { $("version").textContent = "version unavailable" + (e.status ? ` (${e.status})` : ""); }
  let status = "unreachable";
  try {
    const res = await fetch(API.health, { cache: "no-store" });
    status = (await res.json()).status || String(res.status);
  } catch (e) { /* keep "unreachable" */ }
  $("health").textContent = "health: " + status;
  $("health").className = "pill " + (status === "ok" ? "ok" : "bad");
}

// ---------- polling ----------
let timer = null;
let polling = false;
let again = false;           // poll() was called while a poll ran: run once more right after
let keyEpoch = 0;            // bumped when keys change: answers to the old keys are dropped
let pollCount = 0;
let lastSample = null;

async function poll() {
  clearTimeout(timer);
  if (polling) { again = true; return; }
  polling = true;
  const epoch = keyEpoch;
  let delay = FAST_MS;
  try {
    const since = lastSample === null ? "" : `?since=${lastSample}`;
    const [m, s] = await Promise.all([api(API.memory), api(API.stats + since)]);
    if (epoch === keyEpoch) {
      renderMemory(m);
      renderStats(s);
      if (s.history.at.length) lastSample = s.history.at[s.history.at.length - 1];
      showAlert(null);
    }
  } catch (e) {
    delay = SLOW_MS;
    const auth = authMessage(e);
    if (epoch === keyEpoch) {
      showAlert((auth || `Cannot read the server's state: ${e.message}.`) + " Retrying every 5 s.");
      guardUnknown(auth ? `the server needs a key (${e.status})` : "the server cannot be read");
    }
  } finally {
    polling = false;
  }
  if (pollCount++ % 5 === 0) loadHeader();
  if (again || epoch !== keyEpoch) { again = false; delay = 0; }
  timer = setTimeout(poll, delay);
}

function wireKeys() {
  $("api-key").value = storedKey(KEY_STORE);
  $("admin-key").value = storedKey(ADMIN_STORE);
  $("remember").checked = !!(localStorage.getItem(KEY_STORE) || localStorage.getItem(ADMIN_STORE));
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    saveKeys();
    keyEpoch++;
    showAlert(null);
    $("guard-error").hidden = true;   // an old 401/403 says nothing about the new keys
    loadHeader();
    poll();
  });
}

wireKeys();
wireGuard();
syncControls();
poll();
window.addEventListener("resize", drawChart);
