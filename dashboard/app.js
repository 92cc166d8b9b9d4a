// mlx-headroom dashboard: polls the server's own JSON endpoints; no dependencies, no build step.
// URLs are relative to /dashboard/, so the page also works behind a path prefix on the same origin.
"use strict";

const API = {
  memory: "../v1/memory",
  guard: "../v1/memory-guard",
  version: "../v1/version",
  health: "../health",
};
const FAST_MS = 1000;        // normal polling interval
const SLOW_MS = 5000;        // after an auth failure or when the server is unreachable
const HISTORY = 120;         // samples kept for the chart
const KEY_STORE = "mlx-headroom.apiKey";
const ADMIN_STORE = "mlx-headroom.adminKey";

const $ = (id) => document.getElementById(id);
const history = [];
let guardDirty = false;      // the user is mid-edit: don't overwrite the guard form
let pollCount = 0;

// ---------- formatting ----------
function fmtBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Math.abs(n), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return (n < 0 ? "-" : "") + v.toFixed(digits) + " " + units[i];
}
const fmtNum = (n) => (Number.isFinite(n) ? n.toLocaleString() : "—");
const fmtTime = (unix) => new Date(unix * 1000).toLocaleTimeString();

// ---------- HTTP ----------
class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(url, { method = "GET", body, admin = false } = {}) {
  const key = (admin && localStorage.getItem(ADMIN_STORE)) || localStorage.getItem(KEY_STORE);
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

function authMessage(err) {
  if (err.status === 401) return `Unauthorized (401): enter a valid API key above. ${err.message}`;
  if (err.status === 403) return `Forbidden (403): this needs the admin key. ${err.message}`;
  return null;
}

function showAlert(text) {
  const el = $("alert");
  el.hidden = !text;
  el.textContent = text || "";
}

// ---------- memory view ----------
function setStats(dl, pairs) {
  dl.replaceChildren(...pairs.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    return [dt, dd];
  }));
}

function renderMemory(m) {
  const hard = m.ceiling.hard_bytes;
  const usage = m.usage_bytes;
  const committed = m.committed_bytes;
  const prefix = Math.min(m.prefix_cache.bytes, usage);
  const other = Math.max(usage - prefix, 0);
  const free = Math.max(hard - usage - committed, 0);
  const scale = Math.max(hard, usage + committed) || 1;
  const pct = (b) => (100 * b / scale).toFixed(3) + "%";

  $("usage").textContent = fmtBytes(usage);
  $("ceiling").textContent = fmtBytes(hard);
  $("usage-pct").textContent = hard ? `(${(100 * (usage + committed) / hard).toFixed(1)}% with committed)` : "";
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

  const comps = Object.entries(m.ceiling.components || {});
  $("components").replaceChildren(...comps.map(([name, bytes]) => {
    const li = document.createElement("li");
    if (name === m.ceiling.binding) li.className = "binding";
    const a = document.createElement("span"); a.textContent = name;
    const b = document.createElement("span"); b.textContent = fmtBytes(bytes);
    li.append(a, b);
    return li;
  }));

  const q = m.queue;
  setStats($("queue"), [["waiting", fmtNum(q.waiting)], ["prefilling", fmtNum(q.prefilling)],
    ["running", fmtNum(q.running)]]);
  const p = m.prefix_cache;
  const lookups = p.hits + p.misses;
  setStats($("prefix"), [["bytes", fmtBytes(p.bytes)], ["entries", fmtNum(p.entries)],
    ["hits", fmtNum(p.hits)], ["misses", fmtNum(p.misses)],
    ["hit rate", lookups ? (100 * p.hits / lookups).toFixed(1) + "%" : "—"],
    ["evictions", fmtNum(p.evictions)]]);
  const e = m.engine || {};
  setStats($("engine"), Object.entries(e)
    .filter(([k]) => !["waiting", "prefilling", "running"].includes(k))
    .map(([k, v]) => [k.replaceAll("_", " "), k.endsWith("_bytes") ? fmtBytes(v) : fmtNum(v)]));

  renderDecisions(m.decisions || []);
  history.push({ usage, committed, hard });
  if (history.length > HISTORY) history.shift();
  drawChart();
}

function renderDecisions(list) {
  const body = $("decisions");
  if (!list.length) {
    body.innerHTML = '<tr><td colspan="7" class="muted">No decisions yet.</td></tr>';
    return;
  }
  const rows = [...list].sort((a, b) => b.at - a.at).map((d) => {
    const tr = document.createElement("tr");
    const cell = (text, cls) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.append(td);
      return td;
    };
    cell(fmtTime(d.at), "num");
    cell(d.request_id || "—", "mono");
    const badge = document.createElement("span");
    badge.className = "badge " + d.outcome;
    badge.textContent = d.outcome;
    cell("").append(badge);
    cell(fmtBytes(d.needed_bytes), "num");
    cell(fmtBytes(d.limit_bytes), "num");
    cell(d.binding || "—");
    cell((d.reason || "").replace(/^[A-Z]+:\s*/, ""), "reason");   // the badge already says it
    return tr;
  });
  body.replaceChildren(...rows);
}

// Usage (solid) and usage + committed (dashed) over time. The y-axis fits the data, so a small
// process is still visible; the ceiling is drawn when it is within range, and noted otherwise.
function drawChart() {
  const canvas = $("spark");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== w * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  if (!history.length) return;
  const css = getComputedStyle(document.documentElement);
  const peak = Math.max(...history.map((s) => s.usage + s.committed));
  const hard = history[history.length - 1].hard;
  const ceilingShown = hard <= peak * 1.5;
  const yMax = (ceilingShown ? Math.max(hard, peak) : peak * 1.25) * 1.05 || 1;
  const x = (i) => (w - 4) * i / (HISTORY - 1) + 2;
  const y = (b) => h - 4 - (h - 8) * b / yMax;
  const line = (get, color, dash) => {
    ctx.beginPath();
    ctx.setLineDash(dash);
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    const off = HISTORY - history.length;
    history.forEach((s, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, x(off + i), y(get(s))));
    ctx.stroke();
  };
  if (ceilingShown) line((s) => s.hard, css.getPropertyValue("--bad"), [6, 4]);
  line((s) => s.usage + s.committed, css.getPropertyValue("--committed"), [3, 3]);
  line((s) => s.usage, css.getPropertyValue("--prefix"), []);
  $("spark-note").textContent =
    `solid: usage · dotted: usage + committed · top of chart ${fmtBytes(yMax)}` +
    (ceilingShown ? " · dashed red: ceiling" : ` · ceiling ${fmtBytes(hard)} is off the scale`);
}

// ---------- guard ----------
function renderGuard(g, force = false) {
  if (!force && (guardDirty || $("guard-form").contains(document.activeElement))) return;
  $("guard-state").textContent =
    `Server state: ${g.enabled ? "on" : "off"} · tier ${g.tier} · ceiling ` +
    (g.ceiling_bytes ? fmtBytes(g.ceiling_bytes) : "from tier");
  $("g-enabled").checked = g.enabled;
  $("g-tier").value = g.tier;
  $("g-ceiling").value = g.ceiling_bytes ? +(g.ceiling_bytes / 2 ** 30).toFixed(3) : "";
  syncCeilingInput();
}

function syncCeilingInput() {
  const custom = $("g-tier").value === "custom";
  $("g-ceiling").disabled = !custom;
  $("g-apply").disabled = !custom;
}

async function putGuard(change) {
  const err = $("guard-error");
  err.hidden = true;
  try {
    const g = await api(API.guard, { method: "PUT", body: change, admin: true });
    guardDirty = false;
    renderGuard(g, true);
    $("guard-state").textContent += " · saved " + new Date().toLocaleTimeString();
  } catch (e) {
    err.textContent = authMessage(e) || e.message;
    err.hidden = false;
    guardDirty = false;
    loadGuard(true);
  }
}

async function loadGuard(force = false) {
  try { renderGuard(await api(API.guard), force); } catch (e) { /* the memory poll reports errors */ }
}

function ceilingFromInput() {
  const gib = parseFloat($("g-ceiling").value);
  return Number.isFinite(gib) && gib > 0 ? Math.round(gib * 2 ** 30) : null;
}

function wireGuard() {
  $("g-enabled").addEventListener("change", (ev) => putGuard({ enabled: ev.target.checked }));
  $("g-tier").addEventListener("change", (ev) => {
    syncCeilingInput();
    if (ev.target.value !== "custom") return putGuard({ tier: ev.target.value });
    const bytes = ceilingFromInput();
    if (bytes) return putGuard({ tier: "custom", ceiling_bytes: bytes });
    guardDirty = true;   // wait for a ceiling before sending
    $("g-ceiling").focus();
    $("guard-state").textContent = "Enter a ceiling in GiB, then Apply.";
  });
  $("guard-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const bytes = ceilingFromInput();
    if (!bytes) {
      $("guard-error").textContent = "The ceiling must be a positive number of GiB.";
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
  const el = $("health");
  el.textContent = "health: " + status;
  el.className = "pill " + (status === "ok" ? "ok" : "bad");
}

// ---------- polling ----------
async function poll() {
  let delay = FAST_MS;
  try {
    renderMemory(await api(API.memory));
    showAlert(null);
  } catch (e) {
    delay = SLOW_MS;
    showAlert((authMessage(e) || `Cannot read ${API.memory}: ${e.message}.`) + " Retrying every 5 s.");
  }
  pollCount++;
  if (pollCount % 5 === 0) loadHeader();
  if (pollCount % 10 === 0) loadGuard();
  setTimeout(poll, delay);
}

function wireKeys() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("admin-key").value = localStorage.getItem(ADMIN_STORE) || "";
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    for (const [id, store] of [["api-key", KEY_STORE], ["admin-key", ADMIN_STORE]]) {
      const v = $(id).value.trim();
      if (v) localStorage.setItem(store, v); else localStorage.removeItem(store);
    }
    showAlert(null);
    loadHeader();
    loadGuard(true);
  });
}

wireKeys();
wireGuard();
loadHeader();
loadGuard(true);
poll();
window.addEventListener("resize", drawChart);
