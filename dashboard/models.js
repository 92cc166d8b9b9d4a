// The models card: shown when the server has several models (GET /v1/memory → models).
"use strict";

function renderModels(pool) {
  const card = $("models-card");
  card.hidden = !pool;
  if (!pool) return;
  $("models").replaceChildren(...pool.models.map((m) => {
    const tr = el("tr");
    tr.dataset.model = m.id;
    tr.append(el("td", m.id + (m.pinned ? " (pinned)" : "")), el("td", m.state, "state " + m.state),
      el("td", m.state === "loaded" ? fmtBytes(m.weight_bytes) : "—"),
      el("td", m.state === "loaded" ? fmtBytes(m.kv_bytes) : "—"),
      el("td", fmtNum(m.requests)));
    return tr;
  }));
  const last = pool.unloads[pool.unloads.length - 1];
  $("models-note").textContent = last
    ? `last unload: ${last.model} (${last.reason}), ${fmtBytes(last.freed_bytes)} given back ` +
      `of ${fmtBytes(last.weight_bytes)} of weights; ${fmtNum(pool.refusals)} load(s) refused`
    : `no unloads yet; ${fmtNum(pool.refusals)} load(s) refused`;
}
