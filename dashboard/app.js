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
const KEY_STORE = "mlx-headroom.apiKey";
const ADMIN_STORE = "mlx-headroom.adminKey";

const view = {
  memory: null,              // the last /v1/memory answer
  guard: null,               // the server's guard state, as last read
  guardKnown: false,         // false until a read succeeds: no made-up state, no controls
  busy: false,               // a guard change is in flight
  guardEpoch: 0,             // bumped by each change: a poll sent before it carries an older state
  pending: null,             // "custom" chosen, no ceiling applied yet: the server state it began from
  history: { at: [], usage: [], committed: [], ceiling: [] },
};

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

// ---------- memory ----------
function renderMemory(m, guardFresh = true) {
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
  // No cap by default: the cache may hold what the memory guard leaves free (budget_bytes).
  const limit = p.max_bytes == null ? `${fmtBytes(p.budget_bytes)} free under the ceiling`
    : `a ${fmtBytes(p.max_bytes)} cap`;
  const byCause = Object.entries(p.evictions_by_cause || {})
    .map(([cause, n]) => `${fmtNum(n)} ${cause}`).join(", ");
  setStats($("prefix"), [["held", `${fmtBytes(p.bytes)} of ${limit}`],
    ["blocks", fmtNum(p.entries)], ["hits", fmtNum(p.hits)], ["misses", fmtNum(p.misses)],
    ["hit rate", lookups ? (100 * p.hits / lookups).toFixed(1) + " %" : "—"],
    ["tokens from the cache", fmtNum(p.hit_tokens)],
    ["blocks evicted", `${fmtNum(p.evictions)}` + (byCause ? ` (${byCause})` : "")],
    ...(p.disk ? [["on disk", `${fmtBytes(p.disk.bytes)} in ${fmtNum(p.disk.blocks)} blocks; `
      + `${fmtNum(p.disk.hits)} read back, ${fmtNum(p.disk.written)} written`]] : [])]);
  renderEngine(m.engine || {});
  renderModels(m.models || null);
  renderDecisions(m.decisions || []);
  if (guardFresh && !view.busy) renderGuard(m.guard);
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

function renderStats(s) {
  addHistory(view.history, s.history);
  drawChart(view.history);
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
  const guardEpoch = view.guardEpoch;
  let delay = FAST_MS;
  try {
    const since = lastSample === null ? "" : `?since=${lastSample}`;
    const [m, s] = await Promise.all([api(API.memory), api(API.stats + since)]);
    if (epoch === keyEpoch) {
      renderMemory(m, guardEpoch === view.guardEpoch);
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
window.addEventListener("resize", () => drawChart(view.history));
