// The guard card: the server's state as read, and the changes the operator sends.
"use strict";

function guardText(g) {
  const m = view.memory;
  const hard = m ? ` (${fmtBytes(m.ceiling.hard_bytes)} now, ${m.ceiling.binding})` : "";
  const ceiling = g.tier === "custom" ? `custom ceiling ${fmtBytes(g.ceiling_bytes)}` : `tier ${g.tier}${hard}`;
  return g.enabled ? `Server state: on · ${ceiling}`
    : `Server state: off · nothing is refused · ${ceiling} is not enforced`;
}

function syncControls() {
  $("guard-form").hidden = !view.guardKnown;   // no form showing a state nobody has read
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
    `machine's ${fmtBytes(total)} of memory: the guard will admit work the machine cannot hold ` +
    "(only the device limit, where there is one, still applies).";
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
    view.guardEpoch++;
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

