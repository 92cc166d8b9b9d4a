// The memory chart: the server's 1 Hz history on a canvas, with time and memory axes.
"use strict";

const WINDOW_S = 900;        // the chart's span at most: the server keeps 15 minutes of 1 Hz samples

// Append the samples of a /v1/stats answer (columns) to `hist`, keeping WINDOW_S of them.
function addHistory(hist, h) {
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
function drawChart(hist) {
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

